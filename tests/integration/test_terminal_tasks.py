"""The shipped terminal tasks, in both formats, each validated through a real sandbox service on docker.

    examples/tasks/{terminal,harbor}/<task>/ ──OpenSession(task_set, task id)──> the task's image (built
        offline, one per distinct Dockerfile + context: a task's two forms share it) with WORKDIR's files
      oracle:  solution.sh into /oracle (Harbor: solve.sh into /solution), run in WORKDIR ──ScoreSession──>
               PASSED, all tests (Harbor: reward 1)
      nothing: no /tests yet, a test and a reward planted ──ScoreSession──> FAILED (the task's own tests ran)
    a Dockerfile that needs the network ──OpenSession──> FAILED_PRECONDITION naming its line
    a Harbor test.sh that writes no reward, a partial one, one past 1, or runs too long ──ScoreSession──>
        FAILED naming why, FAILED 1/4, FAILED naming why, TIMEOUT

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
from dockyard.tasks.terminal_sets import any_task_folders
from tests.conftest import REPO_ROOT, docker_sandbox_env

TASK_ROOT = REPO_ROOT / "examples" / "tasks"
TASK_SET = "terminal"
HARBOR_SET = "harbor"
PASSED, FAILED = common_pb2.VERDICT_STATUS_PASSED, common_pb2.VERDICT_STATUS_FAILED
LIMITS = sandbox_pb2.Limits(timeout_seconds=60, memory_mb=512, cpu_seconds=60)


async def validate(stub, task_set: str, task_id: str, solution: bytes) -> dict[str, common_pb2.Verdict]:
    """{"oracle": verdict after the solution, "nothing": verdict of the untouched task}; the solution goes
    where the format's oracle puts it (terminal-bench: /oracle/solution.sh, Harbor: /solution/solve.sh)."""
    oracle = "/oracle/solution.sh" if task_set == TASK_SET else "/solution/solve.sh"
    verdicts = {}
    for mode in ("oracle", "nothing"):
        opened = await stub.OpenSession(
            sandbox_pb2.OpenSessionRequest(task_set=task_set, instance_id=task_id, limits=LIMITS)
        )
        sid = opened.session_id
        try:
            if mode == "nothing":  # no test is there yet, and a test or reward the agent plants is not what counts
                plant = (
                    'echo "TEST_DIR=$TEST_DIR"; ls /tests/ 2>&1; '
                    "mkdir -p /tmp/dockyard-tests /tmp/dockyard-logs/verifier"
                    " && printf 'def test_planted():\\n    pass\\n' > /tests/test_outputs.py"
                    " && echo 1 > /logs/verifier/reward.txt"
                )
                reply = await stub.SessionExec(sandbox_pb2.SessionExecRequest(session_id=sid, shell=plant))
                assert reply.verdict.stdout.startswith("TEST_DIR=/tests\nls: cannot access"), reply.verdict
            if mode == "oracle":
                copy = f"mkdir -p $(readlink {oracle.rsplit('/', 1)[0]}) && cat > {oracle}"
                reply = await stub.SessionExec(
                    sandbox_pb2.SessionExecRequest(session_id=sid, shell=copy, stdin=solution)
                )
                assert reply.verdict.status == PASSED, reply.verdict
                reply = await stub.SessionExec(sandbox_pb2.SessionExecRequest(session_id=sid, command=["bash", oracle]))
                assert reply.verdict.status == PASSED, (task_id, reply.verdict)
            scored = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=sid, limits=LIMITS))
            verdicts[mode] = scored.score.verdict
        finally:
            await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=sid))
    return verdicts


async def score_untouched(stub, task_set: str, task_id: str) -> common_pb2.Verdict:
    opened = await stub.OpenSession(sandbox_pb2.OpenSessionRequest(task_set=task_set, instance_id=task_id))
    try:
        scored = await stub.ScoreSession(sandbox_pb2.ScoreSessionRequest(session_id=opened.session_id, limits=LIMITS))
        return scored.score.verdict
    finally:
        await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=opened.session_id))


Tasks = dict[tuple[str, str], bytes]  # (task set, task id) -> its solution
TIMEOUT = common_pb2.VERDICT_STATUS_TIMEOUT
# Harbor tasks whose tests/test.sh does this (after `mkdir -p /logs/verifier`) ...
ODD_TEST_SH = {
    "no-reward": "echo tests ran; exit 0",
    "partial": """echo '{"reward": 0.25, "x": 1}' > /logs/verifier/reward.json; echo 1 > /logs/verifier/reward.txt""",
    "too-big": "echo 7 > /logs/verifier/reward.txt",
    "slow": "sleep 30; echo 1 > /logs/verifier/reward.txt",
}
# ... get this verdict: (status, tests_passed, tests_total, words in error_message).
ODD_REWARDS = {
    "no-reward": (FAILED, 0, 0, "wrote no reward"),
    "partial": (FAILED, 1, 4, ""),  # reward.json first, as harbor reads it: 0.25, for pass_fraction
    "too-big": (FAILED, 0, 0, "outside [0, 1]"),
    "slow": (TIMEOUT, 0, 0, "verifier.timeout_sec=2"),
}


async def validate_all(address: str, tasks: Tasks) -> dict[tuple[str, str], dict[str, common_pb2.Verdict]]:
    async with connect(address, default_timeout=600) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        slots = asyncio.Semaphore(4)

        async def one(key: tuple[str, str]) -> dict[str, common_pb2.Verdict]:
            async with slots:
                return await validate(stub, *key, tasks[key])

        results = await asyncio.gather(*(one(key) for key in tasks))
        # A task whose Dockerfile needs the network is refused at open, its line and reason named.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenSession(sandbox_pb2.OpenSessionRequest(task_set="broken", instance_id="needs-apt"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "line 3: 'apt-get update': apt needs a Debian mirror" in refused.value.details()
        # A Harbor task's verdict is the reward its test.sh writes, whatever test.sh's exit status.
        for task_id, (status, passed, total, words) in ODD_REWARDS.items():
            verdict = await score_untouched(stub, "odd-harbor", task_id)
            got = (verdict.status, verdict.tests_passed, verdict.tests_total)
            assert got == (status, passed, total) and words in verdict.error_message, (task_id, verdict)
    return dict(zip(tasks, results, strict=True))


def test_every_shipped_task_passes_its_solution_and_fails_untouched(
    docker_sandbox_image, start_service, tmp_path: Path
) -> None:
    """Both shipped sets, terminal-bench's and the same tasks in Harbor's format, through one service
    (the two formats' tasks share their images)."""
    folders = task_folders(TASK_ROOT / TASK_SET)
    harbor = any_task_folders(TASK_ROOT / HARBOR_SET)
    categories = {tag for f in folders for tag in f.config.tags}
    assert len(folders) >= 8 and {"shell", "files", "git", "python"} <= categories
    assert {f.task_id for f in harbor} == {f.task_id for f in folders}
    root = tmp_path / "tasks"
    root.mkdir()
    for task_set in (TASK_SET, HARBOR_SET):
        (root / task_set).symlink_to(TASK_ROOT / task_set)
    broken = root / "broken" / "needs-apt"
    shutil.copytree(TASK_ROOT / TASK_SET / "hello-file", broken)
    needs_apt = "FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && apt-get install -y tmux\n"
    (broken / "Dockerfile").write_text(needs_apt)
    for task_id, test_sh in ODD_TEST_SH.items():
        odd = root / "odd-harbor" / task_id
        shutil.copytree(TASK_ROOT / HARBOR_SET / "hello-file", odd)
        (odd / "tests" / "test.sh").write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n{test_sh}\n")
        (odd / "task.toml").write_text("[verifier]\ntimeout_sec = 2\n")
    env = docker_sandbox_env(
        docker_sandbox_image,
        task_root=str(root),
        work_root=str(tmp_path),
        max_concurrency="4",
        max_sessions="8",
    )
    service = start_service("sandbox", env)
    tasks = {(TASK_SET, f.task_id): f.solution_path.read_bytes() for f in folders}
    tasks |= {(HARBOR_SET, f.task_id): f.solution_path.read_bytes() for f in harbor}
    results = asyncio.run(validate_all(service.address, tasks))
    wrong = {}
    for (task_set, task_id), verdicts in results.items():
        oracle, nothing = verdicts["oracle"], verdicts["nothing"]
        # terminal-bench's verdict counts pytest's tests (at least 3 a task); Harbor's is the reward, 1 or 0.
        least = 3 if task_set == TASK_SET else 1
        if not (oracle.status == PASSED and oracle.tests_passed == oracle.tests_total >= least):
            wrong[task_set, task_id] = ("the solution does not pass", oracle.stdout[-1500:], oracle.error_message)
        if not (nothing.status == FAILED and nothing.tests_passed < nothing.tests_total):
            wrong[task_set, task_id] = ("doing nothing does not fail", nothing.stdout[-1500:], nothing.error_message)
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
