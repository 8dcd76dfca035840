"""env.reward for a group: built-in rewards from the verdict, user functions in the sandbox, one weighted sum.

    (task, trajectory with its verdict) ─> for each (reward, weight) of env.reward:
        pass_fraction / all_pass ─rewards.reward_of─> value
        module:function / file.py:function ─reward_input (task, completion, verdict as JSON)─>
            sandbox Reward RPC (the function's source shipped with the call, run there) ─> value or ERROR
    ─> Σ weight · value ─> trajectory.reward (valid), or an ERROR verdict (invalid) ─> rewards.shape_rewards

Guarantees: a user function never runs in this process: its file is found and read at job start without
importing it (dockyard/tasks/reward_functions.py; a missing file or function fails the job there) and runs
only in the sandbox. A trajectory whose verdict is already ERROR is invalid and calls no function. A
function that raises, times out, returns NaN, inf or a non-number, or that no sandbox worker could run
makes the trajectory's verdict ERROR (invalid, masked out of the group statistics, never a zero reward)
with an error_message starting REWARD_ERROR_PREFIX and naming the function and why; it is logged, and
counted per step as `reward_function_errors`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import EnvConfig
from dockyard.tasks.envs import DEADLINE_MARGIN_SECONDS
from dockyard.tasks.reward_functions import RewardSource, is_function, load
from dockyard.tasks.task import Task
from services.coordinator.rewards import reward_of

REWARD_ERROR_PREFIX = "reward function "
# Agent environments whose trial ends in a work folder scored by its diff: the diff is the trial's state.
DIFF_STATE_ENVS = ("swe", "terminal_bench")

T = TypeVar("T")
# call(stub) on a sandbox worker, tried on others when one is lost or full; the error text when none could.
OnSandbox = Callable[[Callable[[sandbox_pb2_grpc.SandboxServiceStub], Awaitable[T]], str], Awaitable["T | str"]]

log = structlog.get_logger()


def _status(verdict: common_pb2.Verdict) -> str:
    return common_pb2.VerdictStatus.Name(verdict.status).removeprefix("VERDICT_STATUS_").lower()


def reward_input(task: Task, trajectory: common_pb2.Trajectory, *, diff_state: bool) -> dict[str, Any]:
    """The function's three arguments. `task` holds every field of the Task (a field added to Task
    arrives with no change here); `completion` the scored text, how it ended and, for agent trials
    scored from their work folder, `state.diff`; `verdict` the sandbox's verdict."""
    text = trajectory.completion_text
    verdict = trajectory.verdict
    return {
        "task": dataclasses.asdict(task),
        "completion": {
            "text": text,
            "finish_reason": trajectory.finish_reason,
            "num_turns": trajectory.num_turns or 1,
            "state": {"diff": text} if diff_state else {},
        },
        "verdict": {
            "status": _status(verdict),
            "tests_passed": verdict.tests_passed,
            "tests_total": verdict.tests_total,
            "exit_code": verdict.exit_code,
            "stdout": verdict.stdout,
            "stderr": verdict.stderr,
            "error_message": verdict.error_message,
            "integrity_violation": verdict.integrity_violation,
            "duration_seconds": verdict.duration_seconds,
        },
    }


class RewardFunctions:
    def __init__(self, env: EnvConfig, limits: sandbox_pb2.Limits, on_sandbox: OnSandbox) -> None:
        """Reads every named function's source now (RewardFunctionError when one is missing)."""
        self.terms = env.reward_terms
        self.sources: dict[str, RewardSource] = {spec: load(spec) for spec, _ in self.terms if is_function(spec)}
        self._limits = limits
        self._on_sandbox = on_sandbox
        self._diff_state = env.agentic and env.name in DIFF_STATE_ENVS

    async def assign(self, task: Task, trajectories: list[common_pb2.Trajectory]) -> None:
        """Set reward and valid of each scored trajectory (in place); a failed function makes it ERROR."""
        for t in trajectories:  # sequential per group: the sandbox semaphore bounds the calls anyway
            await self._one(task, t)

    async def _one(self, task: Task, t: common_pb2.Trajectory) -> None:
        if t.verdict.status == common_pb2.VERDICT_STATUS_ERROR:  # the scoring failed: masked, no function runs
            t.reward, t.valid = 0.0, False
            return
        t.valid, total = True, 0.0
        arguments = json.dumps(reward_input(task, t, diff_state=self._diff_state), default=str) if self.sources else ""
        for i, (spec, weight) in enumerate(self.terms):
            if not is_function(spec):
                total += weight * reward_of(t.verdict, spec)[0]
                continue
            value = await self._call(self.sources[spec], arguments, f"{t.trajectory_id}/reward/{i}", task)
            if isinstance(value, str):
                log.warning("reward function failed", trajectory=t.trajectory_id, task=task.task_id, error=value)
                t.reward, t.valid = 0.0, False
                t.verdict.status = common_pb2.VERDICT_STATUS_ERROR
                t.verdict.error_message = value
                return
            total += weight * value
        t.reward = total

    async def _call(self, source: RewardSource, arguments: str, request_id: str, task: Task) -> float | str:
        """The function's value, or the ERROR text (naming it) when it failed or no sandbox could run it."""
        request = sandbox_pb2.RewardRequest(
            request_id=request_id,
            source=source.source,
            function=source.function,
            origin=source.origin,
            input_json=arguments,
            limits=self._limits,
        )
        deadline = self._limits.timeout_seconds + DEADLINE_MARGIN_SECONDS
        reply = await self._on_sandbox(lambda stub: stub.Reward(request, timeout=deadline), task.task_id)
        if isinstance(reply, str):
            return f"{REWARD_ERROR_PREFIX}{source.origin}: no sandbox could run it: {reply}"
        if reply.verdict.status != common_pb2.VERDICT_STATUS_PASSED:
            message = reply.verdict.error_message
            if message.startswith(REWARD_ERROR_PREFIX):
                return message
            return f"{REWARD_ERROR_PREFIX}{source.origin}: {message}"
        return reply.reward
