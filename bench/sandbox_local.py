"""Cost of the local sandbox per RunTests task: through the service against a bare `python -I -c`.

    service                      `python -m services.sandbox` (local backend, isolated), RunTests over gRPC
    LocalBackend(isolate=True)   the same backend called in-process: bwrap's net/pid/ipc/uts/mount
                                 namespaces, tmpfs work folder, uid drop; as root, RunTests sandboxes
                                 that serve calls one after another, a forked child per call and a
                                 reset between calls (services/sandbox/local_workers.py); otherwise
                                 one sandbox per call, started ahead of it (warm_pool.py)
    LocalBackend(isolate=False)  the same launcher and harness as a plain child process, one per call
    bare python                  `<the service's interpreter> -I -c "<program + tests>"` through
                                 subprocess.run: what a reward function that runs each completion in a
                                 subprocess costs (the baseline, measured in the same run)

First the bare cost of the namespaces: `/bin/true` under the backend's bwrap arguments against
`/bin/true`. Then each side runs the same small program and tests (a HumanEval-sized task) N times
at concurrency 1, then at `--concurrency` (bare python: a thread pool of that many). The ratio
lines compare per-task medians at concurrency 1 (lower is better, 1.0 is parity):
`local_isolated_vs_unisolated: R`, `backend_task_vs_bare_python: R` and, last,
`local_task_vs_bare_python: R` (through the service; goal <= 1.5: scoring at the cost of a bare
subprocess, isolation kept). The tasks/s lines show the CPU side: a serving sandbox pays a fork per
task, not an interpreter start, so it raises tasks per second as well as shortening latency.

    .venv/bin/python bench/sandbox_local.py            # needs bwrap (apt-get install bubblewrap)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sandbox import start_service, stop, wait_serving  # noqa: E402
from dockyard.api.common.v1 import common_pb2  # noqa: E402
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402
from dockyard.rpc.client import connect  # noqa: E402
from services.sandbox.backend import ResourceLimits, Status  # noqa: E402
from services.sandbox.local import LocalBackend  # noqa: E402

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


async def service_seconds(concurrency: int, runs: int) -> tuple[list[float], float]:
    """RunTests through the sandbox service (`python -m services.sandbox`, local backend, isolated)
    over gRPC: per-task seconds at concurrency 1, then tasks/s at `concurrency`."""
    request = sandbox_pb2.RunTestsRequest(
        program=PROGRAM,
        tests=TESTS,
        limits=sandbox_pb2.Limits(
            timeout_seconds=LIMITS.timeout_seconds,
            memory_mb=LIMITS.memory_mb,
            cpu_seconds=LIMITS.cpu_seconds,
            max_output_bytes=LIMITS.max_output_bytes,
        ),
    )
    with tempfile.TemporaryDirectory() as workdir:
        settings = {"BACKEND": "local", "MAX_CONCURRENCY": str(concurrency), "WORK_ROOT": workdir}
        proc, address, log = start_service(settings, workdir)
        try:
            await wait_serving(proc, address, log)
            async with connect(address, service="dockyard.sandbox.v1.SandboxService", default_timeout=60.0) as channel:
                stub = sandbox_pb2_grpc.SandboxServiceStub(channel)

                async def one() -> float:
                    start = time.perf_counter()
                    reply = await stub.RunTests(request)
                    assert reply.verdict.status == common_pb2.VERDICT_STATUS_PASSED, reply.verdict
                    return time.perf_counter() - start

                for _ in range(3):  # warm the page cache and the service's sandboxes
                    await one()
                times = [await one() for _ in range(runs)]
                start = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(runs)))
                return times, runs / (time.perf_counter() - start)
        finally:
            stop(proc)


BARE_ARGV = [sys.executable, "-I", "-c", PROGRAM + "\n".join(TESTS) + "\n"]


def bare_python_seconds(runs: int) -> list[float]:
    """Per-task seconds of the same program and tests as one bare `python -I -c`, at concurrency 1."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(BARE_ARGV, check=True)
        times.append(time.perf_counter() - start)
    return times


def bare_python_rate(runs: int, concurrency: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: subprocess.run(BARE_ARGV, check=True), range(runs)))
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
    bare_python_seconds(3)
    medians["bare"] = statistics.median(bare_python_seconds(args.runs))
    rate = bare_python_rate(args.runs, args.concurrency)
    print(
        f"bare python -I -c: median {medians['bare'] * 1000:.1f} ms per task at concurrency 1, "
        f"{rate:.1f} tasks/s at concurrency {args.concurrency}"
    )
    await isolated.close()
    times, rate = await service_seconds(args.concurrency, args.runs)
    medians["service"] = statistics.median(times)
    print(
        f"service (gRPC RunTests, local backend): median {medians['service'] * 1000:.1f} ms per task at "
        f"concurrency 1, {rate:.1f} tasks/s at concurrency {args.concurrency}"
    )
    print(f"isolation adds {(medians['isolated'] - medians['unisolated']) * 1000:.1f} ms per task")
    print(f"local_isolated_vs_unisolated: {medians['isolated'] / medians['unisolated']:.3f}")
    print(f"backend_task_vs_bare_python: {medians['isolated'] / medians['bare']:.3f}")
    print(f"local_task_vs_bare_python: {medians['service'] / medians['bare']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
