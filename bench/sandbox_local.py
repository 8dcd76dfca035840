"""Cost of the local backend's isolation: RunTests per task, in namespaces versus a plain child.

    LocalBackend(isolate=True)   bwrap: net/pid/ipc/uts/mount namespaces, tmpfs work folder, uid drop
    LocalBackend(isolate=False)  the same launcher and harness as a plain child process (baseline)

First the bare cost of the namespaces: `/bin/true` under the backend's bwrap arguments against
`/bin/true`. Then both run the same small program and tests (a HumanEval-sized task) N times at concurrency 1,
then at `--concurrency`; the last line is `local_isolated_vs_unisolated: R` (per-task time
ratio at concurrency 1; lower is better, 1.0 is parity). Goal: isolation adds milliseconds, not
seconds, per task.

    .venv/bin/python bench/sandbox_local.py            # needs bwrap (apt-get install bubblewrap)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time

from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.local import LocalBackend

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
LIMITS = ResourceLimits(timeout_seconds=10.0, memory_mb=512, cpu_seconds=10.0, max_output_bytes=16384)


async def per_task_seconds(backend: LocalBackend, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = await backend.run_tests(PROGRAM, TESTS, LIMITS)
        times.append(time.perf_counter() - start)
        assert out.status is Status.PASSED, out
    return times


async def tasks_per_second(backend: LocalBackend, runs: int) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(*(backend.run_tests(PROGRAM, TESTS, LIMITS) for _ in range(runs)))
    assert all(out.status is Status.PASSED for out in outs)
    return runs / (time.perf_counter() - start)


def spawn_overhead_ms(runs: int) -> tuple[float, float]:
    """Median ms of `/bin/true` under the backend's bwrap arguments, and bare."""
    work = tempfile.mkdtemp()
    bwrap = LocalBackend(max_concurrency=1)._spawn_argv([], work, 2, None, LIMITS)
    bwrap = bwrap[: bwrap.index("--") + 1]
    medians = []
    for argv in (bwrap + ["/bin/true"], ["/bin/true"]):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(argv, check=True)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times) * 1000)
    os.rmdir(work)
    return medians[0], medians[1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    isolated = await LocalBackend.open(max_concurrency=args.concurrency)
    sandboxed, bare = spawn_overhead_ms(args.runs)
    print(f"spawn: bwrap /bin/true {sandboxed:.1f} ms, /bin/true {bare:.1f} ms (medians)")
    medians = {}
    for name, backend in (
        ("isolated", isolated),
        ("unisolated", LocalBackend(max_concurrency=args.concurrency, isolate=False)),
    ):
        await per_task_seconds(backend, 3)  # warm the page cache
        medians[name] = statistics.median(await per_task_seconds(backend, args.runs))
        rate = await tasks_per_second(backend, args.runs)
        print(
            f"{name}: median {medians[name] * 1000:.1f} ms per task at concurrency 1, "
            f"{rate:.1f} tasks/s at concurrency {args.concurrency}"
        )
    print(f"isolation adds {(medians['isolated'] - medians['unisolated']) * 1000:.1f} ms per task")
    print(f"local_isolated_vs_unisolated: {medians['isolated'] / medians['unisolated']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
