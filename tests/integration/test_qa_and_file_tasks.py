"""The hle and gdpval environments scored through a real sandbox service (local backend).

    hle:    each shipped question's reference answer ──Environment("hle").score──> RunTests ──> PASSED;
            a wrong answer and no "Answer:" line ──> FAILED (reward 0, valid)
    gdpval: examples/tasks/gdpval/<task>/ ──OpenSession(task_set, task id)──> a session seeded with reference/
      solution: solution.sh run in the session ──ScoreSession──> PASSED, every check
      nothing:  the untouched session ──ScoreSession──> FAILED, the missing deliverable named
      partial:  wrong deliverables, a planted checker.py and modules named like the checker's imports
                ──ScoreSession──> FAILED, the task's own checks ran

This is the path agent trials take (services/coordinator/agent_trials.py scores gdpval with ScoreSession).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from dockyard.agents.session import SandboxSession
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from dockyard.tasks import qa
from dockyard.tasks.envs import Environment
from dockyard.tasks.gdpval import TaskFolder, task_folders
from services.coordinator.rewards import reward_of
from tests.conftest import REPO_ROOT, expect_code

TASKS = REPO_ROOT / "examples" / "tasks"
PASSED, FAILED = common_pb2.VERDICT_STATUS_PASSED, common_pb2.VERDICT_STATUS_FAILED
LIMITS = sandbox_pb2.Limits(timeout_seconds=30, memory_mb=512, cpu_seconds=30)


def test_shipped_questions_are_scored_in_the_sandbox(start_service) -> None:
    service = start_service("sandbox", {"DOCKYARD_SANDBOX_BACKEND": "local", "DOCKYARD_SANDBOX_MAX_CONCURRENCY": "2"})
    tasks = qa.load_rows(TASKS / "qa" / "train.jsonl") + qa.load_rows(TASKS / "qa" / "validation.jsonl")
    env = Environment("hle")

    async def main() -> list[tuple[str, common_pb2.Verdict]]:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            cases = [(t, c, kind) for t in tasks for c, kind in ((t.solution, "ok"), ("Answer: 9999", "wrong"))]
            cases.append((tasks[0], tasks[0].solution.replace("Answer:", "So:"), "no answer line"))
            verdicts = await asyncio.gather(
                *(env.score(stub, t, c, f"r{i}", LIMITS) for i, (t, c, _) in enumerate(cases))
            )
            return [(kind, v) for (_, _, kind), v in zip(cases, verdicts, strict=True)]

    results = asyncio.run(main())
    wrong = [(kind, v.status, v.stderr[-300:]) for kind, v in results if (v.status == PASSED) != (kind == "ok")]
    assert not wrong, wrong
    assert all(reward_of(v, "pass_fraction") == (1.0 if kind == "ok" else 0.0, True) for kind, v in results)


async def _score(stub, folder: TaskFolder, mode: str) -> common_pb2.Verdict:
    task_id = folder.task_id
    session = await SandboxSession.open(
        stub, f"{task_id}-{mode}", files={}, limits=LIMITS, task_set="gdpval", instance_id=task_id
    )
    try:
        listed = await session.run(shell="ls")
        assert sorted(listed.stdout.split()) == folder.reference_files(), (task_id, listed)
        if mode == "solution":
            await session.write_file(".solution.sh", folder.solution_path.read_bytes())
            ran = await session.run(argv=["bash", ".solution.sh"])
            assert ran.exit_code == 0, (task_id, ran)
        if mode == "partial":  # every deliverable there but wrong, and a checker of the agent's own
            for path in folder.config.deliverables:
                await session.write_file(path, b'{"wrong": true}\n')
            await session.write_file("checker.py", b"print('ok 1 - everything')\n")
            for module in ("csv.py", "json.py", "re.py"):  # modules the checkers import, shadowed
                await session.write_file(module, b"print('ok 1 - hijacked')\nraise SystemExit(0)\n")
        return (await session.score(LIMITS)).score.verdict
    finally:
        await session.close()


def test_shipped_file_tasks_pass_their_solution_and_fail_untouched(start_service, tmp_path: Path) -> None:
    folders = task_folders(TASKS / "gdpval")
    assert len(folders) >= 4
    root = tmp_path / "tasks"
    root.mkdir()
    (root / "gdpval").symlink_to(TASKS / "gdpval")
    env = {"DOCKYARD_SANDBOX_BACKEND": "local", "DOCKYARD_SANDBOX_TASK_ROOT": str(root)}
    service = start_service("sandbox", env | {"DOCKYARD_SANDBOX_MAX_CONCURRENCY": "2"})

    async def main() -> dict[tuple[str, str], common_pb2.Verdict]:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            keys = [(f, mode) for f in folders for mode in ("solution", "nothing", "partial")]
            verdicts = await asyncio.gather(*(_score(stub, f, mode) for f, mode in keys))
            await expect_code(
                stub.OpenSession(sandbox_pb2.OpenSessionRequest(task_set="gdpval", instance_id="nope", limits=LIMITS)),
                grpc.StatusCode.NOT_FOUND,
                "task 'nope' not found in task set 'gdpval'",
            )
            return {(f.task_id, mode): v for (f, mode), v in zip(keys, verdicts, strict=True)}

    results = asyncio.run(main())
    wrong = {}
    for folder in folders:
        solved, nothing, partial = (results[folder.task_id, m] for m in ("solution", "nothing", "partial"))
        if not (solved.status == PASSED and solved.tests_passed == solved.tests_total >= 3):
            wrong[folder.task_id, "solution"] = (solved.status, solved.stdout[-800:], solved.error_message)
        first = folder.config.deliverables[0]
        if not (nothing.status == FAILED and nothing.tests_passed == 0 and first in nothing.error_message):
            wrong[folder.task_id, "nothing"] = (nothing.status, nothing.error_message)
        # The task's own checker ran (not the planted one): several checks, most failing.
        if not (partial.status == FAILED and partial.tests_total >= 3 and partial.tests_passed < partial.tests_total):
            wrong[folder.task_id, "partial"] = (partial.status, partial.stdout[-800:], partial.error_message)
        else:
            assert reward_of(partial, "pass_fraction")[0] == partial.tests_passed / partial.tests_total
    assert not wrong, wrong
    assert "missing deliverable" in results["invoice-totals", "nothing"].error_message
