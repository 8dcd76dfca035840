"""A SIGKILLed sandbox service's work folders are removed when the next one starts; a live one's stay.

Two local-backend services share a work root, each with an Execute in flight (its work folder open).
One is SIGKILLed, so nothing of its own removes its folder; a service started on the same root
removes it before serving and logs how many, while the live service's folder, and its call, are untouched.
No process of the killed service's run is left (its guard's work), and the live one's run goes on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from services.sandbox.work_folders import OWNER_SUFFIX, PREFIX
from tests.unit.sandbox.test_local import live_with

SLEEP = sandbox_pb2.ExecuteRequest(
    command=["sleep", "60"], limits=sandbox_pb2.Limits(timeout_seconds=60, memory_mb=256, cpu_seconds=5)
)


def folders_by_pid(work_root: Path) -> dict[int, set[Path]]:
    """The work folders under the root, by the pid their .owner file names."""
    found: dict[int, set[Path]] = {}
    for owner in work_root.glob(f"{PREFIX}*{OWNER_SUFFIX}"):
        pid = int(owner.read_text().split("/")[1])
        token = owner.name[len(PREFIX) : -len(OWNER_SUFFIX)]
        found[pid] = set(work_root.glob(f"{PREFIX}{token}-*"))
    return found


async def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return value


async def test_a_killed_services_work_folders_go_at_the_next_start(start_service, tmp_path: Path) -> None:
    work_root = tmp_path / "work"
    work_root.mkdir()
    env = {"DOCKYARD_SANDBOX_WORK_ROOT": str(work_root), "DOCKYARD_SANDBOX_DRAIN_SECONDS": "0"}
    crashed, live = start_service("sandbox", env), start_service("sandbox", env)
    async with connect(crashed.address) as doomed, connect(live.address) as kept:
        calls = [sandbox_pb2_grpc.SandboxServiceStub(ch).Execute(SLEEP, timeout=60) for ch in (doomed, kept)]

        def both_running() -> dict[int, set[Path]]:
            # A folder is made before its run's bwrap starts: wait until each folder's run carries it.
            found = folders_by_pid(work_root)
            mine = [found.get(s.proc.pid) for s in (crashed, live)]
            return found if all(mine) and all(live_with(str(f)) for folders in mine for f in folders) else {}

        open_folders = await wait_for(both_running)
        crashed.proc.kill()  # SIGKILL: no finally, no shutdown hook
        crashed.proc.wait()
        assert all(folder.exists() for folder in open_folders[crashed.proc.pid])
        # Each run's bwrap carries its work folder in its command line.
        await wait_for(lambda: not any(live_with(str(f)) for f in open_folders[crashed.proc.pid]), timeout=10)
        assert all(live_with(str(f)) for f in open_folders[live.proc.pid])  # another service's run: untouched

        restarted = start_service("sandbox", env)
        assert not any(folder.exists() for folder in open_folders[crashed.proc.pid])
        assert crashed.proc.pid not in folders_by_pid(work_root)  # its .owner file went too
        assert all(folder.is_dir() for folder in open_folders[live.proc.pid])
        reaped = [line for line in restarted.logs().splitlines() if "removed the work folders of a previous" in line]
        assert reaped and ("count=1" in reaped[0] or '"count": 1' in reaped[0]), reaped
        assert not calls[1].done()  # the live service's call still runs
        for call in calls:
            call.cancel()
