"""Tasks of env verifiers: rows of the environment's own task set, run and scored in the trial's session.

    data.<split> {size, seed} ──make_tasks──> `size` rows, a seeded order of 0..size-1, each a Task
        "verifiers-<split>-<row>" (its prompt a label for people: the environment builds the real one)
    Task ──runner_environment──> the runner's variables: DOCKYARD_VERIFIERS_ENV {"module", "args" (the
        split's load_environment arguments), "row"}, DOCKYARD_VERIFIERS_RESULT, DOCKYARD_VERIFIERS_RUNNER
        (dockyard/agents/verifiers_runner.py's source)
    the result file's text ──result_error──> why it is no reward (the rubric raised, gave none, or one
        outside [0, 1]), else ""   ──verdict──> PASSED iff the reward is 1, tests_passed / tests_total
        the reward as a fraction of REWARD_DENOMINATOR (env.reward pass_fraction: the reward itself)

Guarantees: the row a trial runs is the row its task names, whatever the split, and the runner takes it
modulo the number of rows the environment has; a result that is not the runner's JSON, or whose reward
is not a finite number in [0, 1], is never a reward: it is the trial's error (masked and counted as a
scaffold error by the agent worker).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from dockyard.api.common.v1 import common_pb2
from dockyard.config.verifiers import RESULT_FILE, VerifiersConfig
from dockyard.tasks.task import Task

REWARD_DENOMINATOR = 1_000_000  # a reward's resolution in tests_passed / tests_total
# The runner is data here, never imported: its source runs in the session, under the environment's interpreter.
RUNNER_SOURCE = (Path(__file__).resolve().parents[1] / "agents" / "verifiers_runner.py").read_text()
_PREFIX = "verifiers-"


def make_tasks(split: str, size: int, seed: int, module: str) -> list[Task]:
    """`size` rows of `split` in a seeded order; the environment's rows are looked up in the session."""
    rows = list(range(size))
    random.Random(f"verifiers:{split}:{seed}").shuffle(rows)
    return [Task(f"{_PREFIX}{split}-{row:06d}", f"{module} {split} row {row}", (), "") for row in rows]


def split_row(task_id: str) -> tuple[str, int]:
    """(split, row) of a task id make_tasks gave."""
    split, _, row = task_id.removeprefix(_PREFIX).rpartition("-")
    return split, int(row)


def runner_environment(config: VerifiersConfig, task: Task) -> dict[str, str]:
    split, row = split_row(task.task_id)
    spec = {"module": config.module, "args": config.load_args(split), "row": row}
    return {
        "DOCKYARD_VERIFIERS_ENV": json.dumps(spec),
        "DOCKYARD_VERIFIERS_RESULT": RESULT_FILE,
        "DOCKYARD_VERIFIERS_RUNNER": RUNNER_SOURCE,
    }


def _reward(result: str | None) -> float | str:
    """The result's reward, or why there is none."""
    if not result:
        return "the runner wrote no result"
    try:
        parsed = json.loads(result)
    except ValueError:
        return "the runner's result is not JSON"
    if not isinstance(parsed, dict):
        return "the runner's result is not a JSON object"
    if "error" in parsed:
        return str(parsed["error"])[-2000:]
    reward = parsed.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return f"the rubric's reward {reward!r} is not a finite number"
    if not 0.0 <= reward <= 1.0:
        return f"the rubric's reward {reward} is outside [0, 1]"
    return float(reward)


def result_error(result: str | None) -> str:
    """Why the runner's result is no reward ("" when it is one)."""
    reward = _reward(result)
    return reward if isinstance(reward, str) else ""


def verdict(result: str) -> common_pb2.Verdict:
    """The verdict of a result result_error accepted."""
    reward = _reward(result)
    if isinstance(reward, str):
        return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message=reward)
    passed = round(reward * REWARD_DENOMINATOR)
    status = common_pb2.VERDICT_STATUS_PASSED if passed == REWARD_DENOMINATOR else common_pb2.VERDICT_STATUS_FAILED
    return common_pb2.Verdict(status=status, tests_passed=passed, tests_total=REWARD_DENOMINATOR)
