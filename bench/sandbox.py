"""The sandbox service's docker backend vs a bare `docker run`, on the same command, in one run.

    service     client --Execute(command)--> sandbox service --docker SDK--> one locked-down container
    session     client --OpenSession--> a warm session container (PrepareSessions sized the pool)
                       --SessionExec(command)--> docker exec in it   (timed: open + exec; CloseSession after)
    docker run  subprocess: docker run --rm --network none IMAGE command

The script starts the sandbox service (`python -m services.sandbox`, docker
backend, max_concurrency 4) on a free port and stops it at the end. The image
must exist (deploy/images/build.sh). Both paths run the same argv in the same
image: a small Python test that imports pytest and checks a few assertions.

At concurrency 1 the paths alternate run by run, --runs times each, after
--warmup runs of each (--settle S seconds apart: the service's warm pools start a
taken container's replacement, and remove an ended container, after the call has
its reply, so without it that work lands on the next path's timed task); the
per-task time is the mean wall time a caller sees.
Then each path runs --runs tasks at concurrency 2 and 4 (that many callers at
once) for tasks/s. Prints a table, then `sandbox_vs_docker_run: R`, R = the
service's per-task time / bare docker run's at concurrency 1 (1.0 is parity,
lower is better), `session_open_vs_docker_run: R`, R = the mean time of
OpenSession from the warm pool / bare docker run's per-task time (what a warm
session saves: the goal is R <= 0.1), and `session_task_vs_docker_run: R`, R =
the session path's per-task time (OpenSession + SessionExec of the command) /
bare docker run's. The service adds the locked-down settings (read-only root,
no capabilities, limits, a work folder, output capture) and a gRPC hop; the
session path's container was started ahead (its pool holds WARM sessions, and
a taken one is replaced in the background while the other paths run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect, health_status
from services.sandbox.images import SANDBOX_IMAGE

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST = "\n".join(
    ["import pytest", "assert sum(range(10**5)) == 4999950000", "assert ''.join(sorted('dockyard')) == 'acddkory'"]
    + ["print('ok')"]
)
COMMAND = ["python3", "-c", TEST]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WARM = 4  # warm session containers: one per caller at the highest concurrency


def start_sandbox(image: str, concurrency: int, workdir: str) -> tuple[subprocess.Popen, str, Path]:
    settings = {"BACKEND": "docker", "IMAGE": image, "MAX_CONCURRENCY": str(concurrency)}
    settings |= {"WARM_SESSIONS_MAX": str(WARM), "MAX_SESSIONS": str(2 * WARM)}
    return start_service(settings, workdir)


def start_service(settings: dict[str, str], workdir: str) -> tuple[subprocess.Popen, str, Path]:
    """`python -m services.sandbox` on a free port with DOCKYARD_SANDBOX_<KEY> = value for `settings`."""
    port = free_port()
    env = {**os.environ, "DOCKYARD_SANDBOX_PORT": str(port)}
    env.update({f"DOCKYARD_SANDBOX_{key}": value for key, value in settings.items()})
    log_path = Path(workdir) / "sandbox.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.sandbox"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
    return proc, f"127.0.0.1:{port}", log_path


async def wait_serving(proc: subprocess.Popen, address: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await health_status(address) != "SERVING":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the sandbox service did not start:\n{log.read_text(errors='replace')[-4000:]}")
        await asyncio.sleep(0.1)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def service_task(stub) -> float:
    start = time.perf_counter()
    reply = await stub.Execute(sandbox_pb2.ExecuteRequest(command=COMMAND), timeout=120)
    elapsed = time.perf_counter() - start
    if reply.verdict.status != common_pb2.VERDICT_STATUS_PASSED or reply.verdict.stdout != "ok\n":
        raise RuntimeError(f"the service's run failed: {reply.verdict}")
    return elapsed


OPEN_TIMES: list[float] = []  # OpenSession alone, of the session path's timed runs at concurrency 1


async def session_task(stub, opens: list[float] | None = None) -> float:
    """OpenSession (from the warm pool) + SessionExec of the command: what a trial waits for; closed untimed."""
    start = time.perf_counter()
    opened = await stub.OpenSession(sandbox_pb2.OpenSessionRequest(request_id="bench"), timeout=120)
    if opens is not None:
        opens.append(time.perf_counter() - start)
    reply = await stub.SessionExec(
        sandbox_pb2.SessionExecRequest(session_id=opened.session_id, command=COMMAND), timeout=120
    )
    elapsed = time.perf_counter() - start
    await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=120)
    if reply.verdict.status != common_pb2.VERDICT_STATUS_PASSED or reply.verdict.stdout != "ok\n":
        raise RuntimeError(f"the session's command failed: {reply.verdict}")
    return elapsed


async def bare_task(image: str) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "docker", "run", "--rm", "--network", "none", image, *COMMAND, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or out != b"ok\n":
        raise RuntimeError(f"docker run failed: exit {proc.returncode}, {out[-500:]!r}")
    return elapsed


async def throughput(task, runs: int, concurrency: int) -> float:
    """Tasks per second with `concurrency` callers sharing `runs` tasks."""
    remaining = list(range(runs))

    async def caller() -> None:
        while remaining:
            remaining.pop()
            await task()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return runs / (time.perf_counter() - start)


async def bench(address: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    async with connect(address, service="dockyard.sandbox.v1.SandboxService", default_timeout=120.0) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        prepare = sandbox_pb2.PrepareSessionsRequest(job_id="bench", size=WARM)  # default limits, as OpenSession's
        await stub.PrepareSessions(prepare, timeout=300)
        paths = {
            "service": lambda: service_task(stub),
            "session": lambda: session_task(stub),
            "docker run": lambda: bare_task(args.image),
        }
        for _ in range(args.warmup):
            for task in paths.values():
                await task()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.runs):
            for name, task in paths.items():
                times[name].append(await (session_task(stub, OPEN_TIMES) if name == "session" else task()))
                await asyncio.sleep(args.settle)  # what a task left running in the background ends before the next
        results = {name: {"per_task": sum(t) / len(t), "c1": len(t) / sum(t)} for name, t in times.items()}
        for concurrency in (2, 4):
            for name, task in paths.items():
                results[name][f"c{concurrency}"] = await throughput(task, args.runs, concurrency)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="tasks per path and concurrency level")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per path first")
    parser.add_argument("--image", default=SANDBOX_IMAGE, help="built by deploy/images/build.sh")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds between timed tasks at concurrency 1, so the work a path leaves in the background (a warm "
        "container's replacement, an ended one's removal) does not land on the next path's timed task",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    proc = None
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as workdir:
        try:
            proc, address, log = start_sandbox(args.image, 4, workdir)
            asyncio.run(wait_serving(proc, address, log))
            results = asyncio.run(bench(address, args))
        finally:
            stop(proc)

    engine = subprocess.run(["docker", "version", "-f", "{{.Server.Version}}"], capture_output=True, text=True)
    print(f"docker engine {engine.stdout.strip()}, image {args.image}, {args.runs} runs per path and level")
    print(f"{'path':<12} {'per task (s)':>13} {'tasks/s c=1':>12} {'c=2':>8} {'c=4':>8}")
    for name, r in results.items():
        print(f"{name:<12} {r['per_task']:>13.3f} {r['c1']:>12.2f} {r['c2']:>8.2f} {r['c4']:>8.2f}")
    bare = results["docker run"]["per_task"]
    print(f"sandbox_vs_docker_run: {results['service']['per_task'] / bare:.3f}")
    opened = sum(OPEN_TIMES) / len(OPEN_TIMES)
    print(f"OpenSession from the warm pool: {opened * 1000:.1f} ms (mean of {len(OPEN_TIMES)})")
    print(f"session_open_vs_docker_run: {opened / bare:.3f}")
    print(f"session_task_vs_docker_run: {results['session']['per_task'] / bare:.3f}")


if __name__ == "__main__":
    main()
