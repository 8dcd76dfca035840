"""TrainerService over gRPC: validate the request, translate it, call the domain, translate the reply.

    request ─validate─> protos → TrainingGroup / rows ─> BufferConsumer (lease, ledger, acks)
        ─> Ranks.collective(command) on every rank ─> PolicyTrainer ─> reply
    BatchError, ConfigError → INVALID_ARGUMENT; no model → FAILED_PRECONDITION; sync failed → UNAVAILABLE

Guarantees: one PolicyTrainer per job, calls serialised per job by its lock;
on a torchrun trainer this servicer is rank 0's. A batch that fails validation
is refused with INVALID_ARGUMENT before any rank trains on it; its groups are
acked (so the poison batch does not come back) and nothing else changes. A
TrainStep asked for again after it succeeded gets the same reply, never a
second step. Steps, pushes and saves run to their end even if the caller goes.
TrainStep answers only once the buffer has the step's ack (and with it the new
version on its clock), waiting out a buffer or Redis outage; UnloadPolicy ends
that wait.
A job id outside dockyard.jobs.JOB_ID (it names folders), a config beyond the
config bounds, more than MAX_DEMONSTRATIONS demonstrations and more than
MAX_CHECKPOINT_METRICS or non-finite checkpoint metrics are INVALID_ARGUMENT (demonstrations sized
before waiting on the lock or tokenizing);
configs are parsed and demonstrations tokenised off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from datetime import timedelta

import structlog

from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2 as pb
from dockyard.api.trainer.v1 import trainer_pb2_grpc
from dockyard.config import ConfigError, MasterConfig, parse_config_text
from dockyard.experience.trainable import BatchError, checked_groups, checked_rows
from dockyard.rpc.client import connect
from dockyard.rpc.completion import run_to_completion
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from dockyard.weights.synchronizer import WeightSyncFailed
from services.trainer import checkpoint
from services.trainer.consumer import BufferConsumer
from services.trainer.experience import demonstration_rows, staleness_metrics
from services.trainer.ledger import TrainedLedger
from services.trainer.policy import PolicyTrainer
from services.trainer.ranks import Ranks
from services.trainer.requests import (
    check_job_id,
    check_metrics,
    check_next_step,
    demonstration_pairs,
    training_group,
)
from services.trainer.settings import TrainerSettings
from services.trainer.weight_push import WeightPush

log = structlog.get_logger()
BUFFER, COORDINATOR = "dockyard.buffer.v1.BufferService", "dockyard.coordinator.v1.CoordinatorService"


@dataclass
class TrainerJob:
    job_id: str
    policy: PolicyTrainer
    consumer: BufferConsumer
    push: WeightPush
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: pb.TrainStepResponse | None = None  # answered again to a caller that lost it


def _locked(handler):
    """`handler(self, job, request)` under the job's lock, to its end even if the caller goes away."""

    @functools.wraps(handler)
    async def rpc(self: TrainerServicer, request, context, **checked):
        job = self._job(request.job_id)

        async def locked():
            async with job.lock:
                return await handler(self, job, request, **checked)

        return await run_to_completion(locked())

    return rpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.jobs: dict[str, TrainerJob] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        mb = settings.max_message_mb
        self._buffer_channel = connect(settings.buffer_address, service=BUFFER, max_message_mb=mb)
        self.buffer = buffer_pb2_grpc.BufferServiceStub(self._buffer_channel)
        self._coordinator_channel = connect(settings.coordinator_address, service=COORDINATOR, max_message_mb=mb)
        self.coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(self._coordinator_channel)
        self.ranks = Ranks(settings.device)

    def _run(self, command: str, job_id: str, *args, **local):
        """Run ranks.COMMANDS[command] on every rank; the `local` keywords are this rank's alone."""
        return asyncio.to_thread(self.ranks.collective, command, job_id, *args, **local)

    async def close(self) -> None:
        for job in self.jobs.values():
            job.push.close()
        await asyncio.to_thread(self.ranks.stop)
        await self._buffer_channel.close()
        await self._coordinator_channel.close()

    def _job(self, job_id: str) -> TrainerJob:
        check_job_id(job_id)
        if job_id not in self.jobs:
            raise NotFound(f"no policy loaded for job {job_id!r}; call LoadPolicy first")
        return self.jobs[job_id]

    async def LoadPolicy(self, request: pb.LoadPolicyRequest, context) -> pb.LoadPolicyResponse:
        check_job_id(request.job_id)
        try:
            config = await parse_config_text(request.config_yaml, origin="config_yaml")
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        if mismatch := config.cluster.device_mismatch("trainer", self.settings.device):
            raise FailedPrecondition(mismatch)
        async with self._loading.setdefault(request.job_id, asyncio.Lock()):
            job = self.jobs.get(request.job_id)
            if job is None:
                job = self.jobs[request.job_id] = await self._load(request, config)
        # After any step in flight (one whose caller died): the version answered is the one it made.
        async with job.lock:
            policy = job.policy
            return pb.LoadPolicyResponse(
                weight_version=policy.weight_version,
                num_parameters=policy.num_parameters(),
                resumed_from=str(policy.resumed_from or ""),
                data_state=policy.data_state,
            )

    async def _load(self, request: pb.LoadPolicyRequest, config: MasterConfig) -> TrainerJob:
        job_id, settings, folder = request.job_id, self.settings, config.checkpoint_folder(request.job_id)
        try:
            policy = await self._run("load", job_id, request.config_yaml, str(folder))
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"cannot load the policy: {exc}") from None
        log.info(
            "policy loaded",
            parameters=policy.num_parameters(),
            weight_version=policy.weight_version,
            compiled_layers=policy.compiled,
            sequence_packing=policy.packing,
        )
        ledger = TrainedLedger(folder)
        consumer = BufferConsumer(self.buffer, settings.consumer, job_id, ledger, settings.buffer_timeout_seconds)
        timeout = timedelta(seconds=settings.weight_sync_timeout_seconds)
        push = WeightPush(policy.config, job_id, settings.device, self.coordinator, timeout)
        return TrainerJob(job_id, policy, consumer, push)

    @_locked
    async def TrainStep(self, job: TrainerJob, request: pb.TrainStepRequest) -> pb.TrainStepResponse:
        policy, consumer = job.policy, job.consumer
        if job.last_reply is not None and request.step == policy.weight_version == job.last_reply.weight_version:
            # The caller lost the reply of a step that was taken: answer it again, never train twice.
            return job.last_reply
        check_next_step(policy, request.step)
        lease = await consumer.lease(policy.weight_version, policy.config.grpo.num_prompts_per_step)
        leased = [training_group(g.group, g.payload) for g in lease.groups]
        group_ids = [g.group_id for g in leased]
        try:
            # Checked here, once, before any rank sees the batch: a refused batch touches no rank, and the
            # ranks' prepare_step takes CheckedGroups as they are.
            groups = checked_groups(leased, policy.vocab_size, policy.max_positions)
        except BatchError as exc:
            # Acked so the same poison batch is not sampled again; the policy is unchanged.
            await consumer.ack(group_ids, policy.weight_version)
            log.warning("batch refused", step=request.step, error=str(exc))
            raise InvalidArgument(
                f"batch for step {request.step} refused, nothing trained on it "
                f"(its {len(leased)} group(s) were acked and dropped): {exc}"
            ) from None
        log.info("training step", step=request.step, groups=len(groups))
        metrics = await self._run("train", job.job_id, groups)
        trajectory_ids = [s.trajectory_id for g in groups for s in g.samples]
        await consumer.trained(request.step, policy.weight_version, group_ids, trajectory_ids)
        metrics.update(staleness_metrics(groups, request.step - 1), **lease.metrics())
        log.info("step done", step=request.step, loss=round(metrics["loss"], 5), groups=len(groups))
        job.last_reply = pb.TrainStepResponse(
            weight_version=policy.weight_version,
            groups_trained=len(groups),
            trajectories_trained=len(trajectory_ids),
            groups_dropped_stale=lease.dropped_stale,
            metrics=metrics,
        )
        return job.last_reply

    async def SupervisedStep(self, request: pb.SupervisedStepRequest, context) -> pb.SupervisedStepResponse:
        # Sized before waiting on the job's lock or tokenizing: a bad batch is refused at once.
        pairs = demonstration_pairs(request.demonstrations, self._job(request.job_id).policy.max_positions)
        return await self._supervised_step(request, context, pairs=pairs)

    @_locked
    async def _supervised_step(
        self, job: TrainerJob, request: pb.SupervisedStepRequest, *, pairs: list[tuple[str, str]]
    ) -> pb.SupervisedStepResponse:
        policy = job.policy
        check_next_step(policy, request.step)
        rows = await asyncio.to_thread(demonstration_rows, policy.tokenizer, pairs)
        try:
            rows = checked_rows(rows, policy.vocab_size, policy.max_positions)
        except BatchError as exc:
            raise InvalidArgument(f"batch for step {request.step} refused, nothing trained on it: {exc}") from None
        metrics = await self._run("sft", job.job_id, rows)
        log.info("supervised step done", step=request.step, loss=round(metrics["loss"], 5))
        return pb.SupervisedStepResponse(weight_version=policy.weight_version, metrics=metrics)

    @_locked
    async def PushWeights(self, job: TrainerJob, request: pb.PushWeightsRequest) -> pb.PushWeightsResponse:
        version = job.policy.weight_version
        try:
            report = await self._run("weights", job.job_id, send=job.push.sender(version, asyncio.get_running_loop()))
        except WeightSyncFailed as exc:
            raise Unavailable(str(exc)) from None
        mb = round(report.num_bytes / 2**20, 2)
        log.info("weights pushed", version=version, mb=mb, seconds=round(report.seconds, 3))
        return pb.PushWeightsResponse(
            weight_version=version, checksum=report.checksum, num_bytes=report.num_bytes, seconds=report.seconds
        )

    @_locked
    async def SaveCheckpoint(self, job: TrainerJob, request: pb.SaveCheckpointRequest) -> pb.SaveCheckpointResponse:
        check_metrics(request.metrics)
        policy, cfg = job.policy, job.policy.config.checkpointing
        root = policy.config.checkpoint_folder(job.job_id)
        folder = checkpoint.folder_for(root, policy.weight_version)
        path = await self._run("save", job.job_id, folder, dict(request.metrics), request.data_state)
        keep = (cfg.keep_top_k, cfg.metric_name, cfg.higher_is_better)
        removed = await asyncio.to_thread(checkpoint.retain, root, *keep)
        return pb.SaveCheckpointResponse(path=str(path), step=policy.weight_version, removed=[str(p) for p in removed])

    async def UnloadPolicy(self, request: pb.UnloadPolicyRequest, context) -> pb.UnloadPolicyResponse:
        job = self._job(request.job_id)
        job.consumer.stop()  # an ack waiting out a buffer outage holds the lock: it gives up now
        async with job.lock:
            job.push.close()
            await job.consumer.close()
            del self.jobs[request.job_id]
            self._loading.pop(request.job_id, None)
            await self._run("unload", request.job_id)
        return pb.UnloadPolicyResponse()
