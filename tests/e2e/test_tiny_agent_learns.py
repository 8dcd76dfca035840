"""The shipped tiny agent recipe, unchanged, learns: multi-turn trials through the policy endpoint.

This is `dockyard run examples/configs/tiny_agent.yaml` (GRPO across six real processes: the five services
and the policy endpoint) with only the output folders redirected, from the recipe's own warm start, which
`dockyard prepare` makes once (tests/e2e/conftest.py, warm_policy). Each trial is the
built-in scaffold calling the tool `f` in its own sandbox session through the `openai` client, and
submitting an expression; the trainer learns on the sampled tokens only.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD, MIN_GAIN, warm_policy

# A warm start (400 steps: about 3 min on 2 cores alone, up to three times that beside other workers' tests)
# and 6 GRPO steps with three validations: past the suite's 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# The warm-started policy answers the line under greedy decoding (pass rate 0 on the quadratic tasks) and
# reads the third point in about 40% of its samples; docs/agents.md#the-tiny-agent-recipe has the curve.
# Single-turn recipes measure the logprob mismatch near 1e-7 on CPU float32; multi-turn must be as close.
MAX_LOGPROB_MISMATCH = 1e-4


def test_tiny_agent_recipe_raises_the_validation_pass_rate(tmp_path: Path) -> None:
    model = warm_policy("examples/configs/tiny_agent.yaml")  # the recipe's own warm start, made once
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            str(DOCKYARD),
            "run",
            "--prepare",
            "examples/configs/tiny_agent.yaml",
            f"policy.model_name={model}",
            f"logger.log_dir={runs}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "validation"]
    train = [r for r in records if r["kind"] == "train"]
    # The pass rate rises by MIN_GAIN at a validation (the checkpoint kept as best), and the policy ends
    # above where it started.
    rates = [r["pass_rate"] for r in val]
    assert [r["step"] for r in val] == [0, 3, 6]
    assert max(rates[1:]) >= rates[0] + MIN_GAIN and rates[-1] > rates[0], f"validation pass rates {rates}"
    # Multi-turn for real: several model calls per trial, tool output in the context (masked).
    assert all(r["agent_turns_mean"] > 2.0 for r in train), [r["agent_turns_mean"] for r in train]
    assert all(0.2 < r["agent_masked_fraction"] < 0.95 for r in train)
    assert max(r["gen_train_logprob_abs_diff"] for r in train) < MAX_LOGPROB_MISMATCH
    # Infrastructure failures are masked, not trained on; on a healthy machine they are rare.
    assert sum(r["invalid_trajectories"] for r in train) <= 0.05 * sum(r["num_trajectories"] for r in train)
    # The passing trials are kept whole (logger.save_trials), and export-sft turns them into a chat dataset
    # whose every assistant turn renders with the run's own tokenizer after its context.
    trials = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    assert trials and all(t["reward"] > 0 for t in trials)
    assert all(any(m["role"] == "tool" for m in s["messages"]) for t in trials for s in t["segments"])
    out = tmp_path / "agent-sft.jsonl"
    exported = subprocess.run(
        [str(DOCKYARD), "export-sft", str(run_dir), str(out)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    from dockyard.config import PolicyConfig
    from dockyard.tasks.demonstrations import load_demonstrations

    pairs = load_demonstrations(out, PolicyConfig(model_name=str(model)))
    assert pairs and all(completion for _, completion in pairs)
