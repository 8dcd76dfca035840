"""One job's GRPO loop, driven from the coordinator: synchronous (on-policy) or asynchronous.

    wait for a rollout replica and a sandbox worker ─> load policy (trainer, every alive replica;
    the trainer may resume at step k) ─> weights vk ─> [validate]
    sync:  for step in k+1..max_num_steps:
               collect (generate ─> score ─> buffer) ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    async: a producer generates, scores and puts groups without pause (one step's groups in flight,
           at most max_trajectory_age_steps steps' groups ahead of the trainer); for step in k+1..max_num_steps:
               wait for a step's fresh groups ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    the last step validates (val_at_end) and checkpoints ─> SUCCEEDED

Guarantees: in sync mode generation for step s uses the weights of version
s − 1 (a replica is routed to only at the current version); in async mode
every trained group is within max_trajectory_age_steps of the trainer (the
buffer drops older ones, counted) and any loaded, synced replica generates.
Every replica that took part in a sync holds exactly the trainer's weights
(the checksums must agree); a replica that registers later is loaded and
joins the next sync (or is synced at once when no replica is ready), and only
then gets work; a replica that died in a sync is dropped and the sync tried
again without it. A checkpoint carries the validation metrics of its step (they rank it
for top-k retention) and the number of training tasks drawn, so a resumed job
draws the same tasks an uninterrupted one would. A trainer that restarts is
waited for: it resumes from the job's latest checkpoint, the buffer's clock
is rewound to its version, group ids take a new run number (`<job>/r<n>/...`)
so the resumed run never collides with acked ids, and the job goes on;
this holds whichever trainer call finds the restart (TrainStep, the weight
sync, SaveCheckpoint). A buffer or trainer that is unreachable is retried
until recovery_timeout_seconds. Every finished group's outcome goes to groups.jsonl.
The job ends FAILED with the cause in its message on any other error,
CANCELLED on CancelJob, and every policy is unloaded either way.

Recovery (a runner started by a restarted coordinator for a job it had): the
step is the trainer's weight_version as LoadPolicy reports it, never the
persisted step (a TrainStep whose reply was lost is not trained again); the
task stream, the group index and the run number continue from the persisted
cursor (`_mark_cursor`), which is stored before each TrainStep, so it always
names the step the trainer stands at or the one after.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import structlog

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.rpc.client import channel_health
from services.coordinator.collector import Collector, CollectStats, NoReplica, load_tasks
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet, Member
from services.coordinator.jobs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, JobRecord
from services.coordinator.metrics import RunFolder
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.sync_groups import SideGroupRegistry

log = structlog.get_logger()
T = TypeVar("T")

# A weight sync that failed on the side group is tried this many times in all.
SYNC_ATTEMPTS = 2
# Errors of a service that is restarting or briefly unreachable: retried, not fatal.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How often an asynchronous producer that is far enough ahead looks whether the trainer took groups.
PRODUCER_POLL_SECONDS = 0.2
# How long a step waits for its cursor to be stored; a store that is down delays, never stops, a job.
CURSOR_FLUSH_SECONDS = 5.0


@dataclass
class Stubs:
    """The fixed services, the fleet of rollout replicas and sandbox workers, and the side groups."""

    trainer: trainer_pb2_grpc.TrainerServiceStub
    buffer: buffer_pb2_grpc.BufferServiceStub
    fleet: Fleet


class TrainerRestarted(Exception):
    """The trainer lost the job's policy (a new process answered NOT_FOUND, or holds an older
    version after a failed sync): recovery loads it again and the job goes on from its version."""


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
        sync_groups: SideGroupRegistry | None = None,
        *,
        recovering: bool = False,
        flush: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        self.record = record
        self.recovering = recovering  # started by a restarted coordinator for a job it had
        self._rewind = False  # recovering onto a trainer that went back to an older checkpoint
        self._flush = flush
        self.stubs = stubs
        self.settings = settings
        self.config = record.config
        self.folder = RunFolder(Path(record.run_dir))
        self.fleet = stubs.fleet
        self.collector = Collector(
            record.job_id,
            record.config,
            stubs.fleet,
            stubs.buffer,
            max_generations=settings.max_concurrent_generations,
            max_scoring=settings.max_concurrent_scoring,
            generate_timeout=settings.generate_timeout_seconds,
            max_regenerations=settings.max_regenerations,
            max_scoring_attempts=settings.max_scoring_attempts,
            wait_timeout=settings.fleet_wait_timeout_seconds,
        )
        self.collector.admit = self._admit_replicas
        self._sync_lock = asyncio.Lock()
        # Replicas whose LoadPolicy for this job succeeded, by name -> fleet incarnation.
        self._loaded: dict[str, int] = {}
        # The collector's fleet counters at the last step's end.
        self._fleet_counts = (0, 0)
        self.sync_groups = sync_groups
        self.collector.on_group = self.folder.record_group
        self._slow = settings.train_timeout_seconds
        self._validated: tuple[int, dict[str, float]] = (-1, {})
        self._tasks_drawn = CountingIterator(iter(()))
        self.run_number = 0  # trainer restarts survived so far
        self._trained_to = 0  # the trainer's version after its last TrainStep
        # Asynchronous mode: the producer's counters since the last step, its last error, its wake-up.
        self._group_index = 0
        self._produced = CollectStats()
        self._producer_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._delivered = asyncio.Event()

    def _phase(self, phase: str) -> None:
        self.record.touch(phase=phase)
        log.info("phase", phase=phase, step=self.record.step)

    async def run(self) -> None:
        """Train, then unload and close the books; only then does the job become SUCCEEDED or FAILED,
        so a client that sees a finished job finds its run folder complete."""
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
        cfg, record, stubs = self.config, self.record, self.stubs
        await self._wait_for_fleet()
        self._phase("loading policy")
        await self._open_buffer()
        yaml_text = record.config_yaml
        # Recovering: a trainer that still holds the job answers its state; one that restarted resumes.
        trainer_yaml = self._resuming_yaml() if self.recovering and cfg.checkpointing.enabled else yaml_text
        loaded, _ = await asyncio.gather(
            stubs.trainer.LoadPolicy(
                trainer_pb2.LoadPolicyRequest(job_id=record.job_id, config_yaml=trainer_yaml), timeout=self._slow
            ),
            self._load_replicas(self.fleet.alive(ROLLOUT)),
        )
        start = await self._resume(loaded)
        try:
            await self._sync_weights(start)
        except TrainerRestarted as exc:  # no checkpoint yet is fine: the resume starts afresh
            await self._recover_trainer(exc)
            start = self.record.step
        val_tasks = load_tasks(cfg, "validation")
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

    async def _train_sync(self, start: int, val_tasks) -> None:
        step = start + 1
        while step <= self.config.grpo.max_num_steps:
            t0 = time.perf_counter()
            self._phase("generating")
            drawn = self._tasks_drawn.count
            stats = await self.collector.collect_step(step)
            await self._mark_cursor(step, drawn)
            t1 = time.perf_counter()
            try:
                reply, t2, t3, sync_seconds = await self._train_and_sync(step)
                metrics = {
                    **reply.metrics,
                    **self._collect_metrics(stats),
                    **_phase_seconds("generate_score_seconds", t0, t1, t2, t3, sync_seconds),
                    "generated_tokens_per_second": stats.generated_tokens / max(t1 - t0, 1e-9),
                }
                await self._end_step(step, reply.weight_version, metrics, val_tasks)
            except TrainerRestarted as exc:
                await self._recover_trainer(exc)
                step = self.record.step + 1  # go on from the checkpoint it resumed
                continue
            step += 1

    async def _train_async(self, start: int, val_tasks) -> None:
        producer = asyncio.create_task(self._produce())
        try:
            step, started = start + 1, time.perf_counter()
            while step <= self.config.grpo.max_num_steps:
                t0 = time.perf_counter()
                if producer.cancelled():  # stopped for the last step, which a trainer restart sent back
                    producer = asyncio.create_task(self._produce())
                self._phase("waiting for groups")
                await self._wait_for_groups(producer)
                await self._mark_cursor(step, self._tasks_drawn.count)
                t1 = time.perf_counter()
                try:
                    reply, t2, t3, sync_seconds = await self._train_and_sync(step)
                    stats, self._produced = self._produced, CollectStats()
                    metrics = {
                        **reply.metrics,
                        **self._collect_metrics(stats),
                        "failed_groups": float(stats.failed),
                        **_phase_seconds("wait_for_groups_seconds", t0, t1, t2, t3, sync_seconds),
                        "generated_tokens_per_second": stats.generated_tokens / max(t3 - t0, 1e-9),
                        "elapsed_seconds": t3 - started,
                    }
                    if step == self.config.grpo.max_num_steps:
                        await _stop(producer)  # the final validation and checkpoint need no more groups
                    await self._end_step(step, reply.weight_version, metrics, val_tasks)
                except TrainerRestarted as exc:
                    await self._recover_trainer(exc)
                    step = self.record.step + 1
                    continue
                step += 1
        finally:
            await _stop(producer)

    async def _produce(self) -> None:
        """Generate, score and put groups without pause: one step's worth in flight at most, and
        at most max_trajectory_age_steps steps' worth ahead of the trainer (held in the buffer or
        in flight), since groups further ahead would age out before the trainer could take them."""
        grpo = self.config.grpo
        slots = asyncio.Semaphore(grpo.num_prompts_per_step)
        ahead = grpo.num_prompts_per_step * max(grpo.max_trajectory_age_steps, 1)
        running: set[asyncio.Task] = set()

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            slots.release()

        try:
            while True:
                await slots.acquire()
                await self._until_fewer_ahead(ahead, lambda: len(running))
                index, self._group_index = self._group_index, self._group_index + 1
                group_id = f"{self.collector.id_prefix}/g{index}"
                one = asyncio.create_task(
                    self._produce_one(next(self.collector.tasks), group_id, grpo.seed * 1_000_003 + index)
                )
                running.add(one)
                one.add_done_callback(finished)
        finally:
            for one in running:
                one.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _until_fewer_ahead(self, ahead: int, in_flight: Callable[[], int]) -> None:
        """Until the buffer's held groups plus those in flight are fewer than `ahead`; the trainer
        taking a step's groups makes room. A buffer that is restarting does not hold this up:
        its puts wait it out."""
        while True:
            stats = await self._buffer_stats()
            if stats is None or stats.held + in_flight() < ahead:
                return
            await asyncio.sleep(PRODUCER_POLL_SECONDS)

    async def _produce_one(self, task, group_id: str, seed: int) -> None:
        try:
            group = await self.collector.make_group(task, group_id, seed)
            await self.collector.deliver(group, self._produced)
            self._delivered.set()
        except asyncio.CancelledError:
            raise
        except RuntimeError as exc:  # the sandbox refused the job's own request: no retry helps
            self._fatal = exc
            self._delivered.set()
        except Exception as exc:  # noqa: BLE001 - one group's failure is counted, the job goes on
            self._produced.failed += 1
            self._producer_error = exc
            self.collector.on_group(group_id, "failed", -1)
            log.warning("a group failed; it is counted and not retried", group=group_id, error=str(exc))
            await asyncio.sleep(1.0)  # keep a failing fleet from spinning

    async def _wait_for_groups(self, producer: asyncio.Task) -> None:
        """Until the buffer holds a step's worth of groups; fail if the producer stalls."""
        need = self.config.grpo.num_prompts_per_step
        patience = self.settings.generate_timeout_seconds
        last_held, deadline = -1, time.monotonic() + patience
        while True:
            if producer.done():
                producer.result()
            if self._fatal is not None:
                raise self._fatal
            stats = await self._buffer_stats()
            held = -1 if stats is None else stats.held  # -1: the buffer is restarting
            if held >= need:
                return
            if held != last_held:
                last_held, deadline = held, time.monotonic() + patience
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"the buffer has held {held} of the {need} groups a step needs for {patience:.0f} s; "
                    f"last generation error: {self._producer_error}"
                )
            self._delivered.clear()
            try:
                await asyncio.wait_for(self._delivered.wait(), 1.0)
            except TimeoutError:
                pass

    async def _buffer_stats(self) -> buffer_pb2.GetStatsResponse | None:
        """The buffer's counters of the job; None while the buffer is restarting."""
        try:
            return await self.stubs.buffer.GetStats(buffer_pb2.GetStatsRequest(job_id=self.record.job_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _TRANSIENT:
                raise
            return None

    def _collect_metrics(self, stats: CollectStats) -> dict[str, float]:
        return {
            "groups": float(stats.groups),
            "invalid_trajectories": float(stats.invalid),
            "dropped_uniform_groups": float(stats.dropped_uniform),
            "dropped_stale_on_put": float(stats.dropped_stale),
            **{f"verdict_{name}": float(count) for name, count in stats.verdicts.items()},
        }

    async def _end_step(self, step: int, version: int, metrics: dict[str, float], val_tasks) -> None:
        cfg = self.config
        metrics.update(await self._buffer_metrics())
        metrics.update(self.fleet_metrics(step))
        self.folder.append("train", step, metrics)
        self.record.touch(step=step, weight_version=version, metrics=metrics)
        last = step == cfg.grpo.max_num_steps
        if (last and cfg.grpo.val_at_end) or (cfg.grpo.val_period and step % cfg.grpo.val_period == 0):
            await self._validate(step, val_tasks)
        if cfg.checkpointing.enabled and (
            last or (cfg.checkpointing.save_period and step % cfg.checkpointing.save_period == 0)
        ):
            await self._checkpoint(step)

    async def _train_and_sync(self, step: int) -> tuple[trainer_pb2.TrainStepResponse, float, float, float]:
        """TrainStep, then the weight sync of its version: the reply, when each of the two ended
        (perf_counter), and the seconds of the transfer itself."""
        self._phase("training")
        reply = await self._train_step(step)
        trained = time.perf_counter()
        self._phase("syncing weights")
        transfer = await self._sync_weights(reply.weight_version)
        return reply, trained, time.perf_counter(), transfer

    async def _train_step(self, step: int) -> trainer_pb2.TrainStepResponse:
        reply = await self._call_trainer(
            "TrainStep",
            lambda: self.stubs.trainer.TrainStep(
                trainer_pb2.TrainStepRequest(job_id=self.record.job_id, step=step), timeout=self._slow
            ),
        )
        self._trained_to = reply.weight_version
        return reply

    async def _call_trainer(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """A trainer call, tried again while the trainer or the buffer is unreachable (up to
        recovery_timeout_seconds); TrainerRestarted when a new trainer process answers NOT_FOUND."""
        deadline = time.monotonic() + self.settings.recovery_timeout_seconds
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise TrainerRestarted(f"{what}: {exc.details()}") from exc
                if exc.code() not in _TRANSIENT or time.monotonic() > deadline:
                    raise
                log.warning("trainer call unavailable; retrying", call=what, error=exc.details())
            await asyncio.sleep(1.0)

    async def _recover_trainer(self, cause: TrainerRestarted) -> None:
        """A restarted trainer: load the policy from the job's latest checkpoint and go on from its
        step. A trainer that restarts again meanwhile is recovered in turn, up to recovery_timeout_seconds."""
        record = self.record
        self._phase("recovering trainer")
        deadline = time.monotonic() + self.settings.recovery_timeout_seconds
        while True:
            log.warning("the trainer restarted; recovering", found_by=str(cause), step=record.step)
            try:
                await self._resume_trainer()
                return
            except TrainerRestarted as again:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the trainer kept restarting for {self.settings.recovery_timeout_seconds:.0f} s"
                    ) from again
                cause = again

    async def _resume_trainer(self) -> None:
        cfg, record = self.config, self.record
        self.run_number += 1
        self.collector.id_prefix = f"{record.job_id}/r{self.run_number}"
        loaded = await self._load_trainer()
        version = loaded.weight_version
        if not cfg.checkpointing.enabled and version != self._trained_to:
            raise RuntimeError(
                f"the trainer restarted and lost the policy of step {self._trained_to}; the job keeps no "
                "checkpoints (checkpointing.enabled=false), so there is nothing to resume from"
            )
        # The versions after the checkpoint were lost: the resumed weights generate at `version`.
        await self._open_buffer(rewind_to=version)
        if self.sync_groups is not None and record.job_id in self.sync_groups:
            self.sync_groups.reform(record.job_id)  # the old group's store died with the trainer
        await self._sync_weights(version)
        lost = max(self._trained_to, record.step) - version
        self.folder.append("recovery", version, {"steps_lost": float(lost), "run_number": float(self.run_number)})
        log.warning("trainer restarted; resumed", checkpoint=loaded.resumed_from, step=version, steps_lost=lost)
        record.touch(step=version, weight_version=version)
        self._trained_to = version

    async def _load_trainer(self) -> trainer_pb2.LoadPolicyResponse:
        """LoadPolicy after a (possible) restart: a trainer that kept the policy answers its state
        unchanged; a new one loads it, from the latest checkpoint when the job keeps them."""
        record = self.record
        yaml_text = self._resuming_yaml() if self.config.checkpointing.enabled else record.config_yaml
        return await self._call_trainer(
            "LoadPolicy",
            lambda: self.stubs.trainer.LoadPolicy(
                trainer_pb2.LoadPolicyRequest(job_id=record.job_id, config_yaml=yaml_text), timeout=self._slow
            ),
        )

    def _resuming_yaml(self) -> str:
        """The job's config asking a trainer that lost the policy to resume from the latest checkpoint."""
        cfg = self.config
        checkpointing = cfg.checkpointing.model_copy(
            update={"resume": True, "checkpoint_dir": str(cfg.checkpoint_folder(self.record.job_id))}
        )
        return cfg.model_copy(update={"checkpointing": checkpointing}).resolved_yaml()

    async def _open_buffer(self, rewind_to: int | None = None) -> None:
        grpo = self.config.grpo
        request = buffer_pb2.OpenJobRequest(
            job_id=self.record.job_id,
            max_groups=grpo.buffer_capacity,
            max_trajectory_age_steps=grpo.max_trajectory_age_steps,
        )
        if rewind_to is not None:
            request.rewind_to_version = rewind_to
        await self.stubs.buffer.OpenJob(request, timeout=30)

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

    async def _wait_for_fleet(self) -> None:
        """Until at least one rollout replica and one sandbox worker are alive, or FAILED after the timeout."""
        deadline = time.monotonic() + self.settings.fleet_wait_timeout_seconds
        for kind, what in ((ROLLOUT, "rollout replicas"), (SANDBOX, "sandbox workers")):
            while not self.fleet.alive(kind):
                self._phase(f"waiting for {what}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no {kind} member registered with the coordinator within "
                        f"{self.settings.fleet_wait_timeout_seconds:.0f}s: start {what} with "
                        f"DOCKYARD_{kind.upper()}_COORDINATOR_ADDRESS pointing at this coordinator"
                    )
                await self.fleet.changed(1.0)

    async def _load_replicas(self, replicas: list[Member]) -> list[Member]:
        """LoadPolicy on each replica not yet loaded (in this incarnation); those that answered."""
        job_id, yaml_text = self.record.job_id, self.record.config_yaml
        todo = [m for m in replicas if self._loaded.get(m.name) != m.incarnation]
        replies = await asyncio.gather(
            *(
                m.stub.LoadPolicy(
                    rollout_pb2.LoadPolicyRequest(job_id=job_id, config_yaml=yaml_text), timeout=self._slow
                )
                for m in todo
            ),
            return_exceptions=True,
        )
        for member, reply in zip(todo, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError) and reply.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise reply  # the replica refuses the job (bad config, missing model): fail it
            if isinstance(reply, BaseException):
                log.warning("replica did not load the policy", replica=member.name, error=str(reply))
                self.fleet.mark_failed(member)
                continue
            self._loaded[member.name] = member.incarnation
            log.info("replica loaded", replica=member.name)
        return [m for m in replicas if self._loaded.get(m.name) == m.incarnation]

    async def _admit_replicas(self) -> None:
        """Bring replicas that joined to the current version now (when none is ready to generate)."""
        version = self.record.weight_version
        if self._sync_lock.locked():
            return
        waiting = [m for m in self.fleet.alive(ROLLOUT) if m.versions.get(self.record.job_id) != version]
        if waiting:
            log.info("syncing replicas that joined", replicas=[m.name for m in waiting], version=version)
            try:
                await self._sync_weights(version, only=waiting)
            except (grpc.aio.AioRpcError, NoReplica, TrainerRestarted) as exc:
                # A trainer restart is found and recovered by the step loop's next trainer call.
                log.warning("replicas could not join yet", error=str(exc))

    async def _sync_weights(self, version: int, only: list[Member] | None = None) -> float:
        """Push `version` once from the trainer and receive it on every alive replica (or `only` these)
        at once; the side group is formed with exactly those replicas. A sync that failed on the side
        group (UNAVAILABLE) because replicas died is tried once more without them. One whose trainer
        side failed with every replica alive asks the trainer for the policy again (LoadPolicy) and
        is tried once more if it still holds `version`; otherwise TrainerRestarted."""
        job_id = self.record.job_id
        async with self._sync_lock:
            for attempt in range(1, SYNC_ATTEMPTS + 1):
                candidates = [m for m in (only or self.fleet.alive(ROLLOUT)) if self.fleet.usable(m)]
                # A replica that died since its last call would hold the whole side group up to its timeout.
                await self._drop_dead(candidates)
                replicas = await self._load_replicas([m for m in candidates if self.fleet.usable(m)])
                if not replicas:
                    raise NoReplica(f"no rollout replica alive to receive weight version {version}")
                if self.sync_groups is not None and job_id in self.sync_groups:
                    self.sync_groups.set_replicas(job_id, [m.name for m in replicas])
                # Every call runs to its end (return_exceptions) so a retry never overlaps a stale one.
                pushed, *received = await asyncio.gather(
                    self.stubs.trainer.PushWeights(trainer_pb2.PushWeightsRequest(job_id=job_id), timeout=self._slow),
                    *(
                        m.stub.ReceiveWeights(
                            rollout_pb2.ReceiveWeightsRequest(job_id=job_id, weight_version=version),
                            timeout=self._slow,
                        )
                        for m in replicas
                    ),
                    return_exceptions=True,
                )
                failures = [r for r in (pushed, *received) if isinstance(r, BaseException)]
                if not failures:
                    break
                retriable = await self._sync_retriable(version, pushed, failures, replicas)
                if attempt == SYNC_ATTEMPTS or not retriable:
                    raise failures[0]
                log.warning("weight sync failed; trying again", version=version, error=str(failures[0]))
            seconds = [pushed.seconds]
            # An asynchronous trainer may have stepped before the push of a join: those replicas hold
            # weights of another version than asked, and wait for the next sync instead of generating.
            labelled = pushed.weight_version == version
            if not labelled:
                log.warning("the trainer pushed another version; replicas join at the next sync", asked=version)
            for member, reply in zip(replicas, received, strict=True):
                if pushed.checksum != reply.checksum or reply.weight_version != version:
                    raise RuntimeError(
                        f"weight sync of version {version} is corrupt: trainer sent {pushed.checksum[:12]}, "
                        f"replica {member.name} holds {reply.checksum[:12]} at version {reply.weight_version}"
                    )
                if labelled:
                    self.fleet.set_version(member, job_id, version)
                seconds.append(reply.seconds)
            if self.config.grpo.async_grpo.enabled:
                self.collector.required_version = None
            else:
                self.collector.required_version = version
            return max(seconds)

    async def _sync_retriable(
        self, version: int, pushed, failures: list[BaseException], replicas: list[Member]
    ) -> bool:
        """After a failed sync: whether to try again (replicas that died are dropped first), or
        TrainerRestarted when the trainer lost the policy."""
        if isinstance(pushed, grpc.aio.AioRpcError) and pushed.code() == grpc.StatusCode.NOT_FOUND:
            raise TrainerRestarted(f"PushWeights: {pushed.details()}") from pushed
        dropped = await self._drop_dead(replicas)
        if isinstance(pushed, BaseException) and not dropped:
            # Every replica is alive, so the trainer's side failed: it may have died mid-sync. Ask it
            # again (LoadPolicy waits out a trainer that is still coming back).
            held = (await self._load_trainer()).weight_version
            if held != version:
                detail = pushed.details() if isinstance(pushed, grpc.aio.AioRpcError) else str(pushed)
                raise TrainerRestarted(
                    f"PushWeights failed with every replica alive ({detail}); the trainer now holds "
                    f"version {held}, not {version}"
                ) from pushed
            return True  # it kept the policy: the group broke for another reason
        return all(isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.UNAVAILABLE for f in failures)

    async def _drop_dead(self, replicas: list[Member]) -> int:
        """Replicas that no longer answer health checks leave routing and the group; how many did."""
        statuses = await asyncio.gather(*(channel_health(m.channel, timeout=2.0) for m in replicas))
        dropped = 0
        for member, status in zip(replicas, statuses, strict=True):
            if status != "SERVING":
                log.warning("replica dropped from the weight sync", replica=member.name, status=status)
                self.fleet.mark_failed(member)
                dropped += 1
        return dropped

    def fleet_metrics(self, step: int) -> dict[str, float]:
        """Per-replica generation records since the last call (written as "generation" records) and
        their totals, plus each sandbox worker's last reported queue."""
        timeline, self.collector.timeline = self.collector.timeline, []
        metrics: dict[str, float] = {}
        for entry in timeline:
            self.folder.append("generation", step, entry)
            name = entry["replica"]
            busy = entry["end"] - entry["start"]
            metrics[f"replica_{name}_busy_seconds"] = metrics.get(f"replica_{name}_busy_seconds", 0.0) + busy
            metrics[f"replica_{name}_groups"] = metrics.get(f"replica_{name}_groups", 0.0) + 1
            metrics[f"replica_{name}_tokens"] = metrics.get(f"replica_{name}_tokens", 0.0) + entry["tokens"]
        for name in {e["replica"] for e in timeline}:
            busy = metrics[f"replica_{name}_busy_seconds"]
            metrics[f"replica_{name}_tokens_per_second"] = metrics[f"replica_{name}_tokens"] / max(busy, 1e-9)
        for worker in self.fleet.members(SANDBOX):
            metrics[f"sandbox_{worker.name}_running"] = float(worker.running)
            metrics[f"sandbox_{worker.name}_queued"] = float(worker.queued)
        counts = (self.collector.regenerated_groups, self.collector.sandbox_retries)
        metrics["regenerated_groups"] = float(counts[0] - self._fleet_counts[0])
        metrics["sandbox_retries"] = float(counts[1] - self._fleet_counts[1])
        self._fleet_counts = counts
        metrics["fleet_rollout_alive"] = float(len(self.fleet.alive(ROLLOUT)))
        metrics["fleet_sandbox_alive"] = float(len(self.fleet.alive(SANDBOX)))
        return metrics

    async def _mark_cursor(self, step: int, drawn_before: int) -> None:
        """Where the task stream stands around `step`; stored before the step trains."""
        cursor = {
            "step": step,
            "tasks_drawn_before": drawn_before,
            "tasks_drawn_after": self._tasks_drawn.count,
            "next_group_index": self._group_index,
            "run_number": self.run_number,
        }
        self.record.touch(cursor=cursor)
        if self._flush is not None and not await self._flush(CURSOR_FLUSH_SECONDS):
            log.error("the task cursor is not stored yet; a coordinator restart now could misplace it", step=step)

    def _recovered_tasks_drawn(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """Tasks drawn before step weight_version + 1, from the persisted cursor or the checkpoint;
        the group index and run number of the cursor are restored with it."""
        version, cursor = loaded.weight_version, self.record.cursor
        self._group_index = int(cursor.get("next_group_index", 0))
        self.run_number = int(cursor.get("run_number", 0))
        if loaded.resumed_from:
            # The trainer may have come back from a checkpoint (its reply cannot say whether it
            # restarted): steps after it may have acked their groups, so this run takes new group
            # ids, and the buffer's clock goes back to the trainer's version.
            self.run_number += 1
            self._group_index = 0
            self._rewind = True
        if self.run_number:
            self.collector.id_prefix = f"{self.record.job_id}/r{self.run_number}"
        if cursor.get("step") in (version, version + 1):
            return int(cursor["tasks_drawn_before" if cursor["step"] == version + 1 else "tasks_drawn_after"])
        if loaded.resumed_from:
            return int(json.loads(loaded.data_state or "{}").get("tasks_drawn", 0))
        if not cursor:  # no step was collected before the restart
            return 0
        raise RuntimeError(
            f"the trainer stands at step {version}, but the stored task cursor is at step {cursor.get('step')} "
            "and no checkpoint says where the task stream was (the trainer lost the job and the job keeps "
            "no checkpoint to resume from)"
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
        if self._rewind:
            await self._open_buffer(rewind_to=loaded.weight_version)
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
        self._trained_to = loaded.weight_version
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
        request = trainer_pb2.SaveCheckpointRequest(
            job_id=self.record.job_id,
            metrics=values if measured == step else {},
            data_state=json.dumps({"tasks_drawn": self._tasks_drawn.count}),
        )
        reply = await self._call_trainer(
            "SaveCheckpoint", lambda: self.stubs.trainer.SaveCheckpoint(request, timeout=self._slow)
        )
        log.info("checkpoint saved", path=reply.path, step=reply.step, removed=len(reply.removed))

    async def _buffer_metrics(self) -> dict[str, float]:
        stats = await self._buffer_stats()
        if stats is None:
            return {}  # the buffer is restarting: this step goes without its counters
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
        unloads = [self.stubs.trainer.UnloadPolicy(trainer_pb2.UnloadPolicyRequest(job_id=job_id), timeout=30)]
        for member in self.fleet.members(ROLLOUT):
            if member.name in self._loaded:
                unloads.append(member.stub.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=job_id), timeout=30))
        for result in await asyncio.gather(*unloads, return_exceptions=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("unload failed", code=result.code().name, error=result.details())
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


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _phase_seconds(first: str, t0: float, t1: float, t2: float, t3: float, transfer: float) -> dict[str, float]:
    """A step's time by phase: `first` (generating or waiting for groups), training, weight sync."""
    return {
        first: t1 - t0,
        "train_step_seconds": t2 - t1,
        "weight_sync_seconds": t3 - t2,
        "weight_sync_transfer_seconds": transfer,
        "step_seconds": t3 - t0,
    }
