"""A trainer that restarts at any of its calls (TrainStep, the weight sync, SaveCheckpoint): the
runner resumes it from the latest checkpoint and the job goes on to SUCCEEDED, retraining exactly
the steps the checkpoint lacked. Scripted services, a real JobRunner and run folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.trainer.v1 import trainer_pb2
from dockyard.config import load_config, load_config_text
from dockyard.jobs import FAILED, SUCCEEDED
from services.coordinator import weight_sync as weight_sync_module
from services.coordinator.collector import CollectStats
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet
from services.coordinator.jobs import JobRecord
from services.coordinator.runner import JobRunner, Stubs
from services.coordinator.settings import CoordinatorSettings
from tests.conftest import REPO_ROOT

STEPS = 4


def not_found() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no policy loaded"
    )


class Trainer:
    """Checkpoints when asked; at one (call, weight version) its process dies and comes back empty."""

    def __init__(self, restart_at: tuple[str, int] | None, flaky_push_at: int | None = None) -> None:
        self.restart_at = restart_at
        self.flaky_push_at = flaky_push_at  # a push that fails once, the policy kept
        self.loaded = False
        self.version = 0
        self.checkpoints: list[int] = []
        self.trained: list[int] = []
        self.loads: list[bool] = []  # resume asked, per LoadPolicy

    def _alive(self, call: str) -> None:
        if (call, self.version) == self.restart_at:
            self.restart_at, self.loaded = None, False
        if not self.loaded:
            raise not_found()

    async def LoadPolicy(self, request, timeout=None):
        resume = load_config_text(request.config_yaml).checkpointing.resume
        self.loads.append(resume)
        if self.loaded:  # as the real trainer: a policy it holds is answered unchanged
            return trainer_pb2.LoadPolicyResponse(weight_version=self.version)
        self.loaded = True
        self.version = max(self.checkpoints) if resume and self.checkpoints else 0
        resumed = f"step-{self.version}" if resume and self.checkpoints else ""
        return trainer_pb2.LoadPolicyResponse(weight_version=self.version, resumed_from=resumed)

    async def TrainStep(self, request, timeout=None):
        self._alive("TrainStep")
        assert request.step == self.version + 1, "the runner asked for a step the trainer is not at"
        self.version += 1
        self.trained.append(self.version)
        return trainer_pb2.TrainStepResponse(weight_version=self.version, metrics={"loss": 0.5})

    async def PushWeights(self, request, timeout=None):
        self._alive("PushWeights")
        if self.version == self.flaky_push_at:
            self.flaky_push_at = None
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="weight-sync group broke"
            )
        return trainer_pb2.PushWeightsResponse(checksum="c", weight_version=self.version)

    async def SaveCheckpoint(self, request, timeout=None):
        self._alive("SaveCheckpoint")
        self.checkpoints.append(self.version)
        return trainer_pb2.SaveCheckpointResponse(path=f"step-{self.version}", step=self.version)

    async def UnloadPolicy(self, request, timeout=None):
        return trainer_pb2.UnloadPolicyResponse()


class Buffer:
    def __init__(self) -> None:
        self.rewinds: list[int] = []

    async def GetDataPlane(self, request, timeout=None):
        return buffer_pb2.GetDataPlaneResponse()

    async def OpenJob(self, request, timeout=None):
        if request.HasField("rewind_to_version"):
            self.rewinds.append(request.rewind_to_version)
        return buffer_pb2.OpenJobResponse()

    async def AckGroups(self, request, timeout=None):
        return buffer_pb2.AckGroupsResponse()

    async def GetStats(self, request, timeout=None):
        return buffer_pb2.GetStatsResponse()

    async def CloseJob(self, request, timeout=None):
        return buffer_pb2.CloseJobResponse()


async def replica_call(kind):
    async def call(request, timeout=None):
        if kind == "receive":
            return rollout_pb2.ReceiveWeightsResponse(checksum="c", weight_version=request.weight_version)
        return {"load": rollout_pb2.LoadPolicyResponse, "unload": rollout_pb2.UnloadPolicyResponse}[kind]()

    return call


async def make_runner(tmp_path: Path, trainer: Trainer, overrides: list[str]) -> tuple[JobRunner, Buffer]:
    config = load_config(
        REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
        [
            "policy.model_name=null",
            "policy.bootstrap=null",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "grpo.val_period=0",
            f"grpo.max_num_steps={STEPS}",
            f"checkpointing.checkpoint_dir={tmp_path / 'checkpoints'}",
            *overrides,
        ],
    )
    record = JobRecord("job", config, config.resolved_yaml(), str(tmp_path / "run"))
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, None))
    replica = fleet.register(ROLLOUT, "rollout", "127.0.0.1:1")
    replica.stub = SimpleNamespace(
        LoadPolicy=await replica_call("load"),
        ReceiveWeights=await replica_call("receive"),
        UnloadPolicy=await replica_call("unload"),
    )
    fleet.register(SANDBOX, "sandbox", "127.0.0.1:2")
    buffer = Buffer()
    settings = CoordinatorSettings(recovery_timeout_seconds=5.0)
    runner = JobRunner(record, Stubs(trainer=trainer, buffer=buffer, fleet=fleet), settings)

    async def collect_step(step: int) -> CollectStats:
        return CollectStats(groups=config.grpo.num_prompts_per_step)

    runner.sync_producer.collect_step = collect_step
    return runner, buffer


@pytest.fixture(autouse=True)
def healthy(monkeypatch):
    async def channel_health(channel, timeout=2.0):
        return "SERVING"

    monkeypatch.setattr(weight_sync_module, "channel_health", channel_health)


@pytest.mark.parametrize(
    ("call", "version", "trained", "resumed_at"),
    [
        # Between steps: the checkpoint of step 2 is whole, nothing is trained again.
        ("TrainStep", 2, [1, 2, 3, 4], 2),
        # Step 2 trained but its weights never reached the replicas: back to checkpoint 1.
        ("PushWeights", 2, [1, 2, 2, 3, 4], 1),
        # Died saving step 2's checkpoint: back to checkpoint 1.
        ("SaveCheckpoint", 2, [1, 2, 2, 3, 4], 1),
        # Died before the first weight sync: no checkpoint yet, the resume starts afresh.
        ("PushWeights", 0, [1, 2, 3, 4], 0),
        # Died saving the final checkpoint: the last step is trained again.
        ("SaveCheckpoint", STEPS, [1, 2, 3, 4, 4], 3),
    ],
)
async def test_the_job_resumes_from_the_latest_checkpoint(tmp_path, call, version, trained, resumed_at) -> None:
    trainer = Trainer(restart_at=(call, version))
    runner, buffer = await make_runner(tmp_path, trainer, ["checkpointing.save_period=1"])
    await runner.run()
    assert runner.record.state == SUCCEEDED, runner.record.message
    assert trainer.trained == trained
    assert trainer.loads == [False, True]  # loaded, then resumed once
    assert buffer.rewinds == [resumed_at]
    assert trainer.checkpoints[-1] == STEPS and runner.record.step == STEPS
    assert runner.ids.run_number == 1 and runner.ids.prefix == "job/r1"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert [(r["step"], r["steps_lost"]) for r in recoveries] == [(resumed_at, version - resumed_at)]


async def test_without_checkpoints_a_trainer_restart_fails_the_job_with_the_reason(tmp_path) -> None:
    trainer = Trainer(restart_at=("PushWeights", 2))
    runner, _ = await make_runner(tmp_path, trainer, ["checkpointing.enabled=false"])
    await runner.run()
    assert runner.record.state == FAILED
    assert "nothing to resume from" in runner.record.message
    assert trainer.trained == [1, 2]


async def test_a_sync_that_failed_on_a_trainer_that_kept_the_policy_is_tried_again(tmp_path) -> None:
    trainer = Trainer(restart_at=None, flaky_push_at=2)
    runner, buffer = await make_runner(tmp_path, trainer, ["checkpointing.save_period=1"])
    await runner.run()
    assert runner.record.state == SUCCEEDED, runner.record.message
    # Asked once whether it still held the policy; nothing trained again, no recovery.
    assert trainer.trained == [1, 2, 3, 4] and trainer.loads == [False, True]
    assert buffer.rewinds == [] and runner.ids.run_number == 0
    assert trainer.checkpoints == [1, 2, 3, 4]
