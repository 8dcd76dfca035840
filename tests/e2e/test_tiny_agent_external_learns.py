"""The shipped external-scaffold recipe, unchanged, learns: mini-swe-agent from PyPI runs every trial.

This is `DOCKYARD_SANDBOX_BACKEND=docker dockyard run examples/configs/tiny_agent_external.yaml` (the five
services and the policy endpoint as real processes) with only the output folders redirected, from the
recipe's own warm start (made once by `dockyard prepare`, tests/e2e/conftest.py). Each trial is mini,
unmodified, in its confined session container, calling the endpoint through litellm with its session
key; its answer is the text it left in answer.txt, and the trainer learns on the tokens it sampled.

The warm-started policy answers at once under greedy decoding (`x`, which earns nothing) and reads f(0)
first at temperature 1 in a share of its trials; those that read and copy the value earn the reward, so
GRPO raises the greedy validation pass rate.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD, MIN_GAIN, warm_policy

CONFIG = "examples/configs/tiny_agent_external.yaml"
# The warm start and the GRPO run, each trial a container running a Python agent: past the suite's 600 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
# CPU float32 measures the gap between the endpoint's and the trainer's logprobs near 1e-7.
MAX_LOGPROB_MISMATCH = 1e-4


def test_an_unchanged_mini_swe_agent_raises_the_validation_pass_rate(tmp_path: Path, scaffold_image) -> None:
    model = warm_policy(CONFIG)
    runs = tmp_path / "runs"
    result = subprocess.run(
        [str(DOCKYARD), "run", "--prepare", CONFIG, f"policy.model_name={model}", f"logger.log_dir={runs}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "DOCKYARD_SANDBOX_BACKEND": "docker"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "validation"]
    train = [r for r in records if r["kind"] == "train"]
    keys = ("step", "reward_mean", "agent_turns_mean", "agent_masked_fraction", "invalid_action_trajectories")
    for r in train:  # the figures a run of the recipe is read by
        print(json.dumps({k: r.get(k) for k in (*keys, "scaffold_errors", "gen_train_logprob_abs_diff")}))
    rates = [r["pass_rate"] for r in val]
    print("validation", [(r["step"], r["pass_rate"]) for r in val])
    assert max(rates[1:]) >= rates[0] + MIN_GAIN, f"validation pass rates {rates}"
    # mini ran every trial to its own end and was scored: no scaffold error, its turns recorded (the
    # tool outputs between them masked), its tokens trained under the job's sampling law.
    assert all(r.get("scaffold_errors", 0) == 0 for r in train), [r.get("scaffold_errors") for r in train]
    assert all(r["agent_turns_mean"] >= 1.0 for r in train)
    assert all(0.0 < r["agent_masked_fraction"] < 1.0 for r in train)
    assert max(r["gen_train_logprob_abs_diff"] for r in train) < MAX_LOGPROB_MISMATCH
