"""The shipped tiny verifiers recipe, unchanged, learns: a verifiers environment's rubric is the reward.

This is `dockyard run examples/configs/tiny_verifiers.yaml` (the five services and the policy endpoint as
real processes, the sandbox on the docker backend) with only the output folders redirected, from the
recipe's own warm start (`dockyard prepare`, made once: tests/e2e/conftest.py, warm_policy). Each trial is
the example environment (examples/verifiers_env, on verifiers 0.4.0) in its session image, run by
dockyard's verifiers runner: the row's prompt through the openai client to the endpoint, the reply scored
by the environment's rubric; validation decodes greedily on 16 held-out rows.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD, MIN_GAIN, warm_policy

# The session image (built once: about 2 minutes), the warm start (made once) and 8 GRPO steps of 32
# container trials each, on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

CONFIG = "examples/configs/tiny_verifiers.yaml"


def test_the_tiny_verifiers_recipe_raises_the_validation_pass_rate(tmp_path: Path, verifiers_image: str) -> None:
    model = warm_policy(CONFIG)
    runs = tmp_path / "runs"
    result = subprocess.run(
        [str(DOCKYARD), "run", CONFIG, f"policy.model_name={model}", f"logger.log_dir={runs}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=2000,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "validation"]
    train = [r for r in records if r["kind"] == "train"]
    rates = [r["pass_rate"] for r in val]
    assert [r["step"] for r in val] == [0, 4, 8]
    assert max(rates[1:]) >= rates[0] + MIN_GAIN, f"validation pass rates {rates}"
    # The rubric's rewards, not errors: every trial ran and was scored.
    assert sum(r["invalid_trajectories"] for r in train) <= 0.05 * sum(r["num_trajectories"] for r in train)
    assert sum(r.get("scaffold_errors", 0) for r in train) == 0
    assert max(r["gen_train_logprob_abs_diff"] for r in train) < 1e-4  # the endpoint's tokens are the trained ones
