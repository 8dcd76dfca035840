"""RunTests sandboxes started ahead of their calls (warm_pool.py), and the harness run by the launcher's child.

Each test runs through `make_backend` (bubblewrap namespaces, the sandbox uid when the service is
root) with one slot, so the second call of a test runs in the sandbox that was started while the
first call ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from services.sandbox.__main__ import make_backend
from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.settings import SandboxSettings
from services.sandbox.warm_pool import WarmPool
from tests.conftest import require_tool
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
    second = await backend.run_tests(probe, ["assert True"], LIMITS)
    assert second.status is Status.PASSED, second
    seen = json.loads(second.stdout)
    assert seen["work"] == [] and seen["tmp"] == []
    assert not any(token in cmdline for cmdline in seen["processes"]), seen["processes"]
    assert seen["env"] == [] and seen["builtins"] is False and seen["modules"] is False and seen["path"] is False
    assert seen["json"] == "[1]"
    assert live_with(token) == []  # nor on the host: the first call's pid namespace ended with it


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


async def test_the_pool_never_gives_a_sandbox_twice_and_drops_dead_ones():
    counter = iter(range(100))
    discarded: list[int] = []

    async def start() -> int:
        return next(counter)

    async def discard(item: int) -> None:
        discarded.append(item)

    pool = WarmPool(start, discard, alive=lambda item: item != 1, size=2)
    taken = [await pool.take()]  # none waits: started for the call, two more in the background
    await asyncio.sleep(0)
    taken += [await pool.take(), await pool.take()]  # 1 died while it waited: dropped, never given
    await pool.close()
    assert len(set(taken)) == len(taken) and 1 not in taken
    assert 1 in discarded and not set(discarded) & set(taken)
    with pytest.raises(OSError, match="stopping"):
        await pool.take()
