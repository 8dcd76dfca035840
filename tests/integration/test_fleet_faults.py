"""Kill tests of the fleet: real processes, SIGKILL during a run, the job still SUCCEEDS.

    coordinator ── trainer, buffer
                ├─ rollout-1, rollout-2   (register + heartbeat; groups routed per group)
                └─ sandbox-1, sandbox-2   (register + heartbeat; scoring spread by load)

- a rollout replica killed while it has a Generate in flight: the group is
  generated again on the other replica (counted) and the weight sync goes on
  without the dead one;
- a sandbox worker killed during a run: its calls are retried on the other
  worker (counted) and no verdict became an ERROR, let alone a zero;
- a replica that registers mid-job is loaded and synced before it generates:
  each of its generations carries the version the trainer held then;
- in asynchronous mode, a replica and a sandbox worker killed mid-run: the
  job succeeds and the books close.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2 as pb
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT
from tests.integration.books import assert_accounted

pytestmark = pytest.mark.slow

ENV = {
    "DOCKYARD_ROLLOUT_HEARTBEAT_SECONDS": "0.5",
    "DOCKYARD_SANDBOX_HEARTBEAT_SECONDS": "0.5",
    # Long enough that a killed member is found by a failing call, not by expiry first.
    "DOCKYARD_COORDINATOR_MEMBER_TIMEOUT_SECONDS": "20",
    "DOCKYARD_ROLLOUT_WEIGHT_SYNC_TIMEOUT_SECONDS": "20",
    "DOCKYARD_TRAINER_WEIGHT_SYNC_TIMEOUT_SECONDS": "20",
    "DOCKYARD_ROLLOUT_NUM_THREADS": "1",
    "DOCKYARD_TRAINER_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    stack = LocalStack(
        tmp_path_factory.mktemp("logs"), free_ports=True, extra_env=ENV, rollout_replicas=2, sandbox_workers=2
    )
    stack.start()
    yield stack
    stack.stop()


def ensure_running(stack: LocalStack, *names: str) -> None:
    for name in names:
        if stack.procs[name].poll() is not None:
            stack.restart(name)


async def members(stub) -> dict[str, pb.Member]:
    return {m.name: m for m in (await stub.ListMembers(pb.ListMembersRequest())).members}


async def wait_for(stub, predicate, what: str, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.is_correction=tis", "loss_fn.is_max=2"]


async def submit(stub, tmp_path: Path, steps: int, overrides: tuple[str, ...] = ()) -> str:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "policy.model_name=null",
            "policy.bootstrap=null",
            f"grpo.max_num_steps={steps}",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.generation.max_new_tokens=24",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "logger.plot=false",
            f"logger.log_dir={tmp_path}",
            *overrides,
        ],
    )
    # Both kinds of member have registered before the job starts.
    await wait_for(stub, lambda: alive_kinds(stub), "a rollout replica and a sandbox worker to register", timeout=60)
    return (await stub.CreateJob(pb.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job.job_id


async def alive_kinds(stub) -> bool:
    alive = {m.kind for m in (await members(stub)).values() if m.status == "ALIVE"}
    return {pb.MEMBER_KIND_ROLLOUT, pb.MEMBER_KIND_SANDBOX} <= alive


async def job_at(stub, job_id: str, step: int) -> pb.Job:
    async def check():
        job = (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).job
        assert job.state in (pb.JOB_STATE_PENDING, pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED), job.message
        return job if job.step >= step else None

    return await wait_for(stub, check, f"step {step}", timeout=120)


async def finished(stub, job_id: str) -> pb.Job:
    async def check():
        job = (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).job
        return job if job.state not in (pb.JOB_STATE_PENDING, pb.JOB_STATE_RUNNING) else None

    return await wait_for(stub, check, "the job to finish", timeout=120)


def records(job: pb.Job) -> list[dict]:
    return [json.loads(line) for line in (Path(job.run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_rollout_replica_killed_mid_generation_is_replaced(stack: LocalStack, tmp_path: Path) -> None:
    ensure_running(stack, "rollout-1", "rollout-2", "sandbox-1", "sandbox-2")

    async def drive() -> pb.Job:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            await wait_for(stub, lambda: both_alive(stub, "rollout"), "both replicas")
            job_id = await submit(stub, tmp_path, steps=5)
            await job_at(stub, job_id, 1)

            async def busy():
                return (await members(stub))["rollout-2"].in_flight > 0

            await wait_for(stub, busy, "a Generate in flight on rollout-2", every=0.02)
            stack.kill("rollout-2")
            return await finished(stub, job_id)

    job = asyncio.run(drive())
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.message
    metrics = records(job)
    train = [r for r in metrics if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert all(r["weight_version"] == r["step"] for r in train)
    assert sum(r["regenerated_groups"] for r in train) >= 1
    # Every group of every step was generated; a regenerated one carries attempt > 0 on rollout-1.
    generations = [r for r in metrics if r["kind"] == "generation"]
    assert sorted({r["group_id"] for r in generations}) == sorted(
        f"{job.job_id}/s{s}/g{g}" for s in range(1, 6) for g in range(4)
    )
    assert any(r["attempt"] > 0 and r["replica"] == "rollout-1" for r in generations)
    # After the kill the weight-sync group went on with rollout-1 alone.
    assert train[-1]["fleet_rollout_alive"] == 1.0
    # None trained twice, and every group put was trained, dropped as stale or left in the buffer.
    assert_accounted(Path(job.run_dir), max_age=0)


async def both_alive(stub, kind: str) -> bool:
    listed = await members(stub)
    return all(listed.get(f"{kind}-{i}") is not None and listed[f"{kind}-{i}"].status == "ALIVE" for i in (1, 2))


def test_a_sandbox_worker_killed_mid_run_is_retried_elsewhere(stack: LocalStack, tmp_path: Path) -> None:
    ensure_running(stack, "rollout-1", "sandbox-1", "sandbox-2")

    async def drive() -> pb.Job:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            await wait_for(stub, lambda: both_alive(stub, "sandbox"), "both sandbox workers")
            job_id = await submit(stub, tmp_path, steps=4)
            await job_at(stub, job_id, 1)
            stack.kill("sandbox-2")
            return await finished(stub, job_id)

    job = asyncio.run(drive())
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.message
    train = [r for r in records(job) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # Calls that reached the dead worker were scored by the live one: retried, and never an error.
    assert sum(r["sandbox_retries"] for r in train) >= 1
    assert sum(r.get("verdict_error", 0) for r in train) == 0
    assert sum(r["invalid_trajectories"] for r in train) == 0
    assert all(r["num_trajectories"] == 16 for r in train)
    assert "sandbox_sandbox-1_queued" in train[-1]
    assert_accounted(Path(job.run_dir), max_age=0)


def test_a_replica_that_registers_mid_job_gets_the_current_weights_first(stack: LocalStack, tmp_path: Path) -> None:
    ensure_running(stack, "rollout-1", "sandbox-1")
    if stack.procs["rollout-2"].poll() is None:
        stack.kill("rollout-2")

    async def drive() -> tuple[pb.Job, list[dict]]:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            # Long enough to outlast the replica's start; cancelled once it has worked two steps.
            job_id = await submit(stub, tmp_path, steps=1000)
            job = await job_at(stub, job_id, 2)
            await asyncio.to_thread(stack.restart, "rollout-2")

            async def worked():
                late = [r for r in records(job) if r["kind"] == "generation" and r["replica"] == "rollout-2"]
                return late if len({r["step"] for r in late}) >= 2 else None

            late = await wait_for(stub, worked, "two steps generated on the replica that joined", timeout=90)
            job = (await stub.CancelJob(pb.CancelJobRequest(job_id=job_id))).job
            return job, late

    job, late = asyncio.run(drive())
    assert job.state == pb.JOB_STATE_CANCELLED, job.message
    # Sync mode: step s generates with version s - 1, the trainer's version when the step began;
    # the replica that joined got work only once it held that version.
    assert all(r["weight_version"] == r["step"] - 1 for r in late), late
    assert min(r["step"] for r in late) >= 3
    train = {r["step"]: r for r in records(job) if r["kind"] == "train"}
    assert train[min(r["step"] for r in late)]["fleet_rollout_alive"] == 2.0


def test_an_async_job_goes_on_when_a_replica_and_a_sandbox_worker_die(stack: LocalStack, tmp_path: Path) -> None:
    async def drive(folder: Path) -> pb.Job:
        async with connect(stack.address("coordinator")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            await wait_for(stub, lambda: both_alive(stub, "rollout"), "both replicas")
            await wait_for(stub, lambda: both_alive(stub, "sandbox"), "both sandbox workers")
            job_id = await submit(stub, folder, steps=8, overrides=tuple(ASYNC))
            await job_at(stub, job_id, 1)

            # Aim the kills at a call in flight when one shows up; an async run can leave no moment where
            # both members are busy at once, so either suffices, and by step 3 the kills go in regardless.
            async def busy_or_late():
                listed = await members(stub)
                if listed["rollout-2"].in_flight > 0 or listed["sandbox-2"].in_flight > 0:
                    return True
                return (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).job.step >= 3

            await wait_for(stub, busy_or_late, "a call in flight on rollout-2 or sandbox-2", every=0.02)
            stack.kill("rollout-2")
            stack.kill("sandbox-2")
            return await finished(stub, job_id)

    # The kills race the calls they aim at (a call seen in flight can end before its process dies), so
    # this test asserts what must hold either way: the job succeeds and the books close. Regeneration and
    # sandbox retries of cut calls are asserted by the synchronous tests above.
    ensure_running(stack, "rollout-1", "rollout-2", "sandbox-1", "sandbox-2")
    job = asyncio.run(drive(tmp_path))
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.message
    train = [r for r in records(job) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert sum(r.get("verdict_error", 0) for r in train) == 0
    assert sum(r["failed_groups"] for r in train) == 0
    assert train[-1]["fleet_rollout_alive"] == 1.0 and train[-1]["fleet_sandbox_alive"] == 1.0
    assert_accounted(Path(job.run_dir), max_age=1)
