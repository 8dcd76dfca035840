"""Sessions through a real sandbox service process, on the local backend and (where docker answers) the docker one.

OpenSession --> WriteFile --> SessionExec (reads it, leaves state, starts a background process)
            --> SessionExec (state kept, the process gone) --> ReadFile --> escapes refused
            --> CloseSession --> NOT_FOUND
SWE session --> the fix written --> ScoreSession == ScorePatch(gold) == ScorePatch(its own patch)
SIGKILLed service --> restart on the same work root --> its sessions' folders / containers removed
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from services.sandbox.docker_container import SESSION_LABEL
from services.sandbox.local_sessions import PREFIX
from tests.conftest import docker_sandbox_env, expect_code, require_tool
from tests.unit.sandbox.swe_repo import FIXED, make_task_set

PASSED, FAILED, TIMEOUT = (
    common_pb2.VERDICT_STATUS_PASSED,
    common_pb2.VERDICT_STATUS_FAILED,
    common_pb2.VERDICT_STATUS_TIMEOUT,
)
# A background process's argv, looked for through /proc in the next command (one line per process).
LINGER = "sleep 987"
COUNT_LINGERING = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -cx 'sleep 987 '"


@pytest.fixture(params=["local", "docker"])
def sandbox_env(request, tmp_path: Path):
    """(backend name, env of a sandbox service): work root and task root under tmp_path."""
    work_root = tmp_path / "work"
    work_root.mkdir()
    env = {"DOCKYARD_SANDBOX_WORK_ROOT": str(work_root), "DOCKYARD_SANDBOX_TASK_ROOT": str(tmp_path / "tasks")}
    if request.param == "local":
        require_tool("/usr/bin/bwrap", "bubblewrap")
        return "local", env
    image = request.getfixturevalue("docker_sandbox_image")
    return "docker", {**docker_sandbox_env(image), **env}


def stub_for(channel) -> sandbox_pb2_grpc.SandboxServiceStub:
    return sandbox_pb2_grpc.SandboxServiceStub(channel)


async def exec_shell(stub, session_id: str, line: str, **fields) -> sandbox_pb2.SessionExecResponse:
    return await stub.SessionExec(sandbox_pb2.SessionExecRequest(session_id=session_id, shell=line, **fields))


async def session_lifecycle(address: str, backend: str) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = stub_for(channel)
        opened = await stub.OpenSession(sandbox_pb2.OpenSessionRequest(files={"given.txt": "from open\n"}))
        sid = opened.session_id
        assert len(sid) >= 40 and opened.idle_timeout_seconds > 0
        await stub.WriteFile(sandbox_pb2.WriteFileRequest(session_id=sid, path="notes/todo.txt", content=b"step 1\n"))

        reply = await exec_shell(stub, sid, f"cat given.txt notes/todo.txt; echo step 2 >> notes/todo.txt; {LINGER} &")
        assert (reply.verdict.status, reply.verdict.stdout) == (PASSED, "from open\nstep 1\n")
        reply = await stub.SessionExec(
            sandbox_pb2.SessionExecRequest(session_id=sid, command=["sh", "-c", "cat notes/todo.txt; pwd"])
        )
        assert reply.verdict.stdout == f"step 1\nstep 2\n{opened.work_dir}\n"
        # No process outlives its command: the background sleep is gone (while a live one is seen).
        reply = await exec_shell(
            stub, sid, f"{COUNT_LINGERING}; sleep 986 & sleep 0.5; {COUNT_LINGERING.replace('7', '6')}"
        )
        assert reply.verdict.stdout.split() == ["0", "1"], reply.verdict

        reply = await stub.SessionExec(
            sandbox_pb2.SessionExecRequest(
                session_id=sid, command=["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin=b"abc"
            )
        )
        assert reply.verdict.stdout == "cba\n"
        reply = await exec_shell(stub, sid, "exit 3")
        assert (reply.verdict.status, reply.verdict.exit_code, reply.timed_out) == (FAILED, 3, False)
        reply = await exec_shell(stub, sid, "echo partial > slow.txt; sleep 60", timeout_seconds=1)
        assert (reply.verdict.status, reply.timed_out) == (TIMEOUT, True)
        kept = await stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path="notes/todo.txt"))
        assert kept.content == b"step 1\nstep 2\n"  # the folder survives a timeout...
        reply = await exec_shell(stub, sid, "cat slow.txt")  # ...with the killed command's writes on docker only
        assert reply.verdict.stdout == ("partial\n" if backend == "docker" else ""), reply.verdict
        reply = await exec_shell(stub, sid, "head -c 20000000 /dev/zero > big.bin")  # the disk limit is 16 MB
        assert reply.verdict.status == FAILED and "disk limit exceeded" in reply.verdict.error_message
        await exec_shell(stub, sid, "rm big.bin")
        reply = await exec_shell(stub, sid, "yes | head -c 100000", timeout_seconds=10)
        assert reply.verdict.output_truncated and len(reply.verdict.stdout) == 16 * 1024  # the default cap

        read = await stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path="notes/todo.txt", max_bytes=4))
        assert (read.content, read.size, read.truncated) == (b"step", 14, True)

        # Escapes: by name (refused before anything is touched) and by a link the code planted.
        await exec_shell(stub, sid, "ln -s /etc/passwd passwd; ln -s /etc etc")
        for path in ("../given.txt", "/etc/passwd"):
            await expect_code(stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path=path)),
                              grpc.StatusCode.INVALID_ARGUMENT, "path")  # fmt: skip
        for path in ("passwd", "etc/passwd"):
            await expect_code(stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path=path)),
                              grpc.StatusCode.INVALID_ARGUMENT, "link")  # fmt: skip
        await expect_code(
            stub.WriteFile(sandbox_pb2.WriteFileRequest(session_id=sid, path="etc/evil", content=b"x")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "link",
        )
        await expect_code(stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path="absent.txt")),
                          grpc.StatusCode.NOT_FOUND, "absent.txt")  # fmt: skip
        # A fifo the code left is there, on both backends, and is not read: the same refusal on each.
        await exec_shell(stub, sid, "mkfifo pipe")
        await expect_code(stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path="pipe")),
                          grpc.StatusCode.INVALID_ARGUMENT, "'pipe' is not a regular file")  # fmt: skip

        await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=sid))
        for call in (
            exec_shell(stub, sid, "true"),
            stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid, path="given.txt")),
            stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=sid)),
        ):
            await expect_code(call, grpc.StatusCode.NOT_FOUND, "no such session")


def test_a_session_keeps_its_files_not_its_processes(start_service, sandbox_env):
    backend, env = sandbox_env
    service = start_service("sandbox", {**env, "DOCKYARD_SANDBOX_MAX_DISK_MB": "16"})
    asyncio.run(session_lifecycle(service.address, backend))
    assert service.stop() == 0


async def bounded_and_reaped(address: str) -> None:
    async with connect(address, default_timeout=60) as channel:
        stub = stub_for(channel)
        first = await stub.OpenSession(sandbox_pb2.OpenSessionRequest(idle_timeout_seconds=1))
        await expect_code(stub.OpenSession(sandbox_pb2.OpenSessionRequest()), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "DOCKYARD_SANDBOX_MAX_SESSIONS")  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the reaper looks every few seconds
            try:
                await exec_shell(stub, first.session_id, "true")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
                break
            await asyncio.sleep(2)  # longer than the idle timeout: each probe finds it idle again
        else:
            raise AssertionError("the idle session was never reaped")
        second = await stub.OpenSession(sandbox_pb2.OpenSessionRequest())  # its slot is free again
        await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=second.session_id))


def test_sessions_are_bounded_and_idle_ones_reaped(start_service, sandbox_env):
    _, env = sandbox_env
    service = start_service("sandbox", {**env, "DOCKYARD_SANDBOX_MAX_SESSIONS": "1"})
    asyncio.run(bounded_and_reaped(service.address))
    assert "session reaped (idle)" in service.logs()


def verdict_of(score: sandbox_pb2.ScorePatchResponse) -> tuple:
    v = score.verdict
    tests = [(t.name, t.passed) for t in (*score.fail_to_pass, *score.pass_to_pass)]
    return v.status, score.resolved, v.tests_passed, v.tests_total, tests


# What a SWE session can find of the repository's history: sections split by "=".
HISTORY_PROBE = "; echo =; ".join(
    [
        "git log --all --format=%H",
        "git rev-list --all --reflog",
        "git reflog --all --format=%H",
        "git for-each-ref",
        "find .git/refs .git/packed-refs -type f 2>/dev/null; true",
        "git cat-file --batch-all-objects --batch-check='%(objectname)'",
        "ls tests 2>&1; true",
    ]
)


def base_tree_objects(mirror: Path, base_commit: str) -> set[str]:
    tree = subprocess.run(
        ["git", "--git-dir", str(mirror), "rev-list", "--objects", "--no-object-names", f"{base_commit}^{{tree}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return set(tree.stdout.split())


def upstream_blobs(mirror: Path) -> set[str]:
    """The fixed module's and the held-out test file's blobs (the mirror's upstream branch holds both)."""
    show = ["git", "--git-dir", str(mirror), "rev-parse", "upstream:pkg/core.py", "upstream:tests/test_core.py"]
    return set(subprocess.run(show, capture_output=True, text=True, check=True).stdout.split())


async def swe_session_scores_as_score_patch(address: str, row: dict, mirror: Path) -> None:
    async with connect(address, default_timeout=300) as channel:
        stub = stub_for(channel)
        task = {"task_set": "set", "instance_id": row["instance_id"]}
        opened = await stub.OpenSession(sandbox_pb2.OpenSessionRequest(**task))
        sid = opened.session_id
        reply = await exec_shell(stub, sid, "git status --porcelain; cat pkg/core.py")
        assert reply.verdict.stdout == "def add(a, b):\n    return a - b\n", reply.verdict  # base commit, clean

        # The base tree only: one parentless commit of it, no other ref, reflog entry, packed ref or object;
        # neither the fix nor the held-out tests, nor the mirror they come from.
        reply = await exec_shell(stub, sid, f"{HISTORY_PROBE}; echo =; ls {mirror.parent.parent} 2>&1; true")
        log_all, rev_list, reflog, refs, packed, objects, tests, task_root = reply.verdict.stdout.split("=\n")
        [commit] = log_all.split()
        assert rev_list.split() == [commit] and set(reflog.split()) == {commit}
        assert (refs, packed) == ("", ""), reply.verdict.stdout
        assert set(objects.split()) == base_tree_objects(mirror, row["base_commit"]) | {commit}
        assert not set(objects.split()) & upstream_blobs(mirror) and row["base_commit"] not in objects
        assert "No such file" in tests and "No such file" in task_root, reply.verdict.stdout

        unfixed = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid))
        assert unfixed.patch == ""
        same = await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(**task, patch=""))
        assert verdict_of(unfixed.score) == verdict_of(same)

        await stub.WriteFile(sandbox_pb2.WriteFileRequest(session_id=sid, path="pkg/core.py", content=FIXED.encode()))
        await exec_shell(stub, sid, "echo scratch > NOTES.txt")
        fixed = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid))
        assert fixed.score.verdict.status == PASSED and fixed.score.resolved, fixed.score.verdict
        assert "+++ b/NOTES.txt" in fixed.patch and "+    return a + b" in fixed.patch
        gold = await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(**task, patch=row["patch"]))
        own = await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(**task, patch=fixed.patch))
        assert verdict_of(fixed.score) == verdict_of(gold) == verdict_of(own)

        await exec_shell(stub, sid, "sed -i 's/a + b/a * b/' pkg/core.py")
        wrong = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid))
        as_patch = await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(**task, patch=wrong.patch))
        assert wrong.score.verdict.status == FAILED and verdict_of(wrong.score) == verdict_of(as_patch)

        # Tests written in the session to pass: flagged, and the held-out test patch, applied after the
        # session's diff, judges the (still wrong) code as written.
        await exec_shell(stub, sid, "mkdir tests; printf 'def test_add():\\n    pass\\n' > tests/test_core.py")
        cheat = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid))
        assert "+++ b/tests/test_core.py" in cheat.patch, cheat.patch
        assert cheat.score.verdict.integrity_violation and list(cheat.score.verdict.protected_paths_touched) == [
            "tests/test_core.py"
        ]
        assert cheat.score.verdict.status == FAILED and not cheat.score.resolved

        plain = await stub.OpenSession(sandbox_pb2.OpenSessionRequest())
        await expect_code(stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=plain.session_id)),
                          grpc.StatusCode.FAILED_PRECONDITION, "SWE session")  # fmt: skip


def test_score_session_gives_score_patchs_verdict(start_service, sandbox_env, tmp_path):
    require_tool("/usr/bin/git", "git")
    _, env = sandbox_env
    row = make_task_set(tmp_path / "tasks")
    service = start_service("sandbox", env)
    mirror = tmp_path / "tasks" / "set" / "repos" / "o__r.git"
    asyncio.run(swe_session_scores_as_score_patch(service.address, row, mirror))


def session_containers(pid: int | None = None) -> set[str]:
    """Session containers on this engine; with `pid`, only those the sandbox service of that process made (its
    owner label is host/pid/start), so other xdist workers' sessions, made meanwhile, are not counted."""
    listing = subprocess.run(
        ["docker", "ps", "-a", "--no-trunc", "--filter", f"label={SESSION_LABEL}",
         "--format", '{{.ID}} {{.Label "dockyard.sandbox.owner"}}'],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    rows = [line.split(" ", 1) for line in listing.stdout.splitlines() if line.strip()]
    return {row[0] for row in rows if pid is None or (len(row) == 2 and row[1].split("/")[1:2] == [str(pid)])}


async def open_two(address: str) -> None:
    async with connect(address, default_timeout=60) as channel:
        for _ in range(2):
            await stub_for(channel).OpenSession(sandbox_pb2.OpenSessionRequest(files={"a.txt": "x"}))


def test_a_restarted_service_removes_its_crashed_predecessors_sessions(start_service, sandbox_env, tmp_path):
    backend, env = sandbox_env
    work_root = Path(env["DOCKYARD_SANDBOX_WORK_ROOT"])
    # Any docker sandbox service on the host removes the containers of a dead one when it starts, and other
    # xdist workers start sandbox services: one of them may reap first, leaving this one nothing. The
    # crash is made again until this service is the one that reaps (other backends share nothing).
    for attempt in range(1, 4):
        crashed = start_service("sandbox", env)
        asyncio.run(open_two(crashed.address))
        left = session_containers(crashed.proc.pid) if backend == "docker" else set(work_root.glob(f"{PREFIX}*"))
        assert len(left) == 2
        crashed.proc.kill()  # SIGKILL: no shutdown, the sessions stay behind
        crashed.proc.wait()
        restarted = start_service("sandbox", env)
        if backend == "docker":
            assert not (left & session_containers())
        else:
            assert not list(work_root.glob(f"{PREFIX}*"))
        reaped_both = '"count": 2' in restarted.logs() or "count=2" in restarted.logs()
        if reaped_both or backend != "docker" or attempt == 3:
            break
        restarted.stop()
    assert reaped_both, restarted.logs()[-2000:]
