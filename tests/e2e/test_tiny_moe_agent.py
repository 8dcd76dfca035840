"""The tiny agent recipe with a Qwen3-MoE policy and routing replay: `dockyard run` end to end.

examples/configs/tiny_agent.yaml with its model made the tiny Qwen3-MoE shape, a short warm start (150
steps: enough for the policy to call the tool, so trials take several turns) and two sync-mode GRPO steps
of 2 x 2 trials (under 2 minutes on 2 idle cores). Each trial is the built-in scaffold calling the policy
endpoint, which asks the torch engine for routing (the job's config.yaml records it) and keeps each turn's rows; the
coordinator reads the trajectories with their routing, and the trainer replays it: every step reports
`routing_mismatch_fraction` (present only where the batch carried routing; 0 here: same weights, float32)
and the engine's and the trainer's logprobs agree to float32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_tiny_recipe import dockyard_run

pytestmark = pytest.mark.slow

MOE = [
    "policy.model.model_type=qwen3_moe",
    "+policy.model.moe_intermediate_size=64",
    "+policy.model.num_experts=8",
    "+policy.model.num_experts_per_tok=2",
    "+policy.model.head_dim=32",
]
SHORT = [
    "policy.bootstrap.steps=150",
    "policy.bootstrap.num_threads=1",
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.max_trajectory_age_steps=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logger.plot=false",
]


def test_a_moe_agent_job_replays_the_routing_its_trials_recorded_through_the_endpoint(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    overrides = [*MOE, *SHORT, f"policy.model_name={tmp_path / 'model'}", f"logger.log_dir={runs}"]
    overrides += [f"checkpointing.checkpoint_dir={tmp_path / 'checkpoints'}", "policy.routing_replay=true"]
    result = dockyard_run("examples/configs/tiny_agent.yaml", overrides)
    assert "SUCCEEDED" in result.stdout
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 2
    for step in steps:
        assert step["num_trajectories"] == 4 and step["invalid_trajectories"] == 0, step
        assert step["routing_mismatch_fraction"] == 0.0, step  # the batch carried the trials' routing
        assert step["gen_train_logprob_abs_diff"] < 1e-4, step
    assert max(step["agent_turns_max"] for step in steps) > 1  # multi-turn trials, through the endpoint
