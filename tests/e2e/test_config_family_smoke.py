"""The shipped configs written for one CPU machine run a smoke step: `dockyard run` of the file as shipped,
one GRPO step of 2 x 2 samples after a short warm start, scored by the sandbox (no ERROR verdict).

The GPU recipes of the family are checked by preflight only (tests/unit/test_config_family.py); the tiny
recipes have their own learning tests (tests/e2e/test_tiny_recipe_learns.py, test_tiny_agent_learns.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_tiny_recipe import dockyard_run

pytestmark = pytest.mark.slow

SMOKE = [
    "policy.bootstrap.steps=5",
    "grpo.max_num_steps=1",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logger.plot=false",
    "checkpointing.enabled=false",
]


@pytest.mark.parametrize("name", ["grpo_hle", "grpo_gdpval"])
def test_a_cpu_config_of_the_family_runs_a_step(tmp_path: Path, name: str) -> None:
    runs = tmp_path / "runs"
    overrides = [*SMOKE, f"policy.model_name={tmp_path / 'model'}", f"logger.log_dir={runs}"]
    result = dockyard_run(f"examples/configs/{name}.yaml", overrides)
    assert "SUCCEEDED" in result.stdout
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in records if r["kind"] == "train"]
    assert step["num_trajectories"] == 4 and step["invalid_trajectories"] == 0, step
