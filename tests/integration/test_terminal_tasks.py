"""The shipped terminal tasks, each validated through a real sandbox service on the docker backend.

    examples/tasks/terminal/<task>/ ──OpenSession(task_set, task id)──> the task's image (built offline,
        one per distinct Dockerfile + context) with WORKDIR's files
      oracle:  solution.sh into /oracle, `bash /oracle/solution.sh` in WORKDIR ──ScoreSession──> PASSED, all tests
      nothing: no /tests yet, a test planted there ──ScoreSession──> FAILED, some test failing (the task's own ran)
    a Dockerfile that needs the network ──OpenSession──> FAILED_PRECONDITION naming its line

This is the environment's own path (services/sandbox/session_api.py -> terminal.py), the one agent
trials take; tasks run a few at a time.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from dockyard.tasks.terminal import task_folders
from tests.conftest import REPO_ROOT, docker_sandbox_env

TASK_ROOT = REPO_ROOT / "examples" / "tasks"
TASK_SET = "terminal"
PASSED, FAILED = common_pb2.VERDICT_STATUS_PASSED, common_pb2.VERDICT_STATUS_FAILED
LIMITS = sandbox_pb2.Limits(timeout_seconds=60, memory_mb=512, cpu_seconds=60)


async def validate(stub, task_id: str, solution: bytes) -> dict[str, common_pb2.Verdict]:
    """{"oracle": verdict after solution.sh, "nothing": verdict of the untouched task}."""
    verdicts = {}
    for mode in ("oracle", "nothing"):
        opened = await stub.OpenSession(
            sandbox_pb2.OpenSessionRequest(task_set=TASK_SET, instance_id=task_id, limits=LIMITS)
        )
        sid = opened.session_id
        try:
            if mode == "nothing":  # no test is there yet, and one the agent plants is not what runs
                plant = (
                    'echo "TEST_DIR=$TEST_DIR"; ls /tests/ 2>&1; mkdir -p /tmp/dockyard-tests && '
                    "printf 'def test_planted():\\n    pass\\n' > /tests/test_outputs.py"
                )
                reply = await stub.SessionExec(sandbox_pb2.SessionExecRequest(session_id=sid, shell=plant))
                assert reply.verdict.stdout.startswith("TEST_DIR=/tests\nls: cannot access"), reply.verdict
            if mode == "oracle":
                copy = "mkdir -p /tmp/dockyard-oracle && cat > /oracle/solution.sh"
                reply = await stub.SessionExec(
                    sandbox_pb2.SessionExecRequest(session_id=sid, shell=copy, stdin=solution)
                )
                assert reply.verdict.status == PASSED, reply.verdict
                reply = await stub.SessionExec(
                    sandbox_pb2.SessionExecRequest(session_id=sid, command=["bash", "/oracle/solution.sh"])
                )
                assert reply.verdict.status == PASSED, (task_id, reply.verdict)
            scored = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid, limits=LIMITS))
            verdicts[mode] = scored.score.verdict
        finally:
            await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=sid))
    return verdicts


async def validate_all(address: str, tasks: dict[str, bytes]) -> dict[str, dict[str, common_pb2.Verdict]]:
    async with connect(address, default_timeout=600) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        slots = asyncio.Semaphore(4)

        async def one(task_id: str) -> dict[str, common_pb2.Verdict]:
            async with slots:
                return await validate(stub, task_id, tasks[task_id])

        results = await asyncio.gather(*(one(t) for t in tasks))
        # A task whose Dockerfile needs the network is refused at open, its line and reason named.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenSession(sandbox_pb2.OpenSessionRequest(task_set="broken", instance_id="needs-apt"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "line 3: 'apt-get update': apt needs a Debian mirror" in refused.value.details()
    return dict(zip(tasks, results, strict=True))


def test_every_shipped_task_passes_its_solution_and_fails_untouched(
    docker_sandbox_image, start_service, tmp_path: Path
) -> None:
    folders = task_folders(TASK_ROOT / TASK_SET)
    categories = {tag for f in folders for tag in f.config.tags}
    assert len(folders) >= 8 and {"shell", "files", "git", "python"} <= categories
    root = tmp_path / "tasks"
    root.mkdir()
    (root / TASK_SET).symlink_to(TASK_ROOT / TASK_SET)
    broken = root / "broken" / "needs-apt"
    shutil.copytree(TASK_ROOT / TASK_SET / "hello-file", broken)
    needs_apt = "FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && apt-get install -y tmux\n"
    (broken / "Dockerfile").write_text(needs_apt)
    env = docker_sandbox_env(
        docker_sandbox_image,
        task_root=str(root),
        work_root=str(tmp_path),
        max_concurrency="4",
        max_sessions="8",
    )
    service = start_service("sandbox", env)
    results = asyncio.run(validate_all(service.address, {f.task_id: f.solution_path.read_bytes() for f in folders}))
    wrong = {}
    for task_id, verdicts in results.items():
        oracle, nothing = verdicts["oracle"], verdicts["nothing"]
        if not (oracle.status == PASSED and oracle.tests_passed == oracle.tests_total >= 3):
            wrong[task_id] = ("solution.sh does not pass", oracle.stdout[-1500:], oracle.error_message)
        if not (nothing.status == FAILED and nothing.tests_passed < nothing.tests_total):
            wrong[task_id] = ("doing nothing does not fail", nothing.stdout[-1500:], nothing.error_message)
    assert not wrong, wrong


@pytest.mark.parametrize("task_id", ["hello-file"])
def test_a_task_image_is_reused_by_content_hash(docker_sandbox_image, task_id: str, tmp_path: Path) -> None:
    """Two tasks with the same Dockerfile share one image; a second ensure builds nothing."""
    import docker

    from services.sandbox.terminal_images import TerminalImages

    images = TerminalImages(docker.from_env(), docker_sandbox_image, tmp_path)
    folders = {f.task_id: f for f in task_folders(TASK_ROOT / TASK_SET)}
    first = images.ensure(folders[task_id])
    assert images.ensure(folders["greet-script"])[0] == first[0]  # same Dockerfile, no extra context
    assert images.ensure(folders["git-commit-notes"])[0] != first[0]
    assert first[2] == "/app" and Path(first[1]).is_dir()
