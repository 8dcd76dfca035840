"""One job's synchronous (on-policy) GRPO loop, driven from the coordinator.

    load policy (trainer, rollout; the trainer may resume at step k) ─> weights vk ─> [validate]
    for step in k+1..max_num_steps:
        collect (generate ─> score ─> buffer) ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    [validate] ─> checkpoint ─> SUCCEEDED

Guarantees: generation for step s uses the weights of version s − 1 (the
rollout holds exactly the trainer's weights: both sides' checksums must
agree after every sync); a checkpoint carries the validation metrics of its
step (they rank it for top-k retention) and the number of training tasks drawn,
so a resumed job draws the same tasks an uninterrupted one would; the job ends FAILED with the cause in its message
on any error, CANCELLED on CancelJob, and both policies are unloaded either way.

Recovery (a runner started by a restarted coordinator for a job it had): the
step is the trainer's weight_version as LoadPolicy reports it, never the
persisted step (a TrainStep whose reply was lost is not trained again), and
the task stream continues from the persisted cursor (`_mark_cursor`), which is
stored before each TrainStep, so it always names the tasks of the step the
trainer stands at or the one after.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.sandbox.v1 import sandbox_pb2_grpc
from dockyard.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.coordinator.collector import Collector, load_tasks
from services.coordinator.jobs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, JobRecord
from services.coordinator.metrics import RunFolder
from services.coordinator.settings import CoordinatorSettings

log = structlog.get_logger()

# A weight sync that failed on the side group is tried this many times in all.
SYNC_ATTEMPTS = 2
# How long a step waits for its cursor to be stored; a store that is down delays, never stops, a job.
CURSOR_FLUSH_SECONDS = 5.0


@dataclass
class Stubs:
    trainer: trainer_pb2_grpc.TrainerServiceStub
    rollout: rollout_pb2_grpc.RolloutServiceStub
    buffer: buffer_pb2_grpc.BufferServiceStub
    sandbox: sandbox_pb2_grpc.SandboxServiceStub


class CountingIterator:
    """Wraps an iterator and counts the items taken from it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.inner)
        self.count += 1
        return item


class JobRunner:
    def __init__(
        self,
        record: JobRecord,
        stubs: Stubs,
        settings: CoordinatorSettings,
        *,
        recovering: bool = False,
        flush: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        self.record = record
        self.recovering = recovering
        self._flush = flush
        self.stubs = stubs
        self.settings = settings
        self.config = record.config
        self.folder = RunFolder(Path(record.run_dir))
        self.collector = Collector(
            record.job_id,
            record.config,
            stubs.rollout,
            stubs.sandbox,
            stubs.buffer,
            max_generations=settings.max_concurrent_generations,
            max_scoring=settings.max_concurrent_scoring,
            generate_timeout=settings.generate_timeout_seconds,
        )
        self._slow = settings.train_timeout_seconds
        self._validated: tuple[int, dict[str, float]] = (-1, {})
        self._tasks_drawn = CountingIterator(iter(()))

    def _phase(self, phase: str) -> None:
        self.record.touch(phase=phase)
        log.info("phase", phase=phase, step=self.record.step)

    async def run(self) -> None:
        record = self.record
        structlog.contextvars.bind_contextvars(job_id=record.job_id)
        try:
            if record.state == PENDING:
                record.transition(RUNNING)
            await self._train()
            record.transition(SUCCEEDED)
            self._phase("done")
        except asyncio.CancelledError:
            if not record.finished:
                record.transition(CANCELLED, "cancelled by request")
            self._phase("cancelled")
        except Exception as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            where = f" ({exc.code().name})" if isinstance(exc, grpc.aio.AioRpcError) else ""
            log.exception("job failed", phase=record.phase)
            if not record.finished:
                record.transition(FAILED, f"{record.phase}{where}: {detail}")
        finally:
            await self._cleanup()

    async def _train(self) -> None:
        cfg, record, stubs = self.config, self.record, self.stubs
        self._phase("loading policy")
        await stubs.buffer.OpenJob(
            buffer_pb2.OpenJobRequest(
                job_id=record.job_id,
                max_groups=cfg.grpo.buffer_capacity,
                max_trajectory_age_steps=cfg.grpo.max_trajectory_age_steps,
            )
        )
        yaml_text = record.config_yaml
        loaded, _ = await asyncio.gather(
            stubs.trainer.LoadPolicy(
                trainer_pb2.LoadPolicyRequest(job_id=record.job_id, config_yaml=yaml_text), timeout=self._slow
            ),
            stubs.rollout.LoadPolicy(
                rollout_pb2.LoadPolicyRequest(job_id=record.job_id, config_yaml=yaml_text), timeout=self._slow
            ),
        )
        start = await self._resume(loaded)
        await self._sync_weights(start)
        val_tasks = load_tasks(cfg, "validation")
        if cfg.sft is not None:
            await self._train_sft(start, val_tasks)
            return
        if cfg.grpo.val_at_start and start == 0:
            await self._validate(0, val_tasks)
        for step in range(start + 1, cfg.grpo.max_num_steps + 1):
            t0 = time.perf_counter()
            self._phase("generating")
            drawn = self._tasks_drawn.count
            stats = await self.collector.collect_step(step)
            await self._mark_cursor(step, drawn)
            t1 = time.perf_counter()
            self._phase("training")
            reply = await stubs.trainer.TrainStep(
                trainer_pb2.TrainStepRequest(job_id=record.job_id, step=step), timeout=self._slow
            )
            t2 = time.perf_counter()
            self._phase("syncing weights")
            sync_seconds = await self._sync_weights(reply.weight_version)
            t3 = time.perf_counter()
            metrics = {
                **reply.metrics,
                **await self._buffer_metrics(),
                "groups": float(stats.groups),
                "invalid_trajectories": float(stats.invalid),
                "dropped_uniform_groups": float(stats.dropped_uniform),
                "dropped_stale_on_put": float(stats.dropped_stale),
                **{f"verdict_{name}": float(count) for name, count in stats.verdicts.items()},
                "generate_score_seconds": t1 - t0,
                "train_step_seconds": t2 - t1,
                "weight_sync_seconds": t3 - t2,
                "weight_sync_transfer_seconds": sync_seconds,
                "step_seconds": t3 - t0,
                "generated_tokens_per_second": stats.generated_tokens / max(t1 - t0, 1e-9),
            }
            self.folder.append("train", step, metrics)
            record.touch(step=step, weight_version=reply.weight_version, metrics=metrics)
            last = step == cfg.grpo.max_num_steps
            if cfg.grpo.val_period and step % cfg.grpo.val_period == 0 and not (last and cfg.grpo.val_at_end):
                await self._validate(step, val_tasks)
            if (
                cfg.checkpointing.enabled
                and cfg.checkpointing.save_period
                and step % cfg.checkpointing.save_period == 0
                and not last
            ):
                await self._checkpoint(step)
        if cfg.grpo.val_at_end and start < cfg.grpo.max_num_steps:
            await self._validate(cfg.grpo.max_num_steps, val_tasks)
        if cfg.checkpointing.enabled:
            await self._checkpoint(cfg.grpo.max_num_steps)

    async def _train_sft(self, start: int, val_tasks) -> None:
        """A supervised job: demonstrations of the training tasks, same validation and checkpoints."""
        cfg, sft = self.config, self.config.sft
        if sft.val_at_start and start == 0:
            await self._validate(0, val_tasks)
        for step in range(start + 1, sft.max_num_steps + 1):
            t0 = time.perf_counter()
            self._phase("training")
            drawn = self._tasks_drawn.count
            demos = [
                trainer_pb2.Demonstration(prompt=task.prompt, completion=task.solution)
                for task in (next(self.collector.tasks) for _ in range(sft.batch_size))
            ]
            await self._mark_cursor(step, drawn)
            reply = await self.stubs.trainer.SupervisedStep(
                trainer_pb2.SupervisedStepRequest(job_id=self.record.job_id, step=step, demonstrations=demos),
                timeout=self._slow,
            )
            metrics = {**reply.metrics, "step_seconds": time.perf_counter() - t0}
            self.folder.append("train", step, metrics)
            self.record.touch(step=step, weight_version=reply.weight_version, metrics=metrics)
            last = step == sft.max_num_steps
            if (sft.val_period and step % sft.val_period == 0 and not last) or (last and sft.val_at_end):
                # Validation generates with the rollout: it needs this step's weights.
                self._phase("syncing weights")
                await self._sync_weights(reply.weight_version)
                await self._validate(step, val_tasks)
            if cfg.checkpointing.enabled and (
                last or (cfg.checkpointing.save_period and step % cfg.checkpointing.save_period == 0)
            ):
                await self._checkpoint(step)

    async def _sync_weights(self, version: int) -> float:
        """Push and receive one version; a sync that failed on the side group (UNAVAILABLE) is tried
        once more: both ends tear their group down and the next attempt forms the next epoch."""
        job_id = self.record.job_id
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            # Both calls run to their end (return_exceptions) so a retry never overlaps a stale one.
            pushed, received = await asyncio.gather(
                self.stubs.trainer.PushWeights(trainer_pb2.PushWeightsRequest(job_id=job_id), timeout=self._slow),
                self.stubs.rollout.ReceiveWeights(
                    rollout_pb2.ReceiveWeightsRequest(job_id=job_id, weight_version=version), timeout=self._slow
                ),
                return_exceptions=True,
            )
            failures = [r for r in (pushed, received) if isinstance(r, BaseException)]
            if not failures:
                break
            retriable = all(
                isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.UNAVAILABLE for f in failures
            )
            if attempt == SYNC_ATTEMPTS or not retriable:
                raise failures[0]
            log.warning("weight sync failed; trying again", version=version, error=str(failures[0]))
        if pushed.checksum != received.checksum or received.weight_version != version:
            raise RuntimeError(
                f"weight sync of version {version} is corrupt: trainer sent {pushed.checksum[:12]}, "
                f"rollout holds {received.checksum[:12]} at version {received.weight_version}"
            )
        return max(pushed.seconds, received.seconds)

    async def _mark_cursor(self, step: int, drawn_before: int) -> None:
        """Record the tasks drawn before and after collecting `step`; stored before the step trains."""
        cursor = {"step": step, "tasks_drawn_before": drawn_before, "tasks_drawn_after": self._tasks_drawn.count}
        self.record.touch(cursor=cursor)
        if self._flush is not None and not await self._flush(CURSOR_FLUSH_SECONDS):
            log.error("the task cursor is not stored yet; a coordinator restart now could misplace it", step=step)

    def _recovered_tasks_drawn(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """Tasks drawn before step weight_version + 1, from the persisted cursor or the checkpoint."""
        version, cursor = loaded.weight_version, self.record.cursor
        if cursor.get("step") == version + 1:
            return int(cursor["tasks_drawn_before"])
        if cursor.get("step") == version:
            return int(cursor["tasks_drawn_after"])
        if loaded.resumed_from:
            return int(json.loads(loaded.data_state or "{}").get("tasks_drawn", 0))
        if version == 0:
            return 0
        raise RuntimeError(
            f"the trainer stands at step {version}, but the stored task cursor is at step {cursor.get('step')} "
            "and no checkpoint says where the task stream was"
        )

    async def _resume(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """The step the trainer stands at; on a resume, move the task stream to where it was."""
        # Counting the tasks drawn is what a checkpoint records as the data position.
        self.collector.tasks = self._tasks_drawn = CountingIterator(self.collector.tasks)
        if self.recovering:
            drawn = self._recovered_tasks_drawn(loaded)
        elif not loaded.resumed_from:
            return 0
        else:
            drawn = int(json.loads(loaded.data_state or "{}").get("tasks_drawn", 0))
        for _ in range(drawn):
            next(self._tasks_drawn)
        # The buffer's clock (age bound, puts from the future) starts at the resumed version.
        await self.stubs.buffer.AckGroups(
            buffer_pb2.AckGroupsRequest(job_id=self.record.job_id, weight_version=loaded.weight_version), timeout=10
        )
        kind = "recover" if self.recovering else "resume"
        self.folder.append(kind, loaded.weight_version, {"tasks_drawn": float(drawn)})
        log.info(
            kind,
            checkpoint=loaded.resumed_from,
            step=loaded.weight_version,
            stored_step=self.record.step,
            tasks_drawn=drawn,
        )
        self.record.touch(step=loaded.weight_version, weight_version=loaded.weight_version)
        return loaded.weight_version

    async def _validate(self, step: int, tasks) -> None:
        self._phase("validating")
        values = await self.collector.validate(tasks, self.record.weight_version)
        self._validated = (step, values)
        self.folder.append("validation", step, values)
        self.record.touch(validation_metrics=values)
        log.info("validation", step=step, pass_rate=round(values["pass_rate"], 4))

    async def _checkpoint(self, step: int) -> None:
        self._phase("checkpointing")
        # Only a validation of this very step ranks the checkpoint; an older one would flatter it.
        measured, values = self._validated
        reply = await self.stubs.trainer.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(
                job_id=self.record.job_id,
                metrics=values if measured == step else {},
                data_state=json.dumps({"tasks_drawn": self._tasks_drawn.count}),
            ),
            timeout=self._slow,
        )
        log.info("checkpoint saved", path=reply.path, step=reply.step, removed=len(reply.removed))

    async def _buffer_metrics(self) -> dict[str, float]:
        stats = await self.stubs.buffer.GetStats(buffer_pb2.GetStatsRequest(job_id=self.record.job_id), timeout=10)
        metrics = {
            f"buffer_{name}": float(getattr(stats, name))
            for name in ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts", "reclaimed")
        }
        metrics["buffer_put_rate"] = stats.put_rate
        metrics["buffer_sample_rate"] = stats.sample_rate
        metrics.update({f"buffer_age_{age}": float(count) for age, count in sorted(stats.age_histogram.items())})
        return metrics

    async def _cleanup(self) -> None:
        job_id = self.record.job_id
        for unload in (
            self.stubs.trainer.UnloadPolicy(trainer_pb2.UnloadPolicyRequest(job_id=job_id), timeout=30),
            self.stubs.rollout.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=job_id), timeout=30),
        ):
            try:
                await unload
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.warning("unload failed", code=exc.code().name, error=exc.details())
        try:
            self.folder.append("buffer", self.record.step, await self._buffer_metrics())
            await self.stubs.buffer.CloseJob(buffer_pb2.CloseJobRequest(job_id=job_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("buffer cleanup failed", code=exc.code().name, error=exc.details())
        if self.config.logger.plot:
            try:
                await asyncio.to_thread(self.folder.plot)
            except Exception:
                log.exception("plot failed")
