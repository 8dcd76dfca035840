"""One job's loop, driven from the coordinator: synchronous or asynchronous GRPO, or SFT.

    wait for a rollout replica and a sandbox worker ─> load policy (trainer ‖ every alive replica;
    the trainer may resume at step k) ─> weights vk ─> [validate]
    sync:  for step in k+1..max_num_steps:
               SyncProducer.collect_step ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    async: AsyncProducer puts groups without pause; for step in k+1..max_num_steps:
               wait for a step's fresh groups ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    sft:   for step in k+1..sft.max_num_steps: SupervisedStep ─> [weight sync ─> validate] [checkpoint]
    the last step validates (val_at_end) and checkpoints ─> SUCCEEDED

The runner only runs these loops and the job's lifecycle; the parts it builds
for the job, each taking what it needs in its constructor and none reaching
into another's fields:

    task_stream.TaskStream    the seeded stream of training tasks, counted as drawn
    producer.GroupIds         the one rule for group ids and seeds (run number after a trainer restart)
    collector.Collector       task ─> Generate ─> sandbox verdicts ─> rewards ─> Group ─> JobBuffer.put
    producer.SyncProducer / AsyncProducer    which tasks become groups, and when
    job_buffer.JobBuffer      the job's buffer calls (open, rewind, clock, put with backoff, stats, close)
    trainer_client.TrainerClient   the trainer calls; retries while it is unreachable; TrainerRestarted
    weight_sync.WeightSync    replica loading and admission, the routing version, weight sync with retry
    recovery.Recovery         resume at start, trainer-restart recovery, coordinator-restart cursor
    step_metrics.StepMetrics  buffer, fleet and collection metrics of a step; run_folder.RunFolder writes them
    monitoring.trackers.Trackers   the enabled experiment trackers, fed every record the RunFolder writes
    monitoring.signatures.Monitor  failure signatures over the recent steps: logged when they start and
                              end, flagged in the step's metrics (signature_<name>), listed on the job

Data flows: the producer draws tasks and ids and hands groups to the collector,
which routes through WeightSync (required version, admit) and puts through
JobBuffer; TrainerClient's replies feed the loop, WeightSync and Recovery;
metrics go to the RunFolder (and through it the trackers) and the job record;
curves.png is redrawn at most every PLOT_PERIOD_SECONDS while the job runs.

Guarantees: in sync mode generation for step s uses the weights of version
s − 1 (a replica is routed to only at the current version); in async mode
every trained group is within max_trajectory_age_steps of the trainer (the
buffer drops older ones, counted) and any loaded, synced replica generates.
A checkpoint carries the validation metrics of its step (they rank it for
top-k retention) and the number of training tasks drawn. A trainer restart is
recovered whichever call finds it (recovery.py). Every finished group's
outcome goes to groups.jsonl. The job ends FAILED with the cause in its
message on any other error, CANCELLED on CancelJob, and every policy is
unloaded either way; only then does the job become SUCCEEDED or FAILED, so a
client that sees a finished job finds its run folder complete.
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

from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.jobs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED
from dockyard.monitoring.signatures import Monitor, Signature
from dockyard.monitoring.trackers import Trackers
from dockyard.rpc.auth import AuthSettings
from dockyard.tasks.demonstrations import batch_at, load_demonstrations
from dockyard.tasks.task import Task
from services.coordinator.collector import Collector
from services.coordinator.fleet import ROLLOUT, Fleet
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.jobs import JobRecord
from services.coordinator.producer import AsyncProducer, GroupIds, SyncProducer
from services.coordinator.recovery import Recovery
from services.coordinator.run_folder import RunFolder
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step_metrics import StepMetrics, collected, phase_seconds
from services.coordinator.task_stream import TaskStream, load_tasks
from services.coordinator.trainer_client import TrainerClient, TrainerRestarted
from services.coordinator.weight_sync import WeightSync
from services.coordinator.weight_sync_groups import WeightSyncGroups

log = structlog.get_logger()
# curves.png is redrawn after a step at most this often (and once more at the end).
PLOT_PERIOD_SECONDS = 10.0


@dataclass
class Stubs:
    """The trainer and buffer services, and the fleet of rollout replicas and sandbox workers."""

    trainer: trainer_pb2_grpc.TrainerServiceStub
    buffer: buffer_pb2_grpc.BufferServiceStub
    fleet: Fleet


class JobRunner:
    def __init__(
        self,
        record: JobRecord,
        stubs: Stubs,
        settings: CoordinatorSettings,
        groups: WeightSyncGroups | None = None,
        *,
        recovering: bool = False,
        flush: Callable[[float], Awaitable[bool]] | None = None,
        tasks: dict[str, list[Task]] | None = None,
    ) -> None:
        self.record, self.settings = record, settings
        cfg = self.config = record.config
        grpo = cfg.grpo
        self.fleet = stubs.fleet
        self.trackers = Trackers(cfg.logger, Path(record.run_dir), record.job_id, cfg.model_dump(mode="json"))
        self.folder = RunFolder(Path(record.run_dir), self.trackers)
        self.monitor = Monitor(cfg.logger.signatures)
        self._plotted: tuple[float, asyncio.Future | None] = (0.0, None)
        self.recovering = recovering
        # Tasks read at submit (CreateJob checks the data there), else read here (a recovered job).
        self._val_tasks = tasks["validation"] if tasks else None
        train_tasks = tasks["train"] if tasks else load_tasks(cfg, "train")
        self.tasks = TaskStream(train_tasks, grpo.seed)
        self.ids = GroupIds(record.job_id, grpo.seed)
        # Synchronous GRPO trains at age 0 only: the buffer drops anything older (a resumed run's leftovers).
        max_age = grpo.max_trajectory_age_steps if grpo.async_grpo.enabled else 0
        self.buffer = JobBuffer(
            stubs.buffer,
            record.job_id,
            max_groups=grpo.buffer_capacity,
            max_age_steps=max_age,
            recovery_timeout=settings.recovery_timeout_seconds,
            published=lambda: record.weight_version,
        )
        self.trainer = TrainerClient(
            stubs.trainer,
            record.job_id,
            cfg,
            record.config_yaml,
            timeout=settings.train_timeout_seconds,
            recovery_timeout=settings.recovery_timeout_seconds,
        )
        self.weights = WeightSync(
            record.job_id,
            record.config_yaml,
            self.fleet,
            self.trainer,
            groups,
            timeout=settings.train_timeout_seconds,
            on_policy=not grpo.async_grpo.enabled,
            wait_timeout=settings.fleet_wait_timeout_seconds,
        )
        self.collector = Collector(
            record.job_id,
            cfg,
            self.fleet,
            self.buffer,
            self.weights,
            max_generations=settings.max_concurrent_generations,
            max_scoring=settings.max_concurrent_scoring,
            generate_timeout=settings.generate_timeout_seconds,
            max_regenerations=settings.max_regenerations,
            max_scoring_attempts=settings.max_scoring_attempts,
            max_invalid_fraction=settings.max_invalid_fraction,
            wait_timeout=settings.fleet_wait_timeout_seconds,
            on_group=self.folder.record_group,
            endpoint_address=settings.endpoint_address,
            endpoint_token=AuthSettings().token or "",
            task_ids=[task.task_id for task in train_tasks],
        )
        self.sync_producer = SyncProducer(self.collector, self.tasks, self.ids, grpo)
        self.async_producer = AsyncProducer(
            self.collector, self.buffer, self.tasks, self.ids, grpo, patience=settings.generate_timeout_seconds
        )
        self.recovery = Recovery(
            record,
            self.trainer,
            self.buffer,
            self.weights,
            self.tasks,
            self.ids,
            self.folder,
            recovering=recovering,
            checkpointing=cfg.checkpointing.enabled,
            recovery_timeout=settings.recovery_timeout_seconds,
            flush=flush,
            phase=self._phase,
        )
        self.metrics = StepMetrics(self.fleet, self.collector, self.buffer, self.folder)
        self._validated: tuple[int, dict[str, float]] = (-1, {})

    def _phase(self, phase: str) -> None:
        self.record.touch(phase=phase)
        log.info("phase", phase=phase, step=self.record.step)

    async def run(self) -> None:
        """Train, then unload and close the books; only then does the job become SUCCEEDED or FAILED."""
        record = self.record
        structlog.contextvars.bind_contextvars(job_id=record.job_id)
        outcome, message = SUCCEEDED, ""
        try:
            if record.state == PENDING:
                record.transition(RUNNING)
            if self.recovering and record.phase == "done":
                # The loop had ended before the restart; only the books were left to close.
                log.info("recovered a job whose training had ended; closing its books")
            else:
                await self._train()
                self._phase("done")
        except asyncio.CancelledError:
            outcome, message = CANCELLED, "cancelled by request"
            self._phase("cancelled")
        except Exception as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            where = f" ({exc.code().name})" if isinstance(exc, grpc.aio.AioRpcError) else ""
            log.exception("job failed", phase=record.phase)
            outcome, message = FAILED, f"{record.phase}{where}: {detail}"
        finally:
            await self._cleanup()
            if not record.finished:
                record.transition(outcome, message)

    async def _train(self) -> None:
        cfg = self.config
        await self.weights.wait_for_fleet(self.settings.fleet_wait_timeout_seconds, self._phase)
        self._phase("loading policy")
        await self.buffer.open()
        # Recovering: a trainer that still holds the job answers its state; one that restarted resumes.
        loaded, _ = await asyncio.gather(
            self.trainer.load(resume=self.recovering), self.weights.load_replicas(self.fleet.alive(ROLLOUT))
        )
        start = await self.recovery.resume(loaded)
        try:
            await self.weights.sync(start)
        except TrainerRestarted as exc:  # no checkpoint yet is fine: the resume starts afresh
            await self.recovery.recover_trainer(exc)
            start = self.record.step
        val_tasks = self._val_tasks if self._val_tasks is not None else load_tasks(cfg, "validation")
        if cfg.sft is not None:
            await self._train_sft(start, val_tasks)
            return
        if cfg.grpo.val_at_start and start == 0:
            await self._validate(0, val_tasks)
        if start < cfg.grpo.max_num_steps:
            loop = self._train_async if cfg.grpo.async_grpo.enabled else self._train_sync
            await loop(start, val_tasks)  # the last step validates and checkpoints
        elif cfg.checkpointing.enabled:
            # Recovered after the last step trained: its checkpoint may not have been saved.
            await self._checkpoint(start)

    async def _train_sync(self, start: int, val_tasks: list[Task]) -> None:
        step = start + 1
        while step <= self.config.grpo.max_num_steps:
            t0 = time.perf_counter()
            self._phase("generating")
            drawn = self.tasks.drawn
            stats = await self.sync_producer.collect_step(step)
            await self.recovery.mark_cursor(step, drawn)
            t1 = time.perf_counter()
            try:
                reply, t2, t3, transfer = await self._train_and_sync(step)
                metrics = {
                    **reply.metrics,
                    **collected(stats),
                    **phase_seconds("generate_score_seconds", t0, t1, t2, t3, transfer),
                    "generated_tokens_per_second": stats.generated_tokens / max(t1 - t0, 1e-9),
                }
                await self._end_step(step, reply.weight_version, metrics, val_tasks)
            except TrainerRestarted as exc:
                await self.recovery.recover_trainer(exc)
                step = self.record.step + 1  # go on from the checkpoint it resumed
                continue
            step += 1

    async def _train_async(self, start: int, val_tasks: list[Task]) -> None:
        producer = self.async_producer
        try:
            step, started = start + 1, time.perf_counter()
            while step <= self.config.grpo.max_num_steps:
                t0 = time.perf_counter()
                producer.start()  # again after the last step, when a trainer restart sent it back
                self._phase("waiting for groups")
                await producer.wait_for_groups()
                await self.recovery.mark_cursor(step, self.tasks.drawn)
                t1 = time.perf_counter()
                try:
                    reply, t2, t3, transfer = await self._train_and_sync(step)
                    stats = producer.take_stats()
                    metrics = {
                        **reply.metrics,
                        **collected(stats),
                        "failed_groups": float(stats.failed),
                        **phase_seconds("wait_for_groups_seconds", t0, t1, t2, t3, transfer),
                        "generated_tokens_per_second": stats.generated_tokens / max(t3 - t0, 1e-9),
                        "elapsed_seconds": t3 - started,
                    }
                    if step == self.config.grpo.max_num_steps:
                        await producer.stop()  # the final validation and checkpoint need no more groups
                    await self._end_step(step, reply.weight_version, metrics, val_tasks)
                except TrainerRestarted as exc:
                    await self.recovery.recover_trainer(exc)
                    step = self.record.step + 1
                    continue
                step += 1
        finally:
            await producer.stop()

    async def _train_sft(self, start: int, val_tasks: list[Task]) -> None:
        """A supervised job: demonstrations of the training tasks (or of sft.dataset), same validation
        and checkpoints."""
        cfg, sft = self.config, self.config.sft
        dataset = None
        if sft.dataset is not None:
            dataset = await asyncio.to_thread(load_demonstrations, sft.dataset, cfg.policy)
        if sft.val_at_start and start == 0:
            await self._validate(0, val_tasks)
        for step in range(start + 1, sft.max_num_steps + 1):
            t0 = time.perf_counter()
            self._phase("training")
            drawn = self.tasks.drawn
            if dataset is None:
                pairs = [(t.prompt, t.solution) for t in (next(self.tasks) for _ in range(sft.batch_size))]
            else:
                pairs = batch_at(dataset, step, sft.batch_size, cfg.data.train.seed)
            demos = [trainer_pb2.Demonstration(prompt=prompt, completion=completion) for prompt, completion in pairs]
            await self.recovery.mark_cursor(step, drawn)
            reply = await self.trainer.supervised_step(step, demos)
            metrics = {**reply.metrics, "step_seconds": time.perf_counter() - t0}
            self.folder.append("train", step, metrics)
            self.record.touch(step=step, weight_version=reply.weight_version, metrics=metrics)
            self._replot()
            last = step == sft.max_num_steps
            if (sft.val_period and step % sft.val_period == 0 and not last) or (last and sft.val_at_end):
                # Validation generates with the rollout: it needs this step's weights.
                self._phase("syncing weights")
                await self.weights.sync(reply.weight_version)
                await self._validate(step, val_tasks)
            if cfg.checkpointing.enabled and (
                last or (cfg.checkpointing.save_period and step % cfg.checkpointing.save_period == 0)
            ):
                await self._checkpoint(step)

    async def _train_and_sync(self, step: int) -> tuple[trainer_pb2.TrainStepResponse, float, float, float]:
        """TrainStep, then the weight sync of its version: the reply, when each of the two ended
        (perf_counter), and the seconds of the transfer itself."""
        self._phase("training")
        reply = await self.trainer.train_step(step)
        trained = time.perf_counter()
        self._phase("syncing weights")
        transfer = await self.weights.sync(reply.weight_version)
        return reply, trained, time.perf_counter(), transfer

    async def _end_step(self, step: int, version: int, metrics: dict[str, float], val_tasks: list[Task]) -> None:
        cfg = self.config
        metrics.update(await self.metrics.buffer())
        metrics.update(self.metrics.fleet(step))
        metrics.update(await self.metrics.endpoint())
        active = self.monitor.observe(metrics)
        if cfg.logger.signatures.enabled:
            metrics.update(Monitor.flags(active))
            self._warn(step, active)
        self.folder.append("train", step, metrics)
        self.folder.record_samples(step, self.collector.samples.take())
        self.folder.record_trials(step, self.collector.take_trials())
        warnings = [f"{s.name}: {s.message}" for s in active]
        self.record.touch(step=step, weight_version=version, metrics=metrics, warnings=warnings)
        self._replot()
        last = step == cfg.grpo.max_num_steps
        if (last and cfg.grpo.val_at_end) or (cfg.grpo.val_period and step % cfg.grpo.val_period == 0):
            await self._validate(step, val_tasks)
        if cfg.checkpointing.enabled and (
            last or (cfg.checkpointing.save_period and step % cfg.checkpointing.save_period == 0)
        ):
            await self._checkpoint(step)

    def _warn(self, step: int, active: list[Signature]) -> None:
        """Log a signature when it starts and when it ends; the job lists those active now."""
        before = {w.split(":", 1)[0] for w in self.record.warnings}
        now = {s.name for s in active}
        for signature in active:
            if signature.name not in before:
                log.warning("failure signature", signature=signature.name, step=step, detail=signature.message)
        for name in before - now:
            log.info("failure signature cleared", signature=name, step=step)

    def _replot(self) -> None:
        """Redraw curves.png off the loop, unless one is being drawn or the last is recent."""
        at, pending = self._plotted
        if not self.config.logger.plot or (pending is not None and not pending.done()):
            return
        if time.monotonic() - at >= PLOT_PERIOD_SECONDS:
            self._plotted = (time.monotonic(), asyncio.ensure_future(asyncio.to_thread(self.folder.plot)))

    async def _validate(self, step: int, tasks: list[Task]) -> None:
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
        reply = await self.trainer.save_checkpoint(
            values if measured == step else {}, json.dumps({"tasks_drawn": self.tasks.drawn})
        )
        log.info("checkpoint saved", path=reply.path, step=reply.step, removed=len(reply.removed))

    async def _cleanup(self) -> None:
        await self.collector.close()
        unloads = await asyncio.gather(self.trainer.unload(), self.weights.unload_replicas(), return_exceptions=True)
        trainer_unload = unloads[0]
        if isinstance(trainer_unload, grpc.aio.AioRpcError) and trainer_unload.code() != grpc.StatusCode.NOT_FOUND:
            log.warning("unload failed", code=trainer_unload.code().name, error=trainer_unload.details())
        try:
            self.folder.append("buffer", self.record.step, await self.metrics.buffer())
            await self.buffer.close()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("buffer cleanup failed", code=exc.code().name, error=exc.details())
        _, pending = self._plotted
        try:
            if pending is not None:
                await pending
            if self.config.logger.plot:
                await asyncio.to_thread(self.folder.plot)
        except Exception:
            log.exception("plot failed")
        await asyncio.to_thread(self.trackers.close)
