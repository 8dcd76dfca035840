"""One job's synchronous (on-policy) GRPO loop, driven from the coordinator.

    wait for a rollout replica and a sandbox worker ─> load policy (trainer, every alive replica;
    the trainer may resume at step k) ─> weights vk ─> [validate]
    for step in k+1..max_num_steps:
        collect (generate ─> score ─> buffer) ─> TrainStep ─> weight sync ─> [validate] [checkpoint]
    [validate] ─> checkpoint ─> SUCCEEDED

Guarantees: generation for step s uses the weights of version s − 1 (a
replica is routed to only at the current version; every replica that took
part in a sync holds exactly the trainer's weights: the checksums must
agree); a replica that registers later is loaded and joins the next sync (or
is synced at once when no replica is ready), and only then gets work; a
replica that died in a sync is dropped and the sync tried again without it;
a checkpoint carries the validation metrics of its
step (they rank it for top-k retention) and the number of training tasks drawn,
so a resumed job draws the same tasks an uninterrupted one would; the job ends FAILED with the cause in its message
on any error, CANCELLED on CancelJob, and both policies are unloaded either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.rollout.v1 import rollout_pb2
from dockyard.rpc.client import channel_health
from dockyard.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.coordinator.collector import Collector, NoReplica, load_tasks
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet, Member
from services.coordinator.jobs import CANCELLED, FAILED, RUNNING, SUCCEEDED, JobRecord
from services.coordinator.metrics import RunFolder
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.sync_groups import SideGroupRegistry

log = structlog.get_logger()

# A weight sync that failed on the side group is tried this many times in all.
SYNC_ATTEMPTS = 2


@dataclass
class Stubs:
    """The fixed services, the fleet of rollout replicas and sandbox workers, and the side groups."""

    trainer: trainer_pb2_grpc.TrainerServiceStub
    buffer: buffer_pb2_grpc.BufferServiceStub
    fleet: Fleet
    sync_groups: SideGroupRegistry


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
    def __init__(self, record: JobRecord, stubs: Stubs, settings: CoordinatorSettings) -> None:
        self.record = record
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
        await self._wait_for_fleet()
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
            self._load_replicas(self.fleet.alive(ROLLOUT)),
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
            stats = await self.collector.collect_step(step)
            t1 = time.perf_counter()
            fleet_metrics = self.fleet_metrics(step)
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
                "regenerated_groups": float(stats.regenerated_groups),
                "sandbox_retries": float(stats.sandbox_retries),
                **fleet_metrics,
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
            demos = [
                trainer_pb2.Demonstration(prompt=task.prompt, completion=task.solution)
                for task in (next(self.collector.tasks) for _ in range(sft.batch_size))
            ]
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
            except (grpc.aio.AioRpcError, NoReplica) as exc:
                log.warning("replicas could not join yet", error=str(exc))

    async def _sync_weights(self, version: int, only: list[Member] | None = None) -> float:
        """Push `version` once from the trainer and receive it on every alive replica (or `only` these)
        at once; the side group is formed with exactly those replicas. A sync that failed on the side
        group (UNAVAILABLE) is tried once more without the replicas that died meanwhile."""
        job_id = self.record.job_id
        async with self._sync_lock:
            for attempt in range(1, SYNC_ATTEMPTS + 1):
                candidates = [m for m in (only or self.fleet.alive(ROLLOUT)) if self.fleet.usable(m)]
                # A replica that died since its last call would hold the whole side group up to its timeout.
                await self._drop_dead(candidates)
                replicas = await self._load_replicas([m for m in candidates if self.fleet.usable(m)])
                if not replicas:
                    raise NoReplica(f"no rollout replica alive to receive weight version {version}")
                self.stubs.sync_groups.set_replicas(job_id, [m.name for m in replicas])
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
                retriable = all(
                    isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.UNAVAILABLE for f in failures
                )
                if attempt == SYNC_ATTEMPTS or not retriable:
                    raise failures[0]
                await self._drop_dead(replicas)
                log.warning("weight sync failed; trying again", version=version, error=str(failures[0]))
            seconds = [pushed.seconds]
            for member, reply in zip(replicas, received, strict=True):
                if pushed.checksum != reply.checksum or reply.weight_version != version:
                    raise RuntimeError(
                        f"weight sync of version {version} is corrupt: trainer sent {pushed.checksum[:12]}, "
                        f"replica {member.name} holds {reply.checksum[:12]} at version {reply.weight_version}"
                    )
                self.fleet.set_version(member, job_id, version)
                seconds.append(reply.seconds)
            if self.config.grpo.async_grpo.enabled:
                self.collector.required_version = None
            else:
                self.collector.required_version = version
            return max(seconds)

    async def _drop_dead(self, replicas: list[Member]) -> None:
        """After a failed sync: replicas that no longer answer health checks leave routing and the group."""
        statuses = await asyncio.gather(*(channel_health(m.channel, timeout=2.0) for m in replicas))
        for member, status in zip(replicas, statuses, strict=True):
            if status != "SERVING":
                log.warning("replica dropped from the weight sync", replica=member.name, status=status)
                self.fleet.mark_failed(member)

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
        metrics["fleet_rollout_alive"] = float(len(self.fleet.alive(ROLLOUT)))
        metrics["fleet_sandbox_alive"] = float(len(self.fleet.alive(SANDBOX)))
        return metrics

    async def _resume(self, loaded: trainer_pb2.LoadPolicyResponse) -> int:
        """The step the trainer stands at; on a resume, move the task stream to where it was."""
        # Counting the tasks drawn is what a checkpoint records as the data position.
        self.collector.tasks = self._tasks_drawn = CountingIterator(self.collector.tasks)
        if not loaded.resumed_from:
            return 0
        drawn = int(json.loads(loaded.data_state or "{}").get("tasks_drawn", 0))
        for _ in range(drawn):
            next(self._tasks_drawn)
        # The buffer's clock (age bound, puts from the future) starts at the resumed version.
        await self.stubs.buffer.AckGroups(
            buffer_pb2.AckGroupsRequest(job_id=self.record.job_id, weight_version=loaded.weight_version), timeout=10
        )
        self.folder.append("resume", loaded.weight_version, {"tasks_drawn": float(drawn)})
        log.info("resumed", checkpoint=loaded.resumed_from, step=loaded.weight_version, tasks_drawn=drawn)
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
