"""mini-swe-agent from PyPI, unchanged, runs the trials of a job and the trainer trains on them.

This is `dockyard run examples/configs/tiny_agent_external.yaml` (the five services and the policy
endpoint as real processes, the sandbox on the docker backend) cut to one GRPO step of one group:
each trial is mini-swe-agent (its `mini` command, configured by its own flags and variables) in the
trial's session container, whose only route is the endpoint; litellm's calls carry the endpoint
session's key, so the endpoint records them in the trial's session; the trial is scored, and its
tokens (sampled ones with loss mask 1) reach the buffer and the trainer. The tiny warm start (one
step) writes nonsense, which is fine: the test is that the loop runs, scores and trains.

The job samples at temperature 0.8 while mini asks litellm for 0.3 (`model.model_kwargs.temperature`):
the job's sampling settings are authoritative, so the endpoint samples at 0.8 and the trainer's
recomputed logprobs (at 0.8) match the recorded ones as closely as the built-in scaffold's do. With
the client's temperature honoured, the mismatch is orders of magnitude larger.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from dockyard.tasks.expr import external_agent_prompt
from tests.conftest import REPO_ROOT
from tests.e2e.conftest import DOCKYARD

# The scaffold's environment image is built on first use (pip install into the sandbox image) before the job.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"
JOB_TEMPERATURE = 0.8
CLIENT_TEMPERATURE = 0.3
# The built-in scaffold's bound (tests/e2e/test_tiny_agent_learns.py): CPU float32 measures about 1e-7.
MAX_LOGPROB_MISMATCH = 1e-4


def client_temperature_config(folder: Path) -> Path:
    """The recipe with the job at JOB_TEMPERATURE and mini sending CLIENT_TEMPERATURE with every call."""
    config = yaml.safe_load(CONFIG.read_text())
    config["policy"]["generation"]["temperature"] = JOB_TEMPERATURE
    scaffold = config["env"]["scaffold"]
    scaffold["command"] += f' -c "model.model_kwargs.temperature={CLIENT_TEMPERATURE}"'
    path = folder / CONFIG.name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_an_unchanged_pypi_scaffold_runs_trials_that_are_scored_and_trained(tmp_path: Path, scaffold_image) -> None:
    runs = tmp_path / "runs"
    seconds = 300  # a Python agent starting on a busy 2-core machine (litellm's import alone takes seconds)
    result = subprocess.run(
        [
            str(DOCKYARD),
            "run",
            "--prepare",
            str(client_temperature_config(tmp_path)),
            f"policy.model_name={tmp_path / 'model'}",
            "policy.bootstrap.steps=1",
            f"logger.log_dir={runs}",
            "grpo.max_num_steps=1",
            "grpo.num_prompts_per_step=1",
            "grpo.num_generations_per_prompt=2",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "grpo.max_rollout_turns=2",
            f"grpo.max_trial_seconds={seconds}",
            f"env.sandbox.timeout_seconds={seconds}",
            f"env.sandbox.cpu_seconds={seconds}",
            "data.train.size=4",
            "data.validation.size=1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "DOCKYARD_SANDBOX_BACKEND": "docker"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [train] = [r for r in records if r["kind"] == "train"]
    print(
        json.dumps({k: v for k, v in train.items() if k.startswith(("agent_", "num_", "invalid", "loss", "gen_train"))})
    )
    # Both trials ran mini-swe-agent to an end of its own (or the time limit), and were scored.
    assert train["agent_trials"] == 2, train
    assert sum(v for k, v in train.items() if k.startswith("agent_finish_")) == 2, train
    # The endpoint recorded mini's calls in each trial's session: turns, and context tokens (masked)
    # between the sampled ones; the trainer trained on those trials.
    assert train["agent_turns_mean"] >= 1.0, train
    assert 0.0 < train["agent_masked_fraction"] < 1.0, train
    assert train["num_trajectories"] - train["invalid_trajectories"] >= 1, train
    assert train["num_segments"] >= 1, train
    # What mini was told (DOCKYARD_TASK) names what it has (f.py, its shell) and where its answer goes,
    # never a built-in tool.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["prompt"] for s in samples} == {external_agent_prompt("answer.txt")}, samples
    # The client's temperature did not change the sampling law the trainer assumes.
    assert train["gen_train_logprob_abs_diff"] < MAX_LOGPROB_MISMATCH, train
