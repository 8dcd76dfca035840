"""The coordinator dies (SIGKILL) in the middle of a run and is started again on its job store.

Five real processes run the tiny recipe; once the job has taken a step, the
coordinator is killed and restarted on the same port and store: the run
folder with a synchronous job killed while the trainer runs a step (its reply
is lost), Redis with an asynchronous job killed while it waits for groups
(the producer's groups partly in the buffer). The job is served again at
once, continues at the trainer's step and reaches SUCCEEDED; the trainer's
ledger holds every step 1..N once and no group or trajectory twice, the
run's books balance (`assert_accounted`), the metrics hold no step twice, and
the weight-sync group of the recovered job lies past every epoch it used before.
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
from services.coordinator.store import REDIS_KEY
from tests.conftest import REPO_ROOT
from tests.integration.books import assert_accounted
from tests.integration.test_restarts import ASYNC

pytestmark = pytest.mark.slow

STEPS = 3
FINISHED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


def tiny_config(log_dir: Path, extra: list[str]) -> str:
    cfg = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "policy.model_name=null",
            "policy.bootstrap=null",
            f"grpo.max_num_steps={STEPS}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "logger.plot=false",
            f"logger.log_dir={log_dir}",
            *extra,
        ],
    )
    return cfg.resolved_yaml()


async def call(stack: LocalStack, method: str, request):
    async with connect(stack.address("coordinator")) as channel:
        return await getattr(coordinator_pb2_grpc.CoordinatorServiceStub(channel), method)(request)


async def wait_for(stack: LocalStack, job_id: str, done, what: str, timeout: float = 120.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = (await call(stack, "GetJob", pb.GetJobRequest(job_id=job_id))).job
        if done(job):
            return job
        assert job.state not in FINISHED, f"job ended {pb.JobState.Name(job.state)} before {what}: {job.message}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s: {job}"
        await asyncio.sleep(0.05)


def trained_steps(trainer_log: Path, job_id: str) -> list[int]:
    steps = []
    for line in trainer_log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step done" and event.get("job_id") == job_id:
            steps.append(event["step"])
    return steps


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """One stack for both stores: each test restarts its coordinator on its own store."""
    stack = LocalStack(tmp_path_factory.mktemp("restart-logs"), free_ports=True)
    stack.start()
    yield stack
    # A generous grace: on a loaded 2-core machine torch services can take many seconds to exit.
    codes = stack.stop(grace=60)
    assert all(code == 0 for code in codes.values()), codes


def store_of(backend: str, request: pytest.FixtureRequest, tmp_path: Path):
    """(coordinator env, the stored document of a job) for one backend."""
    if backend == "folder":
        state = tmp_path / "state"
        return {"DOCKYARD_COORDINATOR_STATE_DIR": str(state)}, lambda job_id: json.loads(
            (state / job_id / "job.json").read_text()
        )
    import redis

    url = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(url)
    client.delete(REDIS_KEY)
    request.addfinalizer(client.close)
    return {"DOCKYARD_COORDINATOR_STATE_REDIS_URL": url}, lambda job_id: json.loads(client.hget(REDIS_KEY, job_id))


@pytest.mark.parametrize(
    ("backend", "mode", "kill_in", "trainer_too"),
    [
        ("folder", "sync", "training", False),
        ("redis", "async", "waiting for groups", False),
        # Both die: the trainer comes back from its checkpoint, the coordinator from its store.
        ("folder", "sync", "generating", True),
    ],
)
def test_killed_coordinator_comes_back_and_finishes_the_job(
    stack: LocalStack,
    backend: str,
    mode: str,
    kill_in: str,
    trainer_too: bool,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    env, stored = store_of(backend, request, tmp_path)
    stack.kill("coordinator")
    stack.extra_env = env
    stack.restart("coordinator")
    extra = (ASYNC if mode == "async" else []) + (
        ["checkpointing.enabled=true", "checkpointing.save_period=1"] if trainer_too else []
    )
    config = tiny_config(tmp_path / "runs", extra)
    job_id = f"restart-{backend}-{mode}" + ("-with-trainer" if trainer_too else "")
    asyncio.run(call(stack, "CreateJob", pb.CreateJobRequest(config_yaml=config, job_id=job_id)))
    before = asyncio.run(
        wait_for(stack, job_id, lambda j: j.step >= 1 and j.phase == kill_in, f"{kill_in} after step 1")
    )
    assert before.step < STEPS, "the job finished before the coordinator could be killed; make it longer"
    epoch_before = stored(job_id)["sync_epoch"]

    stack.kill("coordinator")
    if trainer_too:
        stack.kill("trainer")
        stack.restart("trainer")
    stack.restart("coordinator")

    again = asyncio.run(call(stack, "GetJob", pb.GetJobRequest(job_id=job_id))).job
    assert again.create_time == before.create_time and again.max_steps == STEPS
    assert again.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED), again.message
    done = asyncio.run(wait_for(stack, job_id, lambda j: j.state in FINISHED, "end"))
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.message
    assert done.step == STEPS and done.weight_version == STEPS
    listed = asyncio.run(call(stack, "ListJobs", pb.ListJobsRequest())).jobs
    assert [(j.job_id, j.state) for j in listed] == [(job_id, pb.JOB_STATE_SUCCEEDED)]

    # Each step trained once, in order: a step whose reply the dead coordinator lost was not trained again.
    books = assert_accounted(tmp_path / "runs" / job_id, max_age=1 if mode == "async" else 0)
    assert [line["step"] for line in books["ledger"]] == list(range(1, STEPS + 1))
    assert trained_steps(stack.log_dir / "trainer.log", job_id) == list(range(1, STEPS + 1))
    records = books["records"]
    train = [r["step"] for r in records if r["kind"] == "train"]
    assert len(train) == len(set(train)) and train == sorted(train)
    recovered = [r for r in records if r["kind"] == "recover"]
    assert len(recovered) == 1 and recovered[0]["step"] >= before.step
    # The one step without a train record is the one whose reply died with the coordinator (when the
    # kill landed after the trainer took it): the restarted coordinator goes on from there.
    missing = set(range(1, STEPS + 1)) - set(train)
    assert missing <= {recovered[0]["step"]}, (train, recovered)
    # The store writes behind the job record (services/coordinator/store.py): GetJob reads the record, so it
    # can say SUCCEEDED a moment before the stored document does; the document has to catch up.
    deadline = time.monotonic() + 30
    while (document := stored(job_id))["state"] != "SUCCEEDED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert document["state"] == "SUCCEEDED" and document["step"] == STEPS
    assert document["sync_epoch"] > epoch_before
