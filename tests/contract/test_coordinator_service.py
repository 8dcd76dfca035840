"""CoordinatorService on a real server: job CRUD, state machine, refusals, fleet membership.

The rendezvous of a running job is checked in tests/integration/test_local_stack.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2 as pb
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.config import load_config_text
from dockyard.jobs import RUNNING
from dockyard.rpc.client import connect
from services.coordinator.jobs import JobRecord
from tests.conftest import dead_address, expect_code

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
    dead = dead_address()
    env = {f"DOCKYARD_COORDINATOR_{peer}_ADDRESS": dead for peer in ("TRAINER", "BUFFER")}
    env["DOCKYARD_COORDINATOR_FLEET_WAIT_TIMEOUT_SECONDS"] = "1"
    env["DOCKYARD_COORDINATOR_RECOVERY_TIMEOUT_SECONDS"] = "1"  # how long the dead trainer and buffer are waited for
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
        await expect_code(  # a reward function the coordinator cannot find: refused before the job exists
            stub.CreateJob(pb.CreateJobRequest(config_yaml=config + "env: {reward: 'no_such_rewards.py:score'}\n")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "reward function no_such_rewards.py:score: no file",
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
        dead = dead_address()
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


async def test_jobs_outlive_a_coordinator_restart(start_service, tmp_path: Path) -> None:
    """A second coordinator on the same store serves the first one's finished jobs as they were,
    and continues (here: fails, the peers being down) a job stored as RUNNING."""
    dead = dead_address()
    env = {f"DOCKYARD_COORDINATOR_{peer}_ADDRESS": dead for peer in ("TRAINER", "BUFFER")}
    env["DOCKYARD_COORDINATOR_FLEET_WAIT_TIMEOUT_SECONDS"] = "1"
    env["DOCKYARD_COORDINATOR_RECOVERY_TIMEOUT_SECONDS"] = "1"  # how long the dead trainer and buffer are waited for
    env["DOCKYARD_COORDINATOR_STATE_DIR"] = str(tmp_path / "state")
    config = CONFIG.replace("LOG_DIR", str(tmp_path / "runs"))
    first = start_service("coordinator", env)
    async with connect(first.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-a"))
        failed = await wait_finished(stub, "job-a")
        await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-b"))
        await wait_finished(stub, "job-b")
        listed = (await stub.ListJobs(pb.ListJobsRequest())).jobs
    assert failed.state == pb.JOB_STATE_FAILED
    first.proc.kill()  # no graceful stop: what is stored is all the next coordinator gets
    first.proc.wait()

    # job-b as if the coordinator had died while it ran.
    stored = tmp_path / "state" / "job-b" / "job.json"
    document = json.loads(stored.read_text())
    stored.write_text(json.dumps({**document, "state": "RUNNING", "message": "", "phase": "training", "step": 2}))

    second = start_service("coordinator", env)
    async with connect(second.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        again = (await stub.GetJob(pb.GetJobRequest(job_id="job-a"))).job
        for name in (
            "job_id",
            "state",
            "step",
            "max_steps",
            "phase",
            "message",
            "run_dir",
            "create_time",
            "update_time",
        ):
            assert getattr(again, name) == getattr(failed, name), name
        assert [j.job_id for j in (await stub.ListJobs(pb.ListJobsRequest())).jobs] == [j.job_id for j in listed]
        # The same create is still the same job; a finished job still refuses a cancel.
        retried = (await stub.CreateJob(pb.CreateJobRequest(config_yaml=config, job_id="job-a"))).job
        assert retried.create_time == failed.create_time and retried.state == pb.JOB_STATE_FAILED
        await expect_code(
            stub.CancelJob(pb.CancelJobRequest(job_id="job-a")), grpc.StatusCode.FAILED_PRECONDITION, "FAILED"
        )
        # The RUNNING job got a runner again: it fails where a fresh one would, with no fleet to run on.
        resumed = await wait_finished(stub, "job-b")
        assert resumed.state == pb.JOB_STATE_FAILED
        assert "no rollout member registered" in resumed.message
    assert second.stop() == 0
    assert json.loads(stored.read_text())["state"] == "FAILED"


class LoadPolicyHangs(grpc.GenericRpcHandler):
    """Every peer at once: the buffer's OpenJob succeeds, LoadPolicy never answers, anything else
    is NOT_FOUND at once (raw bytes in and out: b"" is an empty response message)."""

    def service(self, details):
        async def empty(request, context):
            return b""

        async def hang(request, context):
            await asyncio.sleep(3600)

        async def not_found(request, context):
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such job here")

        method = details.method.rsplit("/", 1)[-1]
        handler = {"OpenJob": empty, "LoadPolicy": hang}.get(method, not_found)
        return grpc.unary_unary_rpc_method_handler(handler)


async def test_a_recovered_job_gets_a_newer_side_group_and_can_be_cancelled(start_service, tmp_path: Path) -> None:
    peers = grpc.aio.server()
    peers.add_generic_rpc_handlers((LoadPolicyHangs(),))
    peer = f"127.0.0.1:{peers.add_insecure_port('127.0.0.1:0')}"
    await peers.start()
    env = {f"DOCKYARD_COORDINATOR_{p}_ADDRESS": peer for p in ("TRAINER", "BUFFER")}
    env["DOCKYARD_COORDINATOR_STATE_DIR"] = str(tmp_path / "state")
    config = load_config_text(CONFIG.replace("LOG_DIR", str(tmp_path / "runs")))
    record = JobRecord("job-r", config, config.resolved_yaml(), str(tmp_path / "runs" / "job-r"), state=RUNNING)
    record.touch(step=1, weight_version=1, sync_epoch=3)
    (tmp_path / "state" / "job-r").mkdir(parents=True)
    (tmp_path / "state" / "job-r" / "job.json").write_text(json.dumps(record.to_document()))
    try:
        coordinator = start_service("coordinator", env)
        async with connect(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            job = (await stub.GetJob(pb.GetJobRequest(job_id="job-r"))).job
            # A runner again: it waits for its fleet (none registers here).
            assert job.state == pb.JOB_STATE_RUNNING and job.phase == "waiting for rollout replicas", job
            group = await stub.GetWeightSyncGroup(pb.GetWeightSyncGroupRequest(job_id="job-r", member="trainer"))
            assert group.group.epoch == 4, "a recovered job's weight-sync group starts past every epoch it used"
            cancelled = (await stub.CancelJob(pb.CancelJobRequest(job_id="job-r"))).job
            assert cancelled.state == pb.JOB_STATE_CANCELLED
        assert coordinator.stop() == 0
    finally:
        await peers.stop(None)
    stored = json.loads((tmp_path / "state" / "job-r" / "job.json").read_text())
    assert stored["state"] == "CANCELLED" and stored["sync_epoch"] == 4


async def test_a_bad_dataset_is_refused_at_submit_naming_file_line_and_field(coordinator, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"prompt": "def f(): return 1", "tests": ["assert f() == 1"]}) + "\n")
    bad.write_text(good.read_text() + json.dumps({"question": "q"}) + "\n")
    data = "env: {name: program_synthesis}\ndata: {train: {source: humaneval, path: TRAIN}, "
    data += f"validation: {{source: humaneval, path: {good}}}}}\n"
    config = CONFIG.replace("LOG_DIR", str(tmp_path / "runs")) + data
    async with connect(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        await expect_code(
            stub.CreateJob(pb.CreateJobRequest(config_yaml=config.replace("TRAIN", str(bad)))),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{bad}:2: missing field tests (column 'tests'",
        )
        await expect_code(
            stub.CreateJob(pb.CreateJobRequest(config_yaml=config.replace("TRAIN", str(tmp_path / "none.jsonl")))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "none.jsonl does not exist",
        )
        assert not (await stub.ListJobs(pb.ListJobsRequest())).jobs  # nothing was created
