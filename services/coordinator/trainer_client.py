"""One job's calls to the trainer service, and what their failures mean.

    load(resume) ─LoadPolicy─>      train_step(s) ─TrainStep─>      save_checkpoint ─SaveCheckpoint─>
    push_weights ─PushWeights─>     supervised_step ─SupervisedStep─>   unload ─UnloadPolicy─>

Guarantees: LoadPolicy, TrainStep and SaveCheckpoint (idempotent on the
trainer: a repeated TrainStep is answered with the step already taken) are
retried here, and only here, while the trainer is unreachable, up to
`recovery_timeout` seconds (dockyard.rpc.retry lists them as CALLER_RETRIED);
a trainer that answers NOT_FOUND lost the job's policy (a new process) and
raises TrainerRestarted, which recovery handles. `trained_to` is the version
the last TrainStep made, or the one recovery resumed the trainer at.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.config import MasterConfig
from dockyard.rpc.retry import retry

T = TypeVar("T")


class TrainerRestarted(Exception):
    """The trainer lost the job's policy (a new process answered NOT_FOUND, or holds an older
    version after a failed sync): recovery loads it again and the job goes on from its version."""


class TrainerClient:
    def __init__(
        self,
        stub: trainer_pb2_grpc.TrainerServiceStub,
        job_id: str,
        config: MasterConfig,
        config_yaml: str,
        *,
        timeout: float,
        recovery_timeout: float,
    ) -> None:
        self._stub = stub
        self.job_id = job_id
        self._config, self._config_yaml = config, config_yaml
        self._timeout, self._recovery_timeout = timeout, recovery_timeout
        self.trained_to = 0

    async def load(self, resume: bool) -> trainer_pb2.LoadPolicyResponse:
        """LoadPolicy: a trainer that holds the policy answers its state unchanged; a new one loads it,
        with `resume` from the job's latest checkpoint (when the job keeps checkpoints)."""
        yaml_text = self._resuming_yaml() if resume and self._config.checkpointing.enabled else self._config_yaml
        request = trainer_pb2.LoadPolicyRequest(job_id=self.job_id, config_yaml=yaml_text)
        return await self._call("LoadPolicy", lambda: self._stub.LoadPolicy(request, timeout=self._timeout))

    async def train_step(self, step: int) -> trainer_pb2.TrainStepResponse:
        request = trainer_pb2.TrainStepRequest(job_id=self.job_id, step=step)
        reply = await self._call("TrainStep", lambda: self._stub.TrainStep(request, timeout=self._timeout))
        self.trained_to = reply.weight_version
        return reply

    def resumed_at(self, version: int) -> None:
        """The trainer stands at `version` after a resume or a recovery."""
        self.trained_to = version

    async def save_checkpoint(self, metrics: dict[str, float], data_state: str) -> trainer_pb2.SaveCheckpointResponse:
        request = trainer_pb2.SaveCheckpointRequest(job_id=self.job_id, metrics=metrics, data_state=data_state)
        return await self._call("SaveCheckpoint", lambda: self._stub.SaveCheckpoint(request, timeout=self._timeout))

    def push_weights(self) -> Awaitable[trainer_pb2.PushWeightsResponse]:
        """PushWeights, made once: a failed push is judged by the weight sync, which knows the replicas' side."""
        return self._stub.PushWeights(trainer_pb2.PushWeightsRequest(job_id=self.job_id), timeout=self._timeout)

    async def supervised_step(
        self, step: int, demonstrations: Sequence[trainer_pb2.Demonstration]
    ) -> trainer_pb2.SupervisedStepResponse:
        request = trainer_pb2.SupervisedStepRequest(job_id=self.job_id, step=step, demonstrations=demonstrations)
        return await self._stub.SupervisedStep(request, timeout=self._timeout)

    async def unload(self) -> None:
        await self._stub.UnloadPolicy(trainer_pb2.UnloadPolicyRequest(job_id=self.job_id), timeout=30)

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retry(call, what=what, budget_seconds=self._recovery_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise TrainerRestarted(f"{what}: {exc.details()}") from exc
            raise

    def _resuming_yaml(self) -> str:
        """The job's config asking a trainer that lost the policy to resume from the latest checkpoint."""
        cfg = self._config
        checkpointing = cfg.checkpointing.model_copy(
            update={"resume": True, "checkpoint_dir": str(cfg.checkpoint_folder(self.job_id))}
        )
        return cfg.model_copy(update={"checkpointing": checkpointing}).resolved_yaml()
