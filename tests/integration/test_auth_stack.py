"""The five services with a shared token: a job runs end to end, outsiders are refused.

Every service reads the token from one mounted-secret-style file; the
coordinator's calls to the trainer, rollout, buffer and sandbox, and the
trainer's and rollout's calls back to the buffer and coordinator, all carry it,
so a one-step tiny job reaches SUCCEEDED. A client without it is refused; the
CLI, given the same variable, reads the job.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2 as pb
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT, expect_code

pytestmark = pytest.mark.slow

TOKEN = "stack-token-0123456789"
TINY = [
    "policy.model_name=null",
    "policy.bootstrap=null",
    "grpo.max_num_steps=1",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.enabled=false",
]


def test_job_succeeds_with_token_and_outsiders_are_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {"DOCKYARD_AUTH_TOKEN_FILE": str(token_file)}
    stack = LocalStack(tmp_path / "logs", free_ports=True, extra_env=env)
    cfg = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", [*TINY, f"logger.log_dir={tmp_path}"])
    address = None

    async def drive() -> pb.Job:
        async with connect(address, auth=AuthSettings(auth_token="")) as outsider:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(outsider)
            await expect_code(stub.ListJobs(pb.ListJobsRequest()), grpc.StatusCode.UNAUTHENTICATED, "missing")
            request = pb.CreateJobRequest(config_yaml=cfg.resolved_yaml())
            await expect_code(stub.CreateJob(request), grpc.StatusCode.UNAUTHENTICATED, "missing")
        async with connect(address, auth=AuthSettings(auth_token_file=str(token_file))) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            job_id = (await stub.CreateJob(pb.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job.job_id
            deadline = time.monotonic() + 300
            while True:
                job = (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).job
                if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
                    return job
                assert time.monotonic() < deadline, f"job not finished within 300 s: {job}"
                await asyncio.sleep(0.5)

    stack.start()
    try:
        address = stack.address("coordinator")
        job = asyncio.run(drive())
        assert job.state == pb.JOB_STATE_SUCCEEDED, job.message
        assert job.step == 1

        def status(extra: dict[str, str]) -> subprocess.CompletedProcess:
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKYARD_AUTH", "DOCKYARD_TLS"))}
            command = [sys.executable, "-m", "dockyard.cli", "status", "--coordinator", address]
            return subprocess.run(command, capture_output=True, text=True, timeout=60, env={**clean, **extra})

        allowed = status(env)
        assert allowed.returncode == 0, allowed.stderr
        assert f"{job.job_id}  SUCCEEDED" in allowed.stdout
        refused = status({})
        assert refused.returncode != 0
        assert "UNAUTHENTICATED" in refused.stdout + refused.stderr or "missing credentials" in refused.stderr
    finally:
        # Clean exit codes are tests/integration/test_local_stack.py's concern.
        stack.stop()
    for log in (tmp_path / "logs").glob("*.log"):
        assert TOKEN not in log.read_text(errors="replace"), f"{log.name} shows the token"
