"""The tiny verifiers recipe runs end to end: a verifiers environment's rollouts are recorded, rewarded by
its rubric and trained on.

This is `dockyard run examples/configs/tiny_verifiers.yaml` (the five services and the policy endpoint as
real processes, the sandbox on the docker backend) cut to one GRPO step of one group, from a one-step
warm start (its answers are mostly wrong, which is fine: the test is that the loop runs, scores and
trains). Each trial is the example environment (examples/verifiers_env, on verifiers 0.4.0) in its
session image, run by dockyard's verifiers runner: the row's prompt through the openai client to the
endpoint, the reply scored by the environment's rubric. Whether the recipe learns is not asserted here:
docs/environments.md gives what it measured.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD

# The session image is built once (about 2 minutes: verifiers' 98 wheels) before the job, by the fixture.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CONFIG = "examples/configs/tiny_verifiers.yaml"
MAX_LOGPROB_MISMATCH = 1e-4  # the built-in scaffold's bound (tests/e2e/test_tiny_agent_learns.py)


def test_the_tiny_verifiers_recipe_trains_on_rollouts_its_rubric_scored(tmp_path: Path, verifiers_image: str) -> None:
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            str(DOCKYARD),
            "run",
            "--prepare",
            CONFIG,
            f"policy.model_name={tmp_path / 'model'}",
            "policy.bootstrap.steps=1",
            f"logger.log_dir={runs}",
            "grpo.max_num_steps=1",
            "grpo.num_prompts_per_step=1",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "data.train.size=4",
            "data.validation.size=1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1100,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [train] = [r for r in records if r["kind"] == "train"]
    # Every trial ran, was scored by the rubric (no scaffold or rubric error) and was trained on.
    assert train["num_trajectories"] == 4 and train["invalid_trajectories"] == 0, train
    assert train.get("scaffold_errors", 0) == 0
    assert 0.0 <= train["reward_mean"] <= 1.0
    # Token faithful: the trainer's recomputed logprobs match what the endpoint recorded.
    assert train["gen_train_logprob_abs_diff"] < MAX_LOGPROB_MISMATCH
