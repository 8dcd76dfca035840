"""A trainer and a buffer killed with SIGKILL mid-job and started again: the job goes on, nothing is lost.

Real processes (LocalStack), the tiny recipe on a random-init model, and the
books of the run checked afterwards (tests/integration/books.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT
from tests.integration.books import assert_accounted

pytestmark = pytest.mark.slow

TINY = [
    "policy.model_name=null",
    "policy.bootstrap=null",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "grpo.num_prompts_per_step=4",
    "checkpointing.save_period=1",
]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"]


def submit(stack: LocalStack, overrides: list[str]) -> str:
    cfg = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", TINY + overrides)

    async def create() -> str:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            return (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job.job_id

    return asyncio.run(create())


def wait_for(stack: LocalStack, job_id: str, done, timeout: float = 240.0) -> coordinator_pb2.Job:
    async def poll() -> coordinator_pb2.Job:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            deadline = time.monotonic() + timeout
            while True:
                job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id))).job
                if done(job) or job.state in (coordinator_pb2.JOB_STATE_FAILED, coordinator_pb2.JOB_STATE_CANCELLED):
                    return job
                assert time.monotonic() < deadline, f"job stuck at step {job.step}, phase {job.phase}"
                await asyncio.sleep(0.2)

    return asyncio.run(poll())


def succeeded(job: coordinator_pb2.Job) -> bool:
    return job.state == coordinator_pb2.JOB_STATE_SUCCEEDED


@pytest.fixture
def stack(tmp_path: Path):
    stack = LocalStack(tmp_path / "logs", free_ports=True)
    stack.start()
    yield stack
    stack.stop()


def test_async_job_survives_a_trainer_killed_and_restarted(stack: LocalStack, tmp_path: Path) -> None:
    job_id = submit(stack, ASYNC + ["grpo.max_num_steps=6", f"logger.log_dir={tmp_path}"])
    job = wait_for(stack, job_id, lambda j: j.step >= 2)
    assert job.state == coordinator_pb2.JOB_STATE_RUNNING, job.message
    stack.kill("trainer")
    stack.restart("trainer")
    job = wait_for(stack, job_id, succeeded)
    assert succeeded(job), job.message
    books = assert_accounted(tmp_path / job_id, max_age=1)
    recoveries = [r for r in books["records"] if r["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["run_number"] == 1
    # Steps after the checkpoint it resumed from are trained again, on new groups of run 1.
    steps = [line["step"] for line in books["ledger"]]
    assert steps[-1] == 6 and sorted(set(steps)) == list(range(1, 7))
    assert any("/r1/" in gid for line in books["ledger"] for gid in line["group_ids"])


@pytest.fixture
def redis_stack(tmp_path: Path, redis_server: str):
    redis.Redis.from_url(redis_server).flushdb()
    stack = LocalStack(
        tmp_path / "logs",
        free_ports=True,
        extra_env={"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": redis_server},
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_job_survives_the_redis_buffer_killed_and_restarted(redis_stack: LocalStack, tmp_path: Path, mode) -> None:
    overrides = (ASYNC if mode == "async" else []) + ["grpo.max_num_steps=5", f"logger.log_dir={tmp_path}"]
    job_id = submit(redis_stack, overrides)
    job = wait_for(redis_stack, job_id, lambda j: j.step >= 2)
    assert job.state == coordinator_pb2.JOB_STATE_RUNNING, job.message
    redis_stack.kill("buffer")
    time.sleep(2.0)  # calls fail meanwhile: puts, samples and acks wait it out
    redis_stack.restart("buffer")
    job = wait_for(redis_stack, job_id, succeeded)
    assert succeeded(job), job.message
    books = assert_accounted(tmp_path / job_id, max_age=0 if mode == "sync" else 1)
    assert [line["step"] for line in books["ledger"]] == [1, 2, 3, 4, 5]
