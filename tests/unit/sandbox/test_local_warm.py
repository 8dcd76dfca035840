"""RunTests sandboxes started ahead of their calls (warm_pool.py), serving calls one after another
when the service is root (local_workers.py), and the harness run by the launcher's child.

Each test runs through `make_backend` (bubblewrap namespaces, the sandbox uid when the service is
root) with one slot, so the second call of a test runs in the sandbox the first call ran in, reset
(as root), or in the one started while the first call ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from services.sandbox.__main__ import make_backend
from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.settings import SandboxSettings
from services.sandbox.warm_pool import WarmPool
from tests.conftest import missing, require_tool
from tests.unit.sandbox.test_local import live_with

LIMITS = ResourceLimits(timeout_seconds=20.0, memory_mb=512, cpu_seconds=10.0, max_output_bytes=65536)


@pytest.fixture
async def backend(tmp_path: Path):
    require_tool(shutil.which("bwrap") or "/usr/bin/bwrap", "bubblewrap (bwrap)")
    backend = await make_backend(SandboxSettings(backend="local", max_concurrency=1, work_root=str(tmp_path)))
    assert backend.isolated
    yield backend
    await backend.close()


async def test_no_state_crosses_from_one_task_to_the_next(backend):
    token = f"{uuid.uuid4().int % 10**6}.75"  # a unique sleep length, to find it from the host
    leave = textwrap.dedent(
        f"""
        import builtins, json, os, subprocess, sys
        open('left.txt', 'w').write('x')
        for folder in ('/tmp', '/dev/shm', '/var/tmp'):
            try:
                open(os.path.join(folder, 'left.txt'), 'w').write('x')
            except OSError:
                pass
        open('json.py', 'w').write('LEFT = 1\\n')  # a module of the work folder's, shadowing json
        subprocess.Popen(['sleep', '{token}'], start_new_session=True)
        os.environ['LEFT'] = '1'
        os.putenv('LEFT_TOO', '1')
        builtins.LEFT = 1
        json.dumps = lambda *a, **k: 'forged'
        sys.modules['left_module'] = type(sys)('left_module')
        sys.path.insert(0, os.getcwd())
        """
    )
    first = await backend.run_tests(leave, ["assert True"], LIMITS)
    assert first.status is Status.PASSED, first
    probe = textwrap.dedent(
        """
        import builtins, json, os, sys
        seen = {
            'work': sorted(os.listdir('.')),
            'tmp': [f for f in ('/tmp/left.txt', '/dev/shm/left.txt', '/var/tmp/left.txt') if os.path.exists(f)],
            'processes': sorted(open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()),
            'env': sorted(k for k in os.environ if k.startswith('LEFT')),
            'builtins': hasattr(builtins, 'LEFT'),
            'json': json.dumps([1]),
            'modules': 'left_module' in sys.modules,
            'path': os.getcwd() in sys.path,
        }
        print(json.dumps(seen))
        """
    )
    sandboxes = sandbox_processes(backend)
    second = await backend.run_tests(probe, ["assert True"], LIMITS)
    assert second.status is Status.PASSED, second
    if serving(backend):  # the same sandbox served both calls: the reset, not a new sandbox, left nothing
        assert sandbox_processes(backend) == sandboxes
    seen = json.loads(second.stdout)
    assert seen["work"] == [] and seen["tmp"] == []
    assert not any(token in cmdline for cmdline in seen["processes"]), seen["processes"]
    assert seen["env"] == [] and seen["builtins"] is False and seen["modules"] is False and seen["path"] is False
    assert seen["json"] == "[1]"
    assert live_with(token) == []  # nor on the host: killed with the first call (or its namespace)


def serving(backend) -> bool:
    """Whether the backend's RunTests sandboxes serve calls one after another (as root)."""
    return os.geteuid() == 0


def sandbox_processes(backend) -> list[int]:
    """The host pids of the backend's sandboxes once they settle: each bwrap and its namespace's init
    (the service's guard carries the mark too, and is left out)."""

    def bwraps() -> list[int]:
        found = []
        for pid in live_with(backend.run_mark):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if argv0.endswith(b"bwrap"):
                found.append(pid)
        return sorted(found)

    deadline = time.monotonic() + 5.0
    seen = bwraps()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = bwraps()
        if again == seen:
            return seen
        seen = again
    return seen


async def test_a_serving_sandbox_is_emptied_between_calls_whatever_the_call_left(backend):
    if not serving(backend):
        missing("sandboxes serve calls one after another only when the service runs as root")
    token = f"{uuid.uuid4().int % 10**6}.25"
    leave = textwrap.dedent(
        f"""
        import os, subprocess
        os.makedirs('locked/deeper')
        open('locked/deeper/secret.txt', 'w').write('x')
        os.chmod('locked/deeper', 0)
        os.chmod('locked', 0)
        os.symlink('/etc', 'link')
        os.mkfifo('fifo')
        open('.hidden', 'w').write('x')
        try:
            os.setxattr('.', 'user.left', b'x')
        except OSError:
            pass  # a tmpfs without user attributes: nothing to leave there
        os.chmod('.', 0o777)
        # Detached twice over: its own session, its parent gone, stopped.
        subprocess.Popen(['sh', '-c', 'sleep {token} & kill -STOP $$; wait'], start_new_session=True)
        """
    )
    first = await backend.run_tests(leave, ["assert True"], LIMITS)
    assert first.status is Status.PASSED, first
    sandboxes = sandbox_processes(backend)
    probe = textwrap.dedent(
        """
        import json, os, stat
        here = os.stat('.')
        print(json.dumps({'work': sorted(os.listdir('.')), 'xattrs': os.listxattr('.'),
                          'mode': oct(stat.S_IMODE(here.st_mode)), 'mine': here.st_uid == os.getuid()}))
        """
    )
    second = await backend.run_tests(probe, ["assert True"], LIMITS)
    assert second.status is Status.PASSED, second
    assert sandbox_processes(backend) == sandboxes  # reset and reused, not replaced
    assert json.loads(second.stdout) == {"work": [], "xattrs": [], "mode": "0o700", "mine": True}
    assert live_with(token) == []


async def test_a_sandbox_left_with_ipc_objects_is_retired_not_reused(backend):
    if not serving(backend):
        missing("sandboxes serve calls one after another only when the service runs as root")
    shared = textwrap.dedent(
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # shmget(key, size, flags): 0o1000 is IPC_CREAT; then whether the key names a segment.
        def segment(create):
            return libc.shmget(0x5EED, 4096, 0o1666 if create else 0)
        """
    )
    first = await backend.run_tests(shared + "made = segment(True)\n", ["assert made >= 0"], LIMITS)
    assert first.status is Status.PASSED, first
    sandboxes = sandbox_processes(backend)
    second = await backend.run_tests(shared, ["assert segment(False) == -1"], LIMITS)
    assert second.status is Status.PASSED, second  # the segment went with the first sandbox
    assert not set(sandbox_processes(backend)) & set(sandboxes)


async def test_a_sandbox_past_its_wall_clock_is_killed_and_the_next_call_gets_a_fresh_one(backend):
    token = f"{uuid.uuid4().int % 10**6}.5"
    slow = f"import subprocess, time\nsubprocess.Popen(['sleep', '{token}'])\ntime.sleep(30)\n"
    late = await backend.run_tests(slow, ["assert True"], dataclasses.replace(LIMITS, timeout_seconds=1.0))
    assert late.status is Status.TIMEOUT, late
    deadline = time.monotonic() + 2.0
    while live_with(token) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_with(token) == []
    after = await backend.run_tests("x = 1\n", ["assert x == 1"], LIMITS)
    assert after.status is Status.PASSED, after


async def test_a_warm_sandbox_takes_its_calls_limits(backend):
    hog = "blob = bytearray(300 * 1024 * 1024)\n"
    roomy = await backend.run_tests(hog, ["assert len(blob) > 0"], LIMITS)
    assert roomy.status is Status.PASSED, roomy  # 300 MB under 512
    tight = await backend.run_tests(hog, ["assert len(blob) > 0"], dataclasses.replace(LIMITS, memory_mb=128))
    assert tight.status is Status.FAILED and tight.tests_passed == 0, tight
    flood = await backend.run_tests(
        "print('x' * 100000)\n", ["assert True"], dataclasses.replace(LIMITS, max_output_bytes=100)
    )
    assert flood.stdout == "x" * 100 and flood.output_truncated, flood
    slow = await backend.run_tests(
        "import time\ntime.sleep(30)\n", ["assert True"], dataclasses.replace(LIMITS, timeout_seconds=1.0)
    )
    assert slow.status is Status.TIMEOUT, slow


async def test_the_harness_holds_no_launcher_fd_and_runs_unprivileged(backend):
    probe = textwrap.dedent(
        """
        import json, os, sys
        fds = []
        for name in os.listdir('/proc/self/fd'):
            try:
                fds.append((int(name), os.readlink(f'/proc/self/fd/{name}')))
            except OSError:
                pass  # the listing's own fd, closed by now
        status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
        print(json.dumps({'fds': sorted(fds), 'report': int(sys.argv[1]), 'uid': os.getuid(),
                          'caps': [status[k].strip() for k in ('CapPrm', 'CapEff', 'CapAmb')]}))
        """
    )
    out = await backend.run_tests(probe, ["assert True"], LIMITS)
    assert out.status is Status.PASSED, out
    seen = json.loads(out.stdout)
    # stdin, stdout, stderr, the harness's report pipe (and its spare /dev/null from replacing
    # stdin): not the launcher's status pipe or its fd of the work folder.
    others = [target for fd, target in seen["fds"] if fd not in (0, 1, 2, seen["report"])]
    assert others in ([], ["/dev/null"]), seen["fds"]
    assert seen["report"] in [fd for fd, _ in seen["fds"]]
    assert seen["uid"] != 0 and seen["caps"] == ["0000000000000000"] * 3


async def test_close_leaves_no_waiting_sandbox_and_no_folder(backend, tmp_path):
    out = await backend.run_tests("x = 1\n", ["assert x == 1"], LIMITS)
    assert out.status is Status.PASSED, out
    deadline = time.monotonic() + 5.0
    while not live_with(backend.run_mark) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_with(backend.run_mark), "no sandbox waits for the next call"
    await backend.close()
    deadline = time.monotonic() + 2.0  # SIGKILL is sent at once; the kernel takes a moment to act on it
    while live_with(backend.run_mark) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_with(backend.run_mark) == []
    assert list(tmp_path.iterdir()) == []
    after = await backend.run_tests("x = 1\n", ["assert x == 1"], LIMITS)
    assert after.status is Status.ERROR and "stopping" in after.error_message


def counting_pool(alive, size: int, *, reuse: bool = False) -> tuple[WarmPool[int], list[int]]:
    """A pool of numbered stand-ins for sandboxes, started in order; and the list of those discarded."""
    counter = iter(range(100))
    discarded: list[int] = []

    async def start() -> int:
        return next(counter)

    async def discard(item: int) -> None:
        discarded.append(item)

    return WarmPool(start, discard, alive=alive, size=size, reuse=reuse), discarded


async def test_the_pool_never_gives_a_sandbox_twice_and_drops_dead_ones():
    pool, discarded = counting_pool(alive=lambda item: item != 1, size=2)
    taken = [await pool.take()]  # none waits: started for the call, two more in the background
    await asyncio.sleep(0)
    taken += [await pool.take(), await pool.take()]  # 1 died while it waited: dropped, never given
    await pool.close()
    assert len(set(taken)) == len(taken) and 1 not in taken
    assert 1 in discarded and not set(discarded) & set(taken)
    with pytest.raises(OSError, match="stopping"):
        await pool.take()


async def test_a_reusable_pool_keeps_what_its_callers_give_back_reset_and_no_more():
    pool, discarded = counting_pool(alive=lambda item: True, size=1, reuse=True)
    first = await pool.take()
    await pool.give_back(first, reusable=True)
    assert await pool.take() == first  # the same sandbox again, nothing started beside it
    await pool.give_back(first, reusable=False)  # its caller saw it left dirty: a replacement starts
    assert discarded == [first]
    for _ in range(3):
        await asyncio.sleep(0)  # the replacement's start runs
    second = await pool.take()
    assert second != first
    extra = await pool.take()  # a second caller while the first is out: started for it
    await pool.give_back(second, reusable=True)  # the other still out fills the pool: discarded
    assert discarded == [first, second]
    await pool.give_back(extra, reusable=True)
    await pool.close()
    assert discarded == [first, second, extra]
    with pytest.raises(ValueError, match="one call each"):
        await counting_pool(alive=lambda item: True, size=1)[0].give_back(0, reusable=True)


async def test_a_waiting_sandbox_that_died_is_replaced_and_the_call_still_runs(backend):
    if not serving(backend):
        missing("sandboxes serve calls one after another only when the service runs as root")
    first = await backend.run_tests("x = 1\n", ["assert x == 1"], LIMITS)
    assert first.status is Status.PASSED, first
    waiting = sandbox_processes(backend)
    assert waiting
    for pid in waiting:
        os.kill(pid, signal.SIGKILL)  # from outside, while it waits for its next call
    second = await backend.run_tests("x = 2\n", ["assert x == 2"], LIMITS)
    assert second.status is Status.PASSED, second
    assert not set(sandbox_processes(backend)) & set(waiting)
