"""CPU smoke of examples/configs/grpo_terminal_bench.yaml: the loop runs, scores with the tasks' tests, trains.

    dockyard run grpo_terminal_bench.yaml (tiny random-init model, torch engine, gloo, docker sandbox)
      ──> 2 groups x 2 trials: the agent acts in the task's container, then its tests run there
      ──> rewards from the pytest summaries (pass_fraction) ──> one GRPO step ──> SUCCEEDED

The shipped task json-port is the task set: untouched, it passes 1 of its 3 tests, so a mean reward
of 1/3 says the verdicts are the tests' own (the tiny random model's replies carry no tool call:
each trial is one turn, which leaves the task as it was).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "terminal"
TINY = [
    "+policy.model.model_type=llama",
    "+policy.model.hidden_size=64",
    "+policy.model.intermediate_size=128",
    "+policy.model.num_hidden_layers=1",
    "+policy.model.num_attention_heads=2",
    "+policy.model.num_key_value_heads=2",
    "+policy.model.max_position_embeddings=2048",
    "+policy.model.tie_word_embeddings=true",
    # The tiny agent recipe writes the model folder (character tokenizer, its chat template): one step.
    "+policy.bootstrap.recipe=tiny_agent",
    "+policy.bootstrap.steps=1",
    "+policy.bootstrap.batch_size=2",
    "policy.dtype=float32",
    "policy.generation.backend=torch",
    "policy.generation.max_new_tokens=24",
    "policy.train_micro_batch_size=4",
    "cluster.device=cpu",
    "cluster.weight_sync_backend=gloo",
    "env.reward=pass_fraction",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.max_num_steps=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.max_rollout_turns=2",
    "grpo.max_trial_tokens=1500",
    "grpo.max_concurrent_trials=4",
    "checkpointing.enabled=false",
    "logger.plot=false",
]


def test_grpo_terminal_bench_runs_scores_and_trains_on_cpu(docker_sandbox_image, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks" / "smoke"
    shutil.copytree(SHIPPED / "json-port", tasks / "json-port")
    runs = tmp_path / "runs"
    overrides = [
        *TINY,
        f"policy.model_name={tmp_path / 'model'}",
        f"data.train.path={tasks}",
        f"data.validation.path={tasks}",
        f"logger.log_dir={runs}",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dockyard.cli",
            "run",
            "--prepare",
            "examples/configs/grpo_terminal_bench.yaml",
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0 and "SUCCEEDED" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    [train] = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert train["num_trajectories"] == 4 and train["valid_fraction"] == 1.0, train
    assert train["reward_mean"] == pytest.approx(1 / 3), train
    assert train["weight_version"] == 1 and train["num_tokens"] > 0, train
