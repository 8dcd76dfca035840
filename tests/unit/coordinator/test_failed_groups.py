"""A group that fails in the sandbox says why: a reward function's error (its type and message, the
first failing trajectory) reaches the step's error (the job's message) and the group's groups.jsonl line;
and every passing single-turn completion is kept whole for trials.jsonl (what export-sft reads)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config
from services.coordinator.collector import Collector
from services.coordinator.fleet import Fleet
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.producer import GroupIds, SyncProducer
from services.coordinator.run_folder import RunFolder
from services.coordinator.task_stream import TaskStream, load_tasks
from tests.conftest import REPO_ROOT

TINY = REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml"
RAISED = "reward function mine.py:score: raised TypeError: unsupported operand type(s) for +: 'int' and 'str'"


class Unscorable:
    """Every group fails as the collector reports a reward function that always raises."""

    def __init__(self, folder: RunFolder) -> None:
        self.folder = folder

    async def make_group(self, task, group_id, seed):
        raise GroupUnscorable(
            f"group {group_id}: 4 of 4 trajectories failed ({RAISED})", first=f"{group_id}/0: {RAISED}"
        )

    def record_outcome(self, group_id, outcome, weight_version, error=""):
        self.folder.record_group(group_id, outcome, weight_version, error)


async def test_a_raising_reward_function_reaches_the_step_error_and_groups_jsonl(tmp_path: Path) -> None:
    config = load_config(TINY, ["grpo.num_prompts_per_step=2"])
    folder = RunFolder(tmp_path)
    ids = GroupIds("job", config.grpo.seed)
    producer = SyncProducer(Unscorable(folder), TaskStream(load_tasks(config, "train"), 0), ids, config.grpo)
    try:
        await producer.collect_step(1)
        raise AssertionError("the step should fail")
    except RuntimeError as exc:
        message = str(exc)
    assert "2 failed" in message and "raised TypeError" in message and "/0: reward function mine.py:score" in message
    lines = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [line["outcome"] for line in lines] == ["failed", "failed"]
    assert all(RAISED in line["error"] and line["error"].startswith(line["group_id"]) for line in lines)


async def test_every_passing_single_turn_completion_is_kept_for_trials_jsonl(tmp_path: Path) -> None:
    config = load_config(TINY, ["grpo.num_generations_per_prompt=4"])
    collector = Collector(
        "job",
        config,
        Fleet(60.0),
        SimpleNamespace(data_plane=None),  # a buffer without a data plane: the arrays come back
        routing=SimpleNamespace(required_version=3),
        max_generations=1,
        max_scoring=1,
        generate_timeout=10.0,
    )
    texts = ["x + 1", "x", "x + 1", "2 * x"]

    async def generate(task, n, sampling, request_id, seed=None, staging=None):
        completions = [rollout_pb2.Completion(text=t, token_ids=[1], logprobs=[-0.1]) for t in texts]
        return rollout_pb2.GenerateResponse(completions=completions, prompt_token_ids=[1], weight_version=3)

    async def score(task, text, request_id):
        passed = text == "x + 1"
        status = common_pb2.VERDICT_STATUS_PASSED if passed else common_pb2.VERDICT_STATUS_FAILED
        return common_pb2.Verdict(status=status, tests_passed=int(passed), tests_total=1)

    collector.generate, collector.score = generate, score
    task = load_tasks(config, "train")[0]
    await collector._make_group_once(task, "job/s1/g0", 0)
    kept = collector.take_trials()
    assert [(t["trajectory_id"], t["completion"], t["reward"]) for t in kept] == [
        ("job/s1/g0/0", "x + 1", 1.0),
        ("job/s1/g0/2", "x + 1", 1.0),
    ]
    assert all(t["prompt"] == task.prompt and t["weight_version"] == 3 for t in kept)
