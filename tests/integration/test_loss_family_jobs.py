"""Every loss_fn.name and advantage estimator runs as a real job: the tiny recipe, a few steps each, one stack.

The tiny recipe (examples/configs/tiny_expr.yaml) without its `loss_fn` and `grpo.advantage` lines, so
each preset fills its own knobs, on a briefly warm-started model; two minibatches a step, so the second
is off-policy and the clip or gate acts (REINFORCE++ with the KL in its reward). Each job must succeed,
and its per-step gate and ratio statistics must reach the run's metrics.jsonl (the tracker every run
writes). One job runs asynchronously (GSPO-token with an IS correction), and DAPO, whose dynamic
sampling async mode refuses, is refused at CreateJob naming the field.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import grpc
import pytest
import yaml

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.cli.prepare import prepare
from dockyard.config import load_config_text
from dockyard.config.choices import ADV_ESTIMATORS, LOSS_NAMES
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT, expect_code

pytestmark = pytest.mark.slow
STEPS = 2
SHORT = [
    f"grpo.max_num_steps={STEPS}",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=4",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.enabled=false",
    "logger.plot=false",
]
CHOICES = [[f"loss_fn.name={name}"] for name in LOSS_NAMES]
CHOICES += [[f"grpo.adv_estimator.name={name}"] for name in ADV_ESTIMATORS if name not in ("grpo", "opd")]
CHOICES[CHOICES.index(["grpo.adv_estimator.name=reinforce++"])].append("grpo.adv_estimator.kl_in_reward=0.1")
ASYNC = ["loss_fn.name=gspo-token", "grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"]


def recipe_without_loss_knobs() -> str:
    """The tiny recipe's YAML less the knobs a preset fills (they equal the GRPO defaults there)."""
    data = yaml.safe_load((REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml").read_text())
    del data["loss_fn"], data["grpo"]["advantage"]
    return yaml.safe_dump(data)


async def _run(address: str, config_yaml: str) -> coordinator_pb2.Job:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml))).job
        for _ in range(2400):
            job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id))).job
            if job.state not in (coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING):
                return job
            await asyncio.sleep(0.25)
        raise AssertionError(f"job {job.job_id} still {job.state} after 600 s")


async def _refused(address: str, config_yaml: str, *words: str) -> None:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        request = coordinator_pb2.CreateJobRequest(config_yaml=config_yaml)
        await expect_code(stub.CreateJob(request), grpc.StatusCode.INVALID_ARGUMENT, *words)


# Eleven jobs on one stack: about 130 s alone, up to 400 s beside a loaded suite's other workers.
@pytest.mark.timeout(900)
def test_every_choice_trains_a_few_steps_and_reports_its_statistics(tmp_path: Path) -> None:
    text = recipe_without_loss_knobs()
    base = [*SHORT, f"policy.model_name={tmp_path / 'model'}", "policy.bootstrap.steps=100"]
    base.append(f"logger.log_dir={tmp_path / 'runs'}")
    prepare(load_config_text(text, base))  # a short warm start, so rewards differ within groups
    stack = LocalStack(tmp_path / "logs", free_ports=True)
    stack.start()
    jobs = {}
    try:
        address = stack.address("coordinator")
        dapo_async = yaml.safe_load(load_config_text(text, [*base, "loss_fn.name=dapo"]).resolved_yaml())
        dapo_async["grpo"]["async_grpo"]["enabled"] = True
        dapo_async["loss_fn"]["is_correction"] = "plain"
        asyncio.run(_refused(address, yaml.safe_dump(dapo_async), "loss_fn.name", "dapo"))
        for choice in [*CHOICES, ASYNC]:
            job = asyncio.run(_run(address, load_config_text(text, [*base, *choice]).resolved_yaml()))
            assert job.state == coordinator_pb2.JOB_STATE_SUCCEEDED, f"{choice}: {job.message}"
            jobs[" ".join(choice)] = Path(job.run_dir)
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes
    for choice, run_dir in jobs.items():
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, STEPS + 1)), choice
        for r in train:
            assert math.isfinite(r["loss"]) and 0 <= r["gate_mean"] <= 1, choice
            assert 0 < r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"], choice
