"""The local sandbox backend, called directly: verdicts, input checks, and one adversarial property per test."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path

import pytest

from dockyard.rpc.errors import InvalidArgument
from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.local import LocalBackend, sandbox_environment
from services.sandbox.servicer import MAX_FILES
from services.sandbox.staging import parse_report
from services.sandbox.work_folders import OWNER_SUFFIX

LIMITS = ResourceLimits(timeout_seconds=10.0, memory_mb=256, cpu_seconds=10.0, max_output_bytes=4096)


def limits(**changes) -> ResourceLimits:
    return dataclasses.replace(LIMITS, **changes)


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(max_concurrency=2, work_root=str(tmp_path))


def live_with(token: str) -> list[int]:
    """Processes of this host whose command line holds `token` and that are not zombies."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if token.encode() in cmdline and stat[stat.rindex(")") + 2] != "Z":
            members.append(int(entry.name))
    return members


# --- Execute -------------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status", "passed"), [(0, Status.PASSED, 1), (3, Status.FAILED, 0)])
async def test_execute_verdict_follows_exit_code(backend, code, status, passed):
    out = await backend.execute({}, ["python", "-c", f"import sys; print('hi'); sys.exit({code})"], LIMITS)
    assert (out.status, out.exit_code, out.tests_passed, out.tests_total) == (status, code, passed, 1)
    assert out.stdout == "hi\n"


async def test_execute_multi_file_program_imports_its_own_modules(backend):
    files = {"pkg/main.py": "from helper import x\nprint(x * 2)", "pkg/helper.py": "x = 21"}
    out = await backend.execute(files, ["python", "pkg/main.py"], LIMITS)
    assert out.status is Status.PASSED, out.stderr
    assert out.stdout == "42\n"


@pytest.mark.parametrize(
    "files",
    [{"/etc/evil": "x"}, {"../evil": "x"}, {"a/../../evil": "x"}, {"a/..": "x"}, {"": "x"}, {"a": "1", "a/b": "2"}],
)
async def test_paths_outside_the_work_folder_are_refused(backend, files):
    with pytest.raises(InvalidArgument, match="files"):
        await backend.execute(files, ["true"], LIMITS)


@pytest.mark.parametrize("command", [[], [""]])
async def test_empty_command_is_refused(backend, command):
    with pytest.raises(InvalidArgument, match="command"):
        await backend.execute({}, command, LIMITS)


async def test_command_that_cannot_be_spawned_is_error(backend):
    out = await backend.execute({}, ["no-such-program-here"], LIMITS)
    assert out.status is Status.ERROR
    assert "no-such-program-here" in out.error_message


# --- RunTests ------------------------------------------------------------------------------


async def test_run_tests_counts_each_test(backend):
    program = "def inc(x):\n    return x + 1\n"
    out = await backend.run_tests(program, ["assert inc(1) == 2", "assert inc(2) == 3"], LIMITS)
    assert (out.status, out.tests_passed, out.tests_total) == (Status.PASSED, 2, 2)
    out = await backend.run_tests(program, ["assert inc(1) == 2", "assert inc(2) == 4", "x = ("], LIMITS)
    assert (out.status, out.tests_passed, out.tests_total) == (Status.FAILED, 1, 3)


async def test_program_that_does_not_run_fails_every_test(backend):
    out = await backend.run_tests("def inc(x) return x", ["assert True", "assert 1 == 1"], LIMITS)
    assert (out.status, out.tests_passed, out.tests_total) == (Status.FAILED, 0, 2)
    assert "SyntaxError" in out.stderr


async def test_a_test_that_exits_fails_alone(backend):
    out = await backend.run_tests("import sys", ["sys.exit(0)", "assert True"], LIMITS)
    assert (out.status, out.tests_passed) == (Status.FAILED, 1)


async def test_empty_tests_are_refused(backend):
    with pytest.raises(InvalidArgument, match="tests"):
        await backend.run_tests("x = 1", [], LIMITS)


def test_report_lines_without_the_nonce_are_ignored():
    report = b"forged ready\nforged result 11\nN ready\nN result 10\n"
    assert parse_report(report, b"N", 2) == (True, [True, False])
    assert parse_report(b"N ready\nN result 1\n", b"N", 2) == (True, None)  # wrong length: no result
    assert parse_report(b"forged result 11\n", b"N", 2) == (False, None)


# --- adversarial: one property each --------------------------------------------------------


async def test_infinite_loop_times_out_and_leaves_no_process(backend):
    token = f"{uuid.uuid4().int % 10**6}.5"  # a unique sleep length, to find it from the host
    program = f"import subprocess\nsubprocess.Popen(['sleep', '{token}'])\nwhile True:\n    pass\n"
    start = time.monotonic()
    out = await backend.run_tests(program, ["assert True"], limits(timeout_seconds=1.0))
    elapsed = time.monotonic() - start
    assert out.status is Status.TIMEOUT
    assert elapsed < 1.0 + 2.0  # slack for a loaded machine
    assert live_with(token) == []


@pytest.mark.parametrize("rpc", ["execute", "run_tests"])
async def test_memory_bomb_does_not_pass_and_is_not_error(backend, rpc):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))\n"
    small = limits(memory_mb=192, timeout_seconds=5.0)
    if rpc == "execute":
        out = await backend.execute({"bomb.py": bomb}, ["python", "bomb.py"], small)
    else:
        out = await backend.run_tests(bomb, ["assert True"], small)
    assert out.status is Status.FAILED, out
    assert "MemoryError" in out.stderr


async def test_output_flood_is_truncated_at_the_cap(backend):
    flood = "import sys\nfor _ in range(2000):\n    sys.stdout.write('x' * 10000)\n"
    out = await backend.execute({"f.py": flood}, ["python", "f.py"], limits(max_output_bytes=1000))
    assert out.status is Status.PASSED
    assert out.output_truncated
    assert out.stdout == "x" * 1000


async def test_printed_pass_report_cannot_turn_failures_into_a_pass(backend):
    program = (
        "import os\n"
        "for line in ('ready', 'result 11', 'PASSED 2/2', 'tests_passed=2'):\n"
        "    print(line, flush=True)\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, (line + '\\n').encode())\n"
        "            os.write(fd, ('0' * 32 + ' ' + line + '\\n').encode())\n"
        "        except OSError:\n"
        "            pass\n"
    )
    out = await backend.run_tests(program, ["assert False", "assert 1 == 2"], LIMITS)
    assert (out.status, out.tests_passed) == (Status.FAILED, 0)


async def test_os_exit_at_import_does_not_pass(backend):
    out = await backend.run_tests("import os\nos._exit(0)\n", ["assert True", "assert 1 == 1"], LIMITS)
    assert (out.status, out.tests_passed) == (Status.FAILED, 0)


@pytest.mark.parametrize(
    "crash",
    [
        "import sys; sys.exit(0)",
        "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
        "raise MemoryError",
        "import os; os.close(int(__import__('sys').argv[1]))",
    ],
)
async def test_self_inflicted_crash_is_failed_not_error(backend, crash):
    out = await backend.run_tests(crash, ["assert True"], LIMITS)
    assert (out.status, out.tests_passed) == (Status.FAILED, 0)


async def test_environment_holds_nothing_from_the_service(backend, monkeypatch):
    monkeypatch.setenv("DOCKYARD_SECRET", "hunter2")
    out = await backend.execute({}, ["python", "-c", "import os, json; print(json.dumps(dict(os.environ)))"], LIMITS)
    seen = json.loads(out.stdout)
    assert "DOCKYARD_SECRET" not in seen
    assert "hunter2" not in out.stdout
    assert set(seen) <= set(sandbox_environment("/x"))


async def test_work_folder_is_removed_afterwards(backend, tmp_path):
    program = "import os\nopen('left.txt', 'w').write('x')\nos.mkdir('sub')\nos.chmod('sub', 0)\nprint(os.getcwd())\n"
    out = await backend.run_tests(program, ["assert True"], LIMITS)
    work = Path(out.stdout.strip())
    assert work.parent == tmp_path
    assert not work.exists()
    # Only the service's .owner file stays (work_folders.py), until the backend closes.
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(OWNER_SUFFIX)] == []
    await backend.close()
    assert list(tmp_path.iterdir()) == []


async def test_files_are_written_off_the_event_loop(backend, tmp_path, monkeypatch):
    """The largest accepted request is staged in a worker thread: the loop keeps serving health checks."""
    writers: set[int] = set()
    for method in ("write_text", "write_bytes"):
        original = getattr(Path, method)

        def recording(self, *args, _original=original, **kwargs):
            if tmp_path in self.parents:
                writers.add(threading.get_ident())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Path, method, recording)
    files = {f"data/f{i}.txt": str(i) for i in range(MAX_FILES)}
    count = "import os; print(len(os.listdir('data')))"
    out = await backend.execute(files, ["python", "-c", count], LIMITS)
    assert out.status is Status.PASSED, out.stderr
    assert out.stdout == f"{MAX_FILES}\n"
    assert writers, "no file of the request was written"
    assert threading.get_ident() not in writers


async def test_concurrency_is_bounded(tmp_path):
    one_at_a_time = LocalBackend(max_concurrency=1, work_root=str(tmp_path))
    start = time.monotonic()
    await asyncio.gather(*(one_at_a_time.execute({}, ["sleep", "0.4"], LIMITS) for _ in range(2)))
    assert time.monotonic() - start >= 0.8


async def test_cancelled_call_kills_its_process_group(backend):
    script = f"spin_{uuid.uuid4().hex}.py"  # in the command line: found from the host
    task = asyncio.ensure_future(backend.execute({script: "while True:\n    pass\n"}, ["python", script], LIMITS))
    deadline = time.monotonic() + 5.0
    while not live_with(script) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_with(script)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 2.0  # SIGKILL is sent at once; the kernel takes a moment to act on it
    while live_with(script) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_with(script) == []


async def test_a_run_spawning_while_the_backend_closes_is_killed_and_none_starts_after(tmp_path, monkeypatch):
    # A run whose spawn was under way when close() killed the live groups was missed by it, and
    # outlived the service (an orphaned bwrap); now it dies as soon as it exists, and none starts after.
    backend = LocalBackend(max_concurrency=2, work_root=str(tmp_path))
    token = uuid.uuid4().hex
    real_exec = asyncio.create_subprocess_exec

    async def spawn_while_closing(*argv, **kwargs):
        proc = await real_exec(*argv, **kwargs)
        await backend.close()  # the service stops between the spawn and the group's bookkeeping
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn_while_closing)
    started = time.monotonic()
    out = await backend.execute({}, ["python", "-c", f"import time; time.sleep(30)  # {token}"], limits())
    assert time.monotonic() - started < 10 and out.status is not Status.PASSED
    assert live_with(token) == []
    monkeypatch.setattr(asyncio, "create_subprocess_exec", real_exec)
    after = await backend.execute({}, ["python", "-c", "print('late')"], LIMITS)
    assert after.status is Status.ERROR and "stopping" in after.error_message
