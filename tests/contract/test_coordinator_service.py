"""CoordinatorService on a real server: job CRUD, state machine, refusals, fleet membership.

The rendezvous of a running job is checked in tests/integration/test_local_stack.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from dockyard.coordinator.v1 import coordinator_pb2 as pb
from dockyard.coordinator.v1 import coordinator_pb2_grpc
from dockyard.rpc.client import connect
from tests.conftest import expect_code, free_port

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32}
  train_global_batch_size: 4
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4, max_num_steps: 3}
logger: {log_dir: LOG_DIR}
"""


@pytest.fixture
def coordinator(start_service, tmp_path: Path):
    # Peers point at closed ports: every job fails fast and explains why.
    dead = f"127.0.0.1:{free_port()}"
    env = {f"DOCKYARD_COORDINATOR_{peer}_ADDRESS": dead for peer in ("TRAINER", "BUFFER")}
    env["DOCKYARD_COORDINATOR_FLEET_WAIT_TIMEOUT_SECONDS"] = "1"
    env["DOCKYARD_COORDINATOR_MEMBER_TIMEOUT_SECONDS"] = "60"
    return start_service("coordinator", env)


async def wait_finished(stub, job_id: str) -> pb.Job:
    for _ in range(100):
        job = (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).job
        if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


async def test_jobs_refusals_and_rendezvous(coordinator, tmp_path: Path) -> None:
    config = CONFIG.replace("LOG_DIR", str(tmp_path / "runs"))
    async with connect(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        await expect_code(
            stub.CreateJob(pb.CreateJobRequest(config_yaml="  ")), grpc.StatusCode.INVALID_ARGUMENT, "empty"
        )
        await expect_code(
            stub.CreateJob(pb.CreateJobRequest(config_yaml=config.replace("max_num_steps: 3", "max_num_steps: 0"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "grpo.max_num_steps",
        )
        await expect_code(
            stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="Bad Id!")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job_id",
        )
        await expect_code(stub.GetJob(pb.GetJobRequest(job_id="nope")), grpc.StatusCode.NOT_FOUND, "nope")
        await expect_code(stub.GetJob(pb.GetJobRequest()), grpc.StatusCode.INVALID_ARGUMENT)

        # No rollout replica has registered: the job waits, then fails saying what is missing.
        await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-0"))
        lonely = await wait_finished(stub, "job-0")
        assert lonely.state == pb.JOB_STATE_FAILED
        assert (
            "waiting for rollout replicas" in lonely.message
            and "DOCKYARD_ROLLOUT_COORDINATOR_ADDRESS" in lonely.message
        )
        dead = f"127.0.0.1:{free_port()}"
        for kind, name in ((pb.MEMBER_KIND_ROLLOUT, "rollout"), (pb.MEMBER_KIND_SANDBOX, "sandbox")):
            await stub.RegisterMember(pb.RegisterMemberRequest(kind=kind, name=name, address=dead))

        created = (await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-a"))).job
        assert created.job_id == "job-a" and created.max_steps == 3
        assert (tmp_path / "runs" / "job-a" / "config.yaml").is_file()
        # A retried create is the same job; the same id with another config is refused.
        again = (await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-a"))).job
        assert again.create_time == created.create_time
        await expect_code(
            stub.CreateJob(
                pb.CreateJobRequest(config_yaml=config.replace("max_num_steps: 3", "max_num_steps: 4"), job_id="job-a")
            ),
            grpc.StatusCode.ALREADY_EXISTS,
        )

        await expect_code(
            stub.GetWeightSyncGroup(pb.GetWeightSyncGroupRequest(job_id="job-a", member="sandbox")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "member",
        )
        await expect_code(
            stub.GetWeightSyncGroup(pb.GetWeightSyncGroupRequest(job_id="nope", member="trainer")),
            grpc.StatusCode.NOT_FOUND,
        )

        # The trainer is unreachable: the job fails and says where and why.
        job = await wait_finished(stub, "job-a")
        assert job.state == pb.JOB_STATE_FAILED
        assert "loading policy" in job.message and "UNAVAILABLE" in job.message
        services = {s.name: s.status for s in job.services}
        assert services["trainer"] == "UNREACHABLE"
        # Registered members are listed with the fixed services.
        assert services["rollout"] in ("ALIVE", "FAILED") and services["sandbox"] == "ALIVE"
        await expect_code(
            stub.CancelJob(pb.CancelJobRequest(job_id="job-a")), grpc.StatusCode.FAILED_PRECONDITION, "FAILED"
        )
        await expect_code(
            stub.GetWeightSyncGroup(pb.GetWeightSyncGroupRequest(job_id="job-a", member="trainer")),
            grpc.StatusCode.FAILED_PRECONDITION,
        )

        second = (await stub.CreateJob(pb.CreateJobRequest(config_yaml=config))).job
        listed = (await stub.ListJobs(pb.ListJobsRequest())).jobs
        assert [j.job_id for j in listed] == [second.job_id, "job-a", "job-0"]
    assert coordinator.stop() == 0


async def test_members_register_heartbeat_and_leave(coordinator) -> None:
    address = "127.0.0.1:1"
    async with connect(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for request, word in (
            (pb.RegisterMemberRequest(name="rollout", address=address), "kind"),
            (pb.RegisterMemberRequest(kind=pb.MEMBER_KIND_ROLLOUT, name="sandbox-1", address=address), "name"),
            (pb.RegisterMemberRequest(kind=pb.MEMBER_KIND_SANDBOX, name="sandbox-1", address="nowhere"), "address"),
        ):
            await expect_code(stub.RegisterMember(request), grpc.StatusCode.INVALID_ARGUMENT, word)
        await expect_code(stub.Heartbeat(pb.HeartbeatRequest(name="rollout-x")), grpc.StatusCode.NOT_FOUND, "register")
        await expect_code(
            stub.Heartbeat(pb.HeartbeatRequest(name="rollout-x", load=-1)), grpc.StatusCode.INVALID_ARGUMENT, "load"
        )

        await stub.RegisterMember(
            pb.RegisterMemberRequest(kind=pb.MEMBER_KIND_SANDBOX, name="sandbox-2", address=address)
        )
        await stub.RegisterMember(
            pb.RegisterMemberRequest(kind=pb.MEMBER_KIND_ROLLOUT, name="rollout-1", address=address)
        )
        await stub.Heartbeat(pb.HeartbeatRequest(name="sandbox-2", load=5, running=2, queued=3))
        members = (await stub.ListMembers(pb.ListMembersRequest())).members
        assert [(m.name, m.kind, m.status) for m in members] == [
            ("rollout-1", pb.MEMBER_KIND_ROLLOUT, "ALIVE"),
            ("sandbox-2", pb.MEMBER_KIND_SANDBOX, "ALIVE"),
        ]
        assert members[1].load == 5 and members[1].address == address

        await stub.UnregisterMember(pb.UnregisterMemberRequest(name="sandbox-2"))
        await expect_code(
            stub.UnregisterMember(pb.UnregisterMemberRequest(name="sandbox-2")), grpc.StatusCode.NOT_FOUND
        )
        await expect_code(stub.Heartbeat(pb.HeartbeatRequest(name="sandbox-2")), grpc.StatusCode.NOT_FOUND)
        assert [m.name for m in (await stub.ListMembers(pb.ListMembersRequest())).members] == ["rollout-1"]
