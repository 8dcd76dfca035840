"""mini-swe-agent from PyPI, unchanged, learns: the external recipe raises its greedy validation pass rate.

This is `dockyard run examples/configs/tiny_agent_external.yaml` (the five services and the policy
endpoint as real processes, each trial mini-swe-agent 2.4.6 in its confined docker session) with only
the output folders redirected, from the recipe's own warm start (made once per code and config:
tests/e2e/conftest.py, warm_policy), which demonstrates mini's own action format
(dockyard/recipes/mini_format.py). Validation sessions are opened greedy by the coordinator (mini
holds only its session key), so a policy that did not learn validates exactly as it started.

Measured on the 2-core machine (shared with another session's tests, load 2-7), 2026-12-05. Pass
rates are greedy, on the 8 validation tasks (3 linear, 5 quadratic); "offline" is mini's loop run
greedily in-process (the same chat template and f.py outputs, no containers) on 16 tasks.

    warm start (seed 0, batch 16)   time    greedy validation at step 0    GRPO (seed, lr, steps): pass rates, time
    100 steps, 2 threads            339 s   0.000 (run)                    stopped: format not learned (offline)
    160 steps, 2 threads            208 s   0.000 (run)                    0, 1e-3, 1: stopped after step 1 (122 s)
    320 steps, 1 thread             354 s   0.000 (offline, 0/16)          not run
    600 steps, 1 thread             554 s   0.000 (run; offline 0/16)      0, 1e-3, 4: 0.000 -> 0.000, 244 s
                                                                           0, 2e-4, 8: 0.000 -> 0.000 -> 0.000, 503 s
                                                                           1, 2e-4, 4: 0.000 -> 0.000, 378 s

The 600-step warm start writes mini's format exactly (every offline trial submits: reads f(0) and
f(1), then `echo <expr> > answer.txt && <submit>`) and copies f(0) as the intercept, but its slope
does not yet follow the values read, so greedy validation starts at 0; at temperature 1 it passes
0 of 8 too, and GRPO sees only partial credit (pass_fraction, reward mean 0.06-0.19 a step). With
lr 1e-3 the policy loses the format within three steps (invalid-action trials 0, 7, 8, 8 of 8;
masked fraction 0.40 -> 0.91); with 2e-4 it keeps it (turns per trial 3.0-3.6, masked fraction
0.40-0.47, invalid-action trials 0-3 of 8, scaffold errors 0). The built-in recipe's warm start
needs 800 steps of batch 32 for its 0.27. The whole test (warm start 554 s plus 503 s of GRPO) takes
about 18 minutes here, past the 8 minutes it has, and does not yet show the gain: it asserts
MIN_GAIN (0.15) as the issue asks and fails until the warm start passes some validation tasks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.conftest import MIN_GAIN, run_recipe, warm_policy

# The warm start and the run: the suite's 600 s default is too short on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIG = "examples/configs/tiny_agent_external.yaml"
# What issue 37's note reports per step, each read from the run's metrics.jsonl.
PER_STEP = ("agent_turns_mean", "agent_masked_fraction", "invalid_action_trajectories", "scaffold_errors")


def test_the_external_recipe_raises_the_greedy_validation_pass_rate(tmp_path: Path, scaffold_image: str) -> None:
    started = time.monotonic()
    model = warm_policy(CONFIG)  # the recipe's own warm start, made once
    records = run_recipe(CONFIG, tmp_path, model, timeout=1500, env={"DOCKYARD_SANDBOX_BACKEND": "docker"})
    val = [r for r in records if r["kind"] == "validation"]
    train = [r for r in records if r["kind"] == "train"]
    rates = [r["pass_rate"] for r in val]
    print(f"validation pass rates {[(r['step'], r['pass_rate']) for r in val]}; {time.monotonic() - started:.0f} s")
    for r in train:
        print(f"step {r['step']}: " + ", ".join(f"{k} {r[k]:.3f}" for k in (*PER_STEP, "reward_mean") if k in r))
    # The note's figures are in the run's metrics for every step.
    assert train and all(all(k in r for k in PER_STEP) for r in train), [sorted(r) for r in train]
    # mini ran its own loop: several calls a trial, its observations in the context (masked), and its
    # trials were its own (a scaffold error is masked: rare on a healthy machine).
    assert all(r["agent_turns_mean"] >= 3.0 for r in train), [r["agent_turns_mean"] for r in train]
    assert all(0.2 < r["agent_masked_fraction"] < 0.95 for r in train)
    assert sum(r["scaffold_errors"] for r in train) <= 0.1 * sum(r["agent_trials"] for r in train)
    # Learning: a validation after step 0 gains MIN_GAIN, and the policy ends above where it started.
    assert val[0]["step"] == 0 and len(val) >= 2
    assert max(rates[1:]) >= rates[0] + MIN_GAIN and rates[-1] > rates[0], f"validation pass rates {rates}"
