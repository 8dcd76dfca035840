"""No process of a local run outlives the sandbox service, whatever stage bwrap was at when it died.

bwrap's --die-with-parent is set by bwrap once it has made the namespace; the namespace's init
first waits for bwrap's word to go on, and sets its own only at the end of its setup. A service
killed in between took bwrap with it and left the init waiting for that word forever, orphaned,
ignoring SIGTERM as a namespace's init does. The first test holds one run's bwrap at that point,
kills the service, and looks for what is left of its runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.sandbox.backend import ResourceLimits
from services.sandbox.local import LocalBackend
from tests.unit.sandbox.test_local import live_with

REPO = Path(__file__).resolve().parents[3]
LIMITS = ResourceLimits(timeout_seconds=60.0, memory_mb=256, cpu_seconds=60.0, max_output_bytes=4096)

# A sandbox service reduced to its backend: two runs of `sleep 60`. The first one's bwrap is also
# given --userns-block-fd (with the user namespace and info fd it requires) on a pipe the test holds:
# bwrap then waits there, holding its parent-death signal, before it tells the namespace's init to go
# on, as a bwrap preempted at that point would be.
SERVICE = r"""
import asyncio, os, sys
from services.sandbox.local import LocalBackend
from services.sandbox.backend import ResourceLimits

real_exec = asyncio.create_subprocess_exec
block = int(sys.argv[2])
info_read, info_write = os.pipe()

async def spawn(bwrap, *argv, **kwargs):
    global block
    if block >= 0:
        argv = ("--unshare-user", "--info-fd", str(info_write), "--userns-block-fd", str(block), *argv)
        kwargs["pass_fds"] = [*kwargs["pass_fds"], info_write, block]
        block = -1
    proc = await real_exec(bwrap, *argv, **kwargs)
    print("spawned", proc.pid, flush=True)
    return proc

asyncio.create_subprocess_exec = spawn

async def main():
    backend = LocalBackend(max_concurrency=2, work_root=sys.argv[1])
    limits = ResourceLimits(timeout_seconds=60.0, memory_mb=256, cpu_seconds=60.0, max_output_bytes=4096)
    await asyncio.gather(*(backend.execute({}, ["sleep", "60"], limits) for _ in range(2)))

asyncio.run(main())
"""


def test_a_service_killed_while_its_runs_start_leaves_none_of_them(tmp_path: Path) -> None:
    work_root = str(tmp_path / "work")  # in every bwrap's command line (its work folder's tmpfs)
    os.mkdir(work_root)
    block_read, block_write = os.pipe()
    service = subprocess.Popen(
        [sys.executable, "-c", SERVICE, work_root, str(block_read)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=[block_read],
    )
    os.close(block_read)
    try:
        spawned = [service.stdout.readline() for _ in range(2)]
        assert all(line.startswith("spawned") for line in spawned), spawned
        deadline = time.monotonic() + 10
        while len(live_with(work_root)) < 4 and time.monotonic() < deadline:  # bwrap and its init, twice
            time.sleep(0.05)
        assert len(live_with(work_root)) >= 4, "both runs should have their bwrap and init by now"
        service.kill()  # SIGKILL: no close(), no killpg; only what outlives the service can act
        service.wait()
        deadline = time.monotonic() + 10
        while live_with(work_root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_with(work_root) == [], "a run of the killed service is still alive"
    finally:
        service.kill()
        os.close(block_write)
        for pid in live_with(work_root):  # what a failure left: never into the next test
            os.kill(pid, signal.SIGKILL)


async def test_bwrap_and_its_namespace_share_the_run_s_process_group(tmp_path: Path) -> None:
    # The service ends a run with one killpg: the namespace's init must be in that group at every
    # stage (bwrap's --new-session took it out before it could die with bwrap).
    backend = LocalBackend(max_concurrency=1, work_root=str(tmp_path))
    run = asyncio.ensure_future(backend.execute({}, ["sleep", "30"], LIMITS))
    try:
        deadline = time.monotonic() + 10
        while len(bwraps := live_with(str(tmp_path))) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(bwraps) == 2, "bwrap and the namespace's init"
        assert len({os.getpgid(pid) for pid in bwraps}) == 1
        assert {os.getsid(pid) for pid in bwraps} == {os.getpgid(bwraps[0])}
    finally:
        await backend.close()  # kills the run's group: its execute returns
        await asyncio.wait([run], timeout=10)
    assert run.done() and live_with(str(tmp_path)) == []


async def test_the_guard_ends_with_close_and_spares_the_service(tmp_path: Path) -> None:
    backend = LocalBackend(max_concurrency=1, work_root=str(tmp_path))
    out = await backend.execute({}, ["true"], LIMITS)
    assert out.exit_code == 0
    guard = live_with(backend.run_mark)
    assert len(guard) == 1, "one guard while the backend is open"
    await backend.close()
    assert live_with(backend.run_mark) == []
    os.kill(os.getpid(), 0)  # the service (this test process) is alive: its group was never signalled
