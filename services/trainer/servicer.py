"""TrainerService over gRPC: one PolicyTrainer per job, calls serialised per job.

On a torchrun trainer this servicer lives on rank 0; every call that touches
the policy is published to the other ranks first (services.trainer.ranks), so
all ranks run it together. A batch that fails validation is refused with
INVALID_ARGUMENT before any rank trains on it; its groups are acked (so the
poison batch does not come back) and nothing else changes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import structlog

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.config import ConfigError, load_config_text
from dockyard.rpc.client import connect
from dockyard.rpc.completion import run_to_completion
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from dockyard.weights.rendezvous import coordinator_rendezvous, transport_for
from dockyard.weights.synchronizer import WeightSyncFailed, WeightSynchronizer
from services.trainer import checkpoint
from services.trainer.batch import BatchError, validate_groups, validate_rows
from services.trainer.ledger import TrainedLedger
from services.trainer.policy import PolicyTrainer
from services.trainer.ranks import Ranks
from services.trainer.settings import TrainerSettings

log = structlog.get_logger()


@dataclass
class TrainerJob:
    job_id: str
    policy: PolicyTrainer
    ledger: TrainedLedger
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sync: WeightSynchronizer | None = None
    # A fresh trainer first takes over the groups its predecessor left pending.
    reclaim_due: bool = True
    # Trained groups whose ack has not reached the buffer yet (it was down).
    unacked: list[str] = field(default_factory=list)
    # The reply of the last step, answered again to a caller that lost it.
    last_reply: trainer_pb2.TrainStepResponse | None = None


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.jobs: dict[str, TrainerJob] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._buffer_channel = connect(
            settings.buffer_address, service="dockyard.buffer.v1.BufferService", max_message_mb=settings.max_message_mb
        )
        self.buffer = buffer_pb2_grpc.BufferServiceStub(self._buffer_channel)
        self._coordinator_channel = connect(
            settings.coordinator_address,
            service="dockyard.coordinator.v1.CoordinatorService",
            max_message_mb=settings.max_message_mb,
        )
        self.coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(self._coordinator_channel)
        self.ranks = Ranks()

    def _run(self, method: str, job_id: str, args: tuple, local):
        """Run `local` on this rank after publishing the same command to the other ranks."""
        return asyncio.to_thread(self.ranks.collective, method, job_id, args, local)

    async def close(self) -> None:
        for job in self.jobs.values():
            if job.sync is not None:
                job.sync.close()
        await asyncio.to_thread(self.ranks.stop)
        await self._buffer_channel.close()
        await self._coordinator_channel.close()

    def _job(self, job_id: str) -> TrainerJob:
        if not job_id:
            raise InvalidArgument("job_id is required")
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no policy loaded for job {job_id!r}; call LoadPolicy first") from None

    async def LoadPolicy(
        self, request: trainer_pb2.LoadPolicyRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.LoadPolicyResponse:
        if not request.job_id:
            raise InvalidArgument("job_id is required")
        try:
            config = load_config_text(request.config_yaml, origin="config_yaml")
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        async with self._loading.setdefault(request.job_id, asyncio.Lock()):
            job = self.jobs.get(request.job_id)
            if job is None:
                folder = config.checkpoint_folder(request.job_id)
                try:
                    policy = await self._run(
                        "load",
                        request.job_id,
                        (request.config_yaml, str(folder)),
                        lambda: PolicyTrainer(config, self.settings.device, folder),
                    )
                except ConfigError as exc:
                    raise InvalidArgument(str(exc)) from None
                except FileNotFoundError as exc:
                    raise FailedPrecondition(f"cannot load the policy: {exc}") from None
                job = self.jobs[request.job_id] = TrainerJob(request.job_id, policy, TrainedLedger(folder))
                log.info("policy loaded", parameters=policy.num_parameters(), weight_version=policy.weight_version)
        # After any step in flight (one whose caller died): the version answered is the one it made.
        async with job.lock:
            return trainer_pb2.LoadPolicyResponse(
                weight_version=job.policy.weight_version,
                num_parameters=job.policy.num_parameters(),
                resumed_from=str(job.policy.resumed_from or ""),
                data_state=job.policy.data_state,
            )

    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        # Finished even if the caller goes away: a step is never half taken, a lock never left early.
        return await run_to_completion(self._train_step(request))

    async def _train_step(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        job = self._job(request.job_id)
        async with job.lock:
            policy = job.policy
            if job.last_reply is not None and request.step == policy.weight_version == job.last_reply.weight_version:
                # The caller lost the reply of a step that was taken: answer it again, never train twice.
                return job.last_reply
            _check_next_step(policy, request.step)
            await self._ack(job, [], policy.weight_version)
            groups, dropped, reclaimed = await self._lease(job)
            try:
                # Checked here, before any rank sees the batch: a refused batch touches no rank.
                validate_groups(groups, policy.model.config.vocab_size, policy.max_positions)
            except BatchError as exc:
                # Acked so the same poison batch is not sampled again; the policy is unchanged.
                await self._ack(job, [g.group_id for g in groups], policy.weight_version)
                log.warning("batch refused", step=request.step, error=str(exc))
                raise InvalidArgument(
                    f"batch for step {request.step} refused, nothing trained on it "
                    f"(its {len(groups)} group(s) were acked and dropped): {exc}"
                ) from None
            payload = [g.SerializeToString() for g in groups]
            metrics = await self._run("train", job.job_id, (payload,), lambda: policy.train_step(groups))
            group_ids = [g.group_id for g in groups]
            # On disk before the ack: a trainer that dies in between finds these in its ledger
            # when it reclaims them, and acks them instead of training on them again.
            await asyncio.to_thread(
                job.ledger.record,
                request.step,
                policy.weight_version,
                group_ids,
                [t.trajectory_id for g in groups for t in g.trajectories],
            )
            await self._ack(job, group_ids, policy.weight_version)
            metrics.update(staleness_metrics(groups, request.step - 1))
            metrics["groups_dropped_stale"] = float(dropped)
            metrics["groups_reclaimed"] = float(reclaimed)
            log.info("step done", step=request.step, loss=round(metrics["loss"], 5), groups=len(groups))
            job.last_reply = trainer_pb2.TrainStepResponse(
                weight_version=policy.weight_version,
                groups_trained=len(groups),
                trajectories_trained=sum(len(g.trajectories) for g in groups),
                groups_dropped_stale=dropped,
                metrics=metrics,
            )
            return job.last_reply

    async def _lease(self, job: TrainerJob) -> tuple[list[common_pb2.Group], int, int]:
        """This step's groups: first those a dead predecessor left pending, then fresh ones."""
        policy = job.policy
        wanted = policy.config.grpo.num_prompts_per_step
        groups: list[common_pb2.Group] = []
        dropped = reclaimed = 0
        try:
            if job.reclaim_due:
                reply = await self.buffer.ReclaimGroups(
                    buffer_pb2.ReclaimGroupsRequest(
                        job_id=job.job_id,
                        trainer_step=policy.weight_version,
                        max_groups=wanted,
                        consumer=self.settings.consumer,
                        min_idle_seconds=0.0,
                    )
                )
                done = [g.group_id for g in reply.groups if g.group_id in job.ledger]
                groups = [g for g in reply.groups if g.group_id not in job.ledger]
                dropped, reclaimed = reply.dropped_stale, len(groups)
                if done:
                    log.warning("acking reclaimed groups the ledger says were trained", groups=len(done))
                    await self._ack(job, done, policy.weight_version)
                job.reclaim_due = False
                if reclaimed:
                    log.info("reclaimed pending groups", groups=reclaimed)
            if len(groups) < wanted:
                reply = await self.buffer.SampleGroups(
                    buffer_pb2.SampleGroupsRequest(
                        job_id=job.job_id,
                        trainer_step=policy.weight_version,
                        max_groups=wanted - len(groups),
                        consumer=self.settings.consumer,
                    )
                )
                groups += reply.groups
                dropped += reply.dropped_stale
        except grpc.aio.AioRpcError as exc:
            # What was leased stays pending and is reclaimed by the next call: nothing is lost.
            job.reclaim_due = True
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise FailedPrecondition(f"the buffer refused to sample: {exc.details()}") from None
            raise Unavailable(f"the buffer is unavailable: {exc.code().name}: {exc.details()}") from None
        if not groups:
            raise FailedPrecondition(
                f"the buffer holds no fresh groups for step {policy.weight_version + 1} "
                f"({dropped} dropped as stale); put experience first"
            )
        return groups, dropped, reclaimed

    async def _ack(self, job: TrainerJob, group_ids: list[str], weight_version: int) -> None:
        """Ack these and any earlier unacked groups; if the buffer is down they wait for the next call."""
        job.unacked += group_ids
        if not job.unacked:
            return
        try:
            await self.buffer.AckGroups(
                buffer_pb2.AckGroupsRequest(job_id=job.job_id, group_ids=job.unacked, weight_version=weight_version),
                timeout=self.settings.buffer_timeout_seconds,
            )
            job.unacked = []
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            # Safe to defer: the ledger already names them, so a reclaim can never retrain them.
            log.warning("ack deferred: the buffer is unavailable", groups=len(job.unacked), error=exc.details())

    async def SupervisedStep(
        self, request: trainer_pb2.SupervisedStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SupervisedStepResponse:
        # Finished even if the caller goes away: a step is never half taken, a lock never left early.
        return await run_to_completion(self._supervised_step(request))

    async def _supervised_step(self, request: trainer_pb2.SupervisedStepRequest) -> trainer_pb2.SupervisedStepResponse:
        job = self._job(request.job_id)
        async with job.lock:
            policy = job.policy
            _check_next_step(policy, request.step)
            if not request.demonstrations:
                raise InvalidArgument("empty batch: no demonstrations to train on")
            tok = policy.tokenizer
            rows = []
            for i, demo in enumerate(request.demonstrations):
                if not demo.prompt or not demo.completion:
                    raise InvalidArgument(f"demonstrations[{i}]: prompt and completion must both be non-empty")
                prompt = tok(demo.prompt, add_special_tokens=False)["input_ids"]
                completion = tok(demo.completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                rows.append((prompt, completion))
            try:
                validate_rows(rows, policy.model.config.vocab_size, policy.max_positions)
            except BatchError as exc:
                raise InvalidArgument(f"batch for step {request.step} refused, nothing trained on it: {exc}") from None
            metrics = await self._run("sft", job.job_id, (rows,), lambda: policy.sft_step(rows))
            log.info("supervised step done", step=request.step, loss=round(metrics["loss"], 5))
            return trainer_pb2.SupervisedStepResponse(weight_version=policy.weight_version, metrics=metrics)

    async def PushWeights(
        self, request: trainer_pb2.PushWeightsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushWeightsResponse:
        # Finished even if the caller goes away: a step is never half taken, a lock never left early.
        return await run_to_completion(self._push_weights(request))

    async def _push_weights(self, request: trainer_pb2.PushWeightsRequest) -> trainer_pb2.PushWeightsResponse:
        job = self._job(request.job_id)
        async with job.lock:
            if job.sync is None:
                timeout = timedelta(seconds=self.settings.weight_sync_timeout_seconds)
                job.sync = WeightSynchronizer(
                    transport_for(job.policy.config, job.job_id, timeout, self.settings.device),
                    coordinator_rendezvous(self.coordinator, job.job_id, "trainer"),
                )
            job.sync.mark_stale(job.policy.weight_version)
            loop = asyncio.get_running_loop()

            def push():
                # Every rank takes part in each parameter's gather (FSDP2): the other ranks drain
                # the same iterator, so rank 0 finishes it even after a failed sync.
                weights = job.policy.named_weights()
                try:
                    sync = job.sync.sync_weights(weights, job.policy.weight_version)
                    return asyncio.run_coroutine_threadsafe(sync, loop).result()
                finally:
                    for _ in weights:
                        pass

            try:
                report = await self._run("weights", job.job_id, (), push)
            except WeightSyncFailed as exc:
                raise Unavailable(str(exc)) from None
            log.info(
                "weights pushed",
                version=job.policy.weight_version,
                mb=round(report.num_bytes / 2**20, 2),
                seconds=round(report.seconds, 3),
            )
            return trainer_pb2.PushWeightsResponse(
                weight_version=job.policy.weight_version,
                checksum=report.checksum,
                num_bytes=report.num_bytes,
                seconds=report.seconds,
            )

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        # Finished even if the caller goes away: no step may change the weights halfway through a save.
        return await run_to_completion(self._save_checkpoint(request))

    async def _save_checkpoint(self, request: trainer_pb2.SaveCheckpointRequest) -> trainer_pb2.SaveCheckpointResponse:
        job = self._job(request.job_id)
        async with job.lock:
            policy = job.policy
            cfg = policy.config.checkpointing
            root = policy.config.checkpoint_folder(job.job_id)
            folder = root / f"step-{policy.weight_version}"
            args = (folder, dict(request.metrics), request.data_state)
            path = await self._run("save", job.job_id, args, lambda: policy.save(*args))
            removed = await asyncio.to_thread(
                checkpoint.retain, root, cfg.keep_top_k, cfg.metric_name, cfg.higher_is_better
            )
            return trainer_pb2.SaveCheckpointResponse(
                path=str(path), step=policy.weight_version, removed=[str(p) for p in removed]
            )

    async def UnloadPolicy(
        self, request: trainer_pb2.UnloadPolicyRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.UnloadPolicyResponse:
        job = self._job(request.job_id)
        async with job.lock:
            if job.sync is not None:
                job.sync.close()
            del self.jobs[request.job_id]
            self._loading.pop(request.job_id, None)
            await self._run("unload", request.job_id, (), lambda: None)
        return trainer_pb2.UnloadPolicyResponse()


def staleness_metrics(groups: list[common_pb2.Group], trainer_version: int) -> dict[str, float]:
    """Histogram of the trained samples' age (trainer version − generating version), with mean and max."""
    ages = [trainer_version - t.weight_version for g in groups for t in g.trajectories]
    metrics = {f"staleness_{age}": float(ages.count(age)) for age in sorted(set(ages))}
    metrics["staleness_mean"] = sum(ages) / max(len(ages), 1)
    metrics["staleness_max"] = float(max(ages, default=0))
    return metrics


def _check_next_step(policy: PolicyTrainer, step: int) -> None:
    expected = policy.weight_version + 1
    if step != expected:
        raise FailedPrecondition(
            f"the trainer has taken {policy.weight_version} steps; the next step is {expected}, not {step}"
        )
