"""`dockyard run` with trainer and rollout colocated: the tiny recipe's weights move through shared memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_tiny_recipe import SHORT, alive_services, dockyard_run

pytestmark = pytest.mark.slow


def test_the_tiny_recipe_runs_with_the_colocated_transport(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    overrides = [
        *SHORT,
        "policy.bootstrap.steps=1",  # what is trained does not matter here, only that weights move
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.plot=false",
        "cluster.weight_sync_transport=colocated",
        "cluster.weight_sync_bucket_mb=1",  # the tiny model's embedding spans buckets: both are reused
        f"policy.model_name={tmp_path / 'model'}",
        f"logger.log_dir={runs}",
    ]
    result = dockyard_run("examples/configs/tiny_expr.yaml", overrides)
    assert "SUCCEEDED" in result.stdout
    [run_dir] = [p for p in runs.iterdir() if p.name != "logs"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # Each step's rollouts came from the weights of the step before (sync mode, on-policy), each
    # synced with its checksum compared by the coordinator.
    assert [(r["step"], r["weight_version"]) for r in train] == [(1, 1), (2, 2)]
    logs = "".join(p.read_text() for p in runs.glob("logs/*/rollout.log"))
    assert logs.count("weights received") >= 2
    assert alive_services(runs / "logs") == []
