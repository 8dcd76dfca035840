"""The collector's reward path: env.reward terms combined with weights, a failed reward function as an
ERROR verdict (never a zero), the function's arguments, and the invalid-action penalty in shape_rewards.

The sandbox here is a stand-in answering Reward with set values; tests/contract/test_sandbox_reward.py
runs the same functions in the real sandbox service.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dockyard.agents.tool_formats import parse
from dockyard.algorithms.malformed import unclosed_thinking
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import EnvConfig, GRPOConfig
from dockyard.tasks.task import Task
from services.coordinator.reward_functions import REWARD_ERROR_PREFIX, RewardFunctions, reward_input
from services.coordinator.rewards import shape_rewards

PASSED, FAILED, ERROR = (
    common_pb2.VERDICT_STATUS_PASSED,
    common_pb2.VERDICT_STATUS_FAILED,
    common_pb2.VERDICT_STATUS_ERROR,
)
TASK = Task(task_id="t/1", prompt="f(x)=", tests=("assert f(1) == 2",), solution="x + 1")
SOURCE = "def score(task, completion, verdict):\n    return 0.0\n"


class Sandbox:
    """Answers Reward with `values` in turn (a str: an ERROR verdict with that message); records requests."""

    def __init__(self, *values: float | str) -> None:
        self.values, self.requests = list(values), []

    async def Reward(self, request: sandbox_pb2.RewardRequest, timeout=None) -> sandbox_pb2.RewardResponse:
        self.requests.append(request)
        value = self.values.pop(0)
        if isinstance(value, str):
            return sandbox_pb2.RewardResponse(verdict=common_pb2.Verdict(status=ERROR, error_message=value))
        return sandbox_pb2.RewardResponse(verdict=common_pb2.Verdict(status=PASSED), reward=value)


def rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reward, sandbox: Sandbox | None) -> RewardFunctions:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(SOURCE)

    async def on_sandbox(call, task_id):
        return "no sandbox worker is alive" if sandbox is None else await call(sandbox)

    return RewardFunctions(EnvConfig(reward=reward), sandbox_pb2.Limits(timeout_seconds=5.0), on_sandbox)


def trajectory(status=PASSED, passed=4, total=4, text="x + 1") -> common_pb2.Trajectory:
    verdict = common_pb2.Verdict(status=status, tests_passed=passed, tests_total=total)
    return common_pb2.Trajectory(trajectory_id="g/0", completion_text=text, verdict=verdict, finish_reason="stop")


async def test_weighted_terms_are_summed(tmp_path, monkeypatch) -> None:
    sandbox = Sandbox(0.5, 2.0)
    terms = [{"reward": "mine.py:score", "weight": 0.7}, {"reward": "pass_fraction", "weight": -0.3}]
    path = rewards(tmp_path, monkeypatch, terms, sandbox)
    passed, failed = trajectory(), trajectory(FAILED, passed=1, total=4)
    await path.assign(TASK, [passed, failed])
    assert passed.valid and passed.reward == pytest.approx(0.7 * 0.5 - 0.3 * 1.0)
    assert failed.valid and failed.reward == pytest.approx(0.7 * 2.0 - 0.3 * 0.25)
    request = sandbox.requests[0]
    assert (request.source, request.function, request.origin) == (SOURCE, "score", "mine.py:score")
    assert json.loads(request.input_json) == json.loads(json.dumps(reward_input(TASK, passed, diff_state=False)))


async def test_a_failed_function_is_an_error_verdict_not_a_zero(tmp_path, monkeypatch) -> None:
    message = "reward function mine.py:score: returned nan, not a finite number"
    path = rewards(tmp_path, monkeypatch, "mine.py:score", Sandbox(message, 1.0))
    failed, scored, infra = trajectory(), trajectory(), trajectory(ERROR, passed=0, total=0)
    await path.assign(TASK, [failed, scored, infra])
    assert (failed.valid, failed.verdict.status, failed.verdict.error_message) == (False, ERROR, message)
    assert (scored.valid, scored.reward) == (True, 1.0)
    assert not infra.valid  # already an infrastructure error: no function was called for it

    unreachable = rewards(tmp_path, monkeypatch, "mine.py:score", None)
    lost = trajectory()
    await unreachable.assign(TASK, [lost])
    assert not lost.valid and lost.verdict.status == ERROR
    assert lost.verdict.error_message.startswith(f"{REWARD_ERROR_PREFIX}mine.py:score: no sandbox could run it")


async def test_built_in_rewards_make_no_sandbox_call(tmp_path, monkeypatch) -> None:
    sandbox = Sandbox()
    path = rewards(tmp_path, monkeypatch, "all_pass", sandbox)
    t = trajectory(FAILED, passed=3, total=4)
    await path.assign(TASK, [t])
    assert (t.valid, t.reward, sandbox.requests) == (True, 0.0, [])


def test_the_function_gets_every_task_field_and_the_agent_diff() -> None:
    arguments = reward_input(TASK, trajectory(text="diff --git a/x b/x"), diff_state=True)
    assert set(arguments["task"]) == {f.name for f in dataclasses.fields(Task)}
    assert arguments["completion"]["state"] == {"diff": "diff --git a/x b/x"}
    assert arguments["verdict"]["status"] == "passed" and arguments["verdict"]["tests_total"] == 4
    json.dumps(arguments)


def test_the_penalty_is_subtracted_once_from_malformed_valid_trajectories() -> None:
    ts = [trajectory(), trajectory(), trajectory(), trajectory()]
    for t, reward in zip(ts, (1.0, 1.0, 0.5, 0.0), strict=True):
        t.reward, t.valid = reward, True
    ts[0].invalid_actions, ts[2].invalid_actions = 3, 1
    ts[3].invalid_actions, ts[3].valid = 1, False  # masked: shaping never touches it
    ts[2].verdict.integrity_violation = True  # zeroed first, then penalized
    shape_rewards(ts, GRPOConfig(invalid_action_penalty=0.25))
    assert [t.reward for t in ts] == [0.75, 1.0, -0.25, 0.0]

    off = [trajectory()]
    off[0].reward, off[0].valid, off[0].invalid_actions = 1.0, True, 2
    shape_rewards(off, GRPOConfig())
    assert off[0].reward == 1.0


@pytest.mark.parametrize(
    ("text", "unclosed"),
    [
        ("<think>plan</think>answer", False),
        ("plan</think>answer", False),  # the template opened the block in the prompt
        ("<think>plan, never closed", True),
        ("<think>a</think> b <think>again", True),
        ("no thinking at all", False),
    ],
)
def test_unclosed_thinking(text: str, unclosed: bool) -> None:
    assert unclosed_thinking(text) is unclosed


TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {}}}]


@pytest.mark.parametrize(
    ("text", "malformed", "calls"),
    [
        ('<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>', False, 1),
        ("just an answer", False, 0),
        ('<tool_call>{"name": "shell", "arguments": {"command": </tool_call>', True, 0),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', True, 0),
        ('<tool_call>{"name": "shell", "arguments": {}}', True, 0),
    ],
)
def test_the_tool_parser_flags_a_call_it_could_not_parse(text: str, malformed: bool, calls: int) -> None:
    parsed = parse("hermes", text, TOOLS)
    assert (parsed.malformed, len(parsed.tool_calls)) == (malformed, calls)


def test_the_endpoint_session_counts_turns_with_a_malformed_action() -> None:
    from dockyard.models.tokenizer import build_char_tokenizer
    from services.endpoint.rendering import Renderer
    from services.endpoint.sessions import Sampled, SessionStore

    renderer = Renderer(build_char_tokenizer())
    session = SessionStore(4, 60, 10).open("s")
    messages = [{"role": "user", "content": "hi"}]
    for text, malformed in [("<tool_call>{</tool_call>", True), ("ok", False), ("<think>never closed", True)]:
        ids = renderer.encode(text)
        reply = {"role": "assistant", "content": text}
        sampled = Sampled(ids, [-0.5] * len(ids), renderer.decode(ids), "eos", reply, malformed)
        session.record(session.plan(renderer, messages, None), [sampled], 1, [1])
        messages = [*messages, reply, {"role": "user", "content": "go on"}]
    assert session.trajectory()["invalid_actions"] == 2
