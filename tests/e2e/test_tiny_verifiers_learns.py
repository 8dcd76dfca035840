"""The shipped verifiers recipe, unchanged, learns: a verifiers environment runs and scores every trial.

This is `DOCKYARD_SANDBOX_BACKEND=docker dockyard run examples/configs/tiny_verifiers.yaml` (the five
services and the policy endpoint as real processes) with only the output folders redirected, from the
recipe's own warm start (made once by `dockyard prepare`, tests/e2e/conftest.py). Each trial is one
rollout of the example environment (examples/verifiers_env, on verifiers 0.4.0) in its session image,
run by dockyard's verifiers runner: the row's prompt through the openai client to the endpoint, the reply
scored by the environment's rubric, the rubric's reward trained on.

The warm-started policy writes the line through f(0) and f(1) under greedy decoding (2 of 8 points on
these quadratic rows, pass rate 0) and the curve through them in a share of its samples; those earn the
whole reward, so GRPO raises the greedy validation pass rate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import MIN_GAIN, run_recipe, warm_policy

CONFIG = "examples/configs/tiny_verifiers.yaml"
# The warm start and the GRPO run, each trial a container importing verifiers: past the suite's 600 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
# CPU float32 measures the gap between the endpoint's and the trainer's logprobs near 1e-7.
MAX_LOGPROB_MISMATCH = 1e-4


def test_the_tiny_verifiers_recipe_raises_the_validation_pass_rate(tmp_path: Path, verifiers_image: str) -> None:
    model = warm_policy(CONFIG)
    records = run_recipe(CONFIG, tmp_path, model, timeout=1800, env={"DOCKYARD_SANDBOX_BACKEND": "docker"})
    val = [r for r in records if r["kind"] == "validation"]
    train = [r for r in records if r["kind"] == "train"]
    keys = ("step", "reward_mean", "num_trajectories", "invalid_trajectories", "scaffold_errors")
    for r in train:  # the figures a run of the recipe is read by
        print({k: r.get(k) for k in (*keys, "gen_train_logprob_abs_diff")})
    rates = [r["pass_rate"] for r in val]
    print("validation", [(r["step"], r["pass_rate"], r["test_pass_fraction"]) for r in val])
    assert max(rates[1:]) >= rates[0] + MIN_GAIN, f"validation pass rates {rates}"
    # Every trial ran the environment to its rubric's score (no runner or rubric error, nothing masked)
    # and was trained on, its tokens under the job's sampling law.
    assert all(r["num_trajectories"] > 0 and r["invalid_trajectories"] == 0 for r in train), train
    assert all(r.get("scaffold_errors", 0) == 0 for r in train)
    assert max(r["gen_train_logprob_abs_diff"] for r in train) < MAX_LOGPROB_MISMATCH
