"""examples/configs/tiny_moe.yaml end to end: `dockyard run` of the Qwen3-MoE-shaped recipe takes GRPO steps.

A short warm start, then two sync-mode GRPO steps of 2 x 2 samples through every service (torch engine,
sandbox, buffer, trainer, weight sync), and the final checkpoint loads in transformers. Sync mode syncs the
trainer's weights before each generation, so the engine's logprobs and the trainer's recompute must agree to
float32 rounding at every step: the run's own `gen_train_logprob_abs_diff` says how far they are apart.
It runs twice, with routing recorded (replay off) and with routing replay on (the second reuses the first's
warm-started model): the engine's expert choices reach the trainer through Generate, the buffer and the
payload, and every step reports `routing_mismatch_fraction` (0 here: same weights, float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.integration.test_tiny_recipe import dockyard_run

pytestmark = pytest.mark.slow

SHORT = [
    "policy.bootstrap.steps=5",
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logger.plot=false",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """One warm-started model for both runs (the first run writes it, the second finds it there)."""
    return tmp_path_factory.mktemp("tiny-moe") / "model"


@pytest.mark.parametrize("routing", ["policy.record_routing=true", "policy.routing_replay=true"])
def test_the_tiny_moe_recipe_trains_end_to_end(tmp_path: Path, model_dir: Path, routing: str) -> None:
    runs, checkpoints = tmp_path / "runs", tmp_path / "checkpoints"
    overrides = [*SHORT, f"policy.model_name={model_dir}", f"logger.log_dir={runs}", routing]
    overrides.append(f"checkpointing.checkpoint_dir={checkpoints}")
    result = dockyard_run("examples/configs/tiny_moe.yaml", overrides)
    assert "SUCCEEDED" in result.stdout
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 2
    for step in steps:
        assert step["num_trajectories"] == 4 and step["invalid_trajectories"] == 0, step
        assert step["gen_train_logprob_abs_diff"] < 1e-4, step  # engine and trainer score the MoE alike
        assert step["routing_mismatch_fraction"] == 0.0, step  # recorded, and the trainer routes alike
    loaded = AutoModelForCausalLM.from_pretrained(checkpoints / "step-2")
    assert loaded.config.model_type == "qwen3_moe" and loaded.config.num_experts == 8
