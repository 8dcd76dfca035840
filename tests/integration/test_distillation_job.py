"""On-policy distillation as a real job: the consolidation config, a couple of steps on five services.

The student samples, the trainer scores its tokens with the teacher and reports the teacher KL;
a config that breaks an OPD launch rule is refused at CreateJob naming the field, and the
coordinator goes on serving.
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
from dockyard.config import load_config
from dockyard.models.load import load_policy
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT, expect_code

pytestmark = pytest.mark.slow
STEPS = 2


async def _run(address: str, config_yaml: str) -> coordinator_pb2.Job:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml))).job
        for _ in range(1200):
            job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id))).job
            if job.state not in (coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING):
                return job
            await asyncio.sleep(0.25)
        raise AssertionError(f"job {job.job_id} still {job.state} after 300 s")


async def _refused(address: str, config_yaml: str, *words: str) -> None:
    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        await expect_code(
            stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml)),
            grpc.StatusCode.INVALID_ARGUMENT,
            *words,
        )


def test_an_opd_job_trains_against_its_teacher_and_bad_ones_are_refused(tmp_path: Path) -> None:
    base = load_config(REPO_ROOT / "examples" / "configs" / "v4_consolidation.yaml")
    teacher, tokenizer = load_policy(base.policy.model_copy(update={"model_name": None, "seed": 5}))
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "v4_consolidation.yaml",
        [
            "policy.model_name=null",
            f"on_policy_distillation.teacher_model_by_agent_name.expr={tmp_path / 'teacher'}",
            f"grpo.max_num_steps={STEPS}",
            "grpo.num_prompts_per_step=4",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "logger.plot=false",
            f"logger.log_dir={tmp_path / 'runs'}",
        ],
    )
    stack = LocalStack(tmp_path / "logs", free_ports=True)
    stack.start()
    try:
        address = stack.address("coordinator")
        sync = yaml.safe_load(cfg.resolved_yaml())
        sync["grpo"]["async_grpo"]["enabled"] = False
        asyncio.run(_refused(address, yaml.safe_dump(sync), "grpo.async_grpo.enabled", "asynchronous path only"))
        job = asyncio.run(_run(address, cfg.resolved_yaml()))
        assert job.state == coordinator_pb2.JOB_STATE_SUCCEEDED, job.message
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes
    records = [json.loads(line) for line in (Path(job.run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # Two random models disagree: the student's tokens are far from likely under the teacher.
    assert all(math.isfinite(r["teacher_kl"]) and abs(r["teacher_kl"]) > 1e-3 for r in train)
