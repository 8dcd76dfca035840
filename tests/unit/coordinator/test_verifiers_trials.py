"""The agent worker's side of env verifiers: what a trial's session gets, and how the runner's result ends it.

The session opens with the image's requirements (verifiers and the environment's package) and a route to
the endpoint; the runner is run with its row and the split's arguments; its result becomes the verdict
through the environment's scoring (Environment.score: the reward as the pass fraction). A rubric error,
or a reward outside [0, 1], is a masked trial counted as a scaffold error, never a reward. The sandbox
and the endpoint are the fakes of test_scaffold_errors.py.
"""

from __future__ import annotations

import json
import shlex

import httpx
import pytest

from dockyard.agents.external import SCAFFOLD_ERROR_PREFIX, is_scaffold_error
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import load_config
from dockyard.config.verifiers import RESULT_FILE, RUNNER_COMMAND
from dockyard.tasks.envs import environment
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.fleet import Fleet
from services.coordinator.task_stream import load_tasks
from tests.conftest import REPO_ROOT
from tests.unit.coordinator.test_scaffold_errors import Ends, FakeEndpoint, FakeSandbox

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_verifiers.yaml"


class RecordingSandbox(FakeSandbox):
    def __init__(self, endpoint, ends) -> None:
        super().__init__(endpoint, ends)
        self.open_requests, self.shells, self.read = [], [], []

    async def OpenSession(self, request, timeout=None):  # noqa: N802
        self.open_requests.append(request)
        return await super().OpenSession(request, timeout)

    async def SessionExec(self, request, timeout=None):  # noqa: N802
        self.shells.append(request.shell)
        return await super().SessionExec(request, timeout)

    async def ReadFile(self, request, timeout=None):  # noqa: N802
        self.read.append(request.path)
        return await super().ReadFile(request, timeout)


async def run_one(result: dict, split: str = "train"):
    config = load_config(CONFIG, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4"])
    endpoint = FakeEndpoint()
    sandbox = RecordingSandbox(endpoint, [Ends(answer=json.dumps(result).encode())])
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, sandbox))
    fleet.register("sandbox", "sandbox", "127.0.0.1:1")
    limits = sandbox_pb2.Limits(timeout_seconds=10)
    env = environment(config)

    async def score(task, answer, request_id):  # the collector's path: Environment.score (no sandbox call)
        return await env.score(None, task, answer, request_id, limits)

    trials = AgentTrials(
        "job",
        config,
        fleet,
        score,
        limits,
        endpoint_address="127.0.0.1:9",
        token="token",
        max_regenerations=0,
        wait_timeout=5.0,
        transport=httpx.MockTransport(endpoint.handle),
    )
    task = load_tasks(config, split)[0]
    try:
        [trial] = await trials.group(task, "job/g0", 0, 1, config.policy.generation)
    finally:
        await trials.close()
    return config, task, trial, trials, sandbox


def exported(shell: str) -> dict[str, str]:
    """The variables the shell line exports (each `export NAME=<quoted value>`)."""
    words = shlex.split(shell)
    return dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "export")


async def test_the_session_installs_the_environment_and_runs_the_runner_on_the_tasks_row() -> None:
    config, task, trial, trials, sandbox = await run_one({"reward": 0.375, "rewards": {"correct": 0.375}})
    [opened] = sandbox.open_requests
    assert list(opened.packages) == ["verifiers==0.4.0", "./examples/verifiers_env"] and opened.endpoint_address
    [shell] = sandbox.shells
    assert shell.rstrip().endswith(RUNNER_COMMAND)
    variables = exported(shell)
    row = int(task.task_id.rsplit("-", 1)[1])
    assert json.loads(variables["DOCKYARD_VERIFIERS_ENV"]) == {
        "module": "dockyard_verifiers_example",
        "args": config.env.verifiers.args,
        "row": row,
    }
    assert variables["DOCKYARD_VERIFIERS_RESULT"] == RESULT_FILE and sandbox.read == [RESULT_FILE]
    assert "load_environment" in variables["DOCKYARD_VERIFIERS_RUNNER"]
    t = trial.trajectory
    assert not is_scaffold_error(t) and list(t.completion_loss_mask) == [1, 1]
    assert t.verdict.status == common_pb2.VERDICT_STATUS_FAILED
    assert t.verdict.tests_passed / t.verdict.tests_total == 0.375
    assert trials.scaffold_errors.total == 0


async def test_a_validation_trial_gets_the_eval_arguments() -> None:
    config, _, trial, _, sandbox = await run_one({"reward": 1.0}, split="validation")
    variables = exported(sandbox.shells[0])
    assert json.loads(variables["DOCKYARD_VERIFIERS_ENV"])["args"] == config.env.verifiers.eval_args
    assert trial.trajectory.verdict.status == common_pb2.VERDICT_STATUS_PASSED


@pytest.mark.parametrize(
    ("result", "error"),
    [
        ({"error": "the rubric raised: ZeroDivisionError: division by zero"}, "the rubric raised: ZeroDivision"),
        ({"reward": 1.5}, "the rubric's reward 1.5 is outside [0, 1]"),
    ],
)
async def test_a_rubric_error_is_a_masked_trial_counted_as_the_environments(result, error) -> None:
    _, _, trial, trials, _ = await run_one(result)
    t = trial.trajectory
    assert not t.valid and is_scaffold_error(t) and not t.completion_token_ids
    assert t.verdict.status == common_pb2.VERDICT_STATUS_ERROR
    name = "verifiers environment dockyard_verifiers_example"
    assert t.verdict.error_message.startswith(f"{SCAFFOLD_ERROR_PREFIX}{name}: {error}"), t.verdict.error_message
    assert trials.scaffold_errors.total == 1 and trials.regenerated_groups == 0
