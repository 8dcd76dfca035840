"""Producing experience: which tasks become groups, under which ids and seeds, and when.

    GroupIds ── the one rule for a group's id and sampling seed ──────────────────────────────────────
        sync step s, index i:  <prefix>/s<s>/g<i>     seed = base + s * 1009 + i
        async, index i:        <prefix>/g<i>          seed = base + i            (i counts on across steps)
        prefix = <job>, or <job>/r<run> after the run-th trainer restart;  base = grpo.seed * 1_000_003

    SyncProducer.collect_step(s): num_prompts_per_step tasks ─collector.make_group ‖─> deliver ─> buffer
                                  (with dynamic sampling: refills for the groups dropped as uniform)
    AsyncProducer: make_group ─> deliver without pause, at most one step's groups in flight and at most
                   max_trajectory_age_steps steps' groups ahead of the trainer (held + in flight)

Guarantees: ids are stable (a retried put of the same group is a no-op) and
never collide across a trainer restart (a new run number); the seeds depend
only on the config and the id, so a resumed job samples as an uninterrupted
one would. A group that keeps failing in the sandbox (GroupUnscorable) is
counted as failed and left out (its groups.jsonl line says its first failed
trajectory and why); a sync step fails when no group reached the buffer, with
the first failure in its message, or every trajectory was invalid. The asynchronous producer never generates a group
only for it to age out; one group's failure is counted and the production
goes on, but a request the sandbox refused (RuntimeError) fails the job;
`wait_for_groups` fails when the buffer's count stops moving for `patience`. Stopping the
asynchronous producer cancels generation at once but lets every put under way finish and record its
outcome (up to PUT_DRAIN_SECONDS), so each group the buffer counts has its groups.jsonl line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from dockyard.config import GRPOConfig
from services.coordinator.collector import Collector, CollectStats
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.task_stream import TaskStream

log = structlog.get_logger()

# How often an asynchronous producer that is far enough ahead looks whether the trainer took groups.
PRODUCER_POLL_SECONDS = 0.2
# How long a stopping producer waits for puts under way (each reaches the buffer whole, or not at all).
PUT_DRAIN_SECONDS = 30.0


class GroupIds:
    """Where every group gets its id and sampling seed."""

    def __init__(self, job_id: str, seed: int) -> None:
        self.job_id = job_id
        self._base_seed = seed * 1_000_003
        self.run_number = 0  # trainer restarts survived so far
        self.next_index = 0  # the next asynchronous group's index

    @property
    def prefix(self) -> str:
        return f"{self.job_id}/r{self.run_number}" if self.run_number else self.job_id

    def group(self, index: int, step: int | None = None) -> tuple[str, int]:
        """(id, seed) of group `index` of synchronous step `step`, or of the asynchronous stream."""
        where = "" if step is None else f"/s{step}"
        return f"{self.prefix}{where}/g{index}", self._base_seed + (step or 0) * 1009 + index

    def take_next(self) -> tuple[str, int]:
        """(id, seed) of the asynchronous stream's next group."""
        index, self.next_index = self.next_index, self.next_index + 1
        return self.group(index)

    def new_run(self) -> None:
        """After a trainer restart: the resumed run's ids never collide with the lost run's acked ones."""
        self.run_number += 1

    def restore(self, run_number: int, next_index: int) -> None:
        self.run_number, self.next_index = run_number, next_index


class SyncProducer:
    def __init__(self, collector: Collector, tasks: TaskStream, ids: GroupIds, grpo: GRPOConfig) -> None:
        self._collector, self._tasks, self._ids, self._grpo = collector, tasks, ids, grpo

    async def collect_step(self, step: int) -> CollectStats:
        """Put num_prompts_per_step whole groups for `step` into the buffer."""
        grpo = self._grpo
        stats = CollectStats()
        rounds = 1 + (grpo.dynamic_sampling.max_refills if grpo.dynamic_sampling.enabled else 0)
        index, first_failure = 0, ""
        for _ in range(rounds):
            missing = grpo.num_prompts_per_step - stats.groups
            if missing <= 0:
                break
            batch = []
            for _ in range(missing):
                batch.append((next(self._tasks), *self._ids.group(index, step)))
                index += 1
            made = await asyncio.gather(*(self._collector.make_group(*args) for args in batch), return_exceptions=True)
            for (_, group_id, _), group in zip(batch, made, strict=True):
                if isinstance(group, GroupUnscorable):
                    stats.failed += 1
                    first_failure = first_failure or group.first
                    self._collector.record_outcome(group_id, "failed", -1, group.first)
                    log.warning("a group failed in the sandbox; the step goes on without it", error=str(group))
                elif isinstance(group, BaseException):
                    raise group
                else:
                    await self._collector.deliver(group, stats)
        if stats.groups == 0:
            raise RuntimeError(
                f"step {step}: no group reached the buffer in {rounds} round(s): "
                f"{stats.dropped_uniform} had uniform rewards, {stats.dropped_stale} were stale on arrival, "
                f"{stats.failed} failed" + (f"; first failure: {first_failure}" if first_failure else "")
            )
        if stats.invalid == stats.trajectories:
            raise RuntimeError(f"step {step}: every trajectory failed in the sandbox (verdicts: {stats.verdicts})")
        return stats


class AsyncProducer:
    def __init__(
        self,
        collector: Collector,
        buffer: JobBuffer,
        tasks: TaskStream,
        ids: GroupIds,
        grpo: GRPOConfig,
        *,
        patience: float,
    ) -> None:
        self._collector, self._buffer, self._tasks, self._ids, self._grpo = collector, buffer, tasks, ids, grpo
        self._patience = patience
        self._task: asyncio.Task | None = None
        # The counters since the last take_stats, the last group's error, a refusal that fails the job.
        self._produced = CollectStats()
        self._last_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._delivered = asyncio.Event()
        self._puts: set[asyncio.Task] = set()  # deliveries under way: a stop lets them finish

    def start(self) -> None:
        """Start producing, unless it already is (a producer that failed stays failed: wait_for_groups raises)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def take_stats(self) -> CollectStats:
        """What was produced since the last call."""
        stats, self._produced = self._produced, CollectStats()
        return stats

    async def run(self) -> None:
        """Generate, score and put groups without pause: one step's worth in flight at most, and
        at most max_trajectory_age_steps steps' worth ahead of the trainer (held in the buffer or
        in flight), since groups further ahead would age out before the trainer could take them."""
        grpo = self._grpo
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
                group_id, seed = self._ids.take_next()
                one = asyncio.create_task(self._produce_one(next(self._tasks), group_id, seed))
                running.add(one)
                one.add_done_callback(finished)
        finally:
            for one in running:
                one.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await self._drain_puts()

    async def _drain_puts(self) -> None:
        """Let the puts under way finish, so the buffer's count and groups.jsonl agree: a put cancelled
        after the buffer took it would be held there with no outcome line. Past PUT_DRAIN_SECONDS (a
        buffer that does not answer) the rest are cancelled."""
        if not self._puts:
            return
        done, late = await asyncio.wait(set(self._puts), timeout=PUT_DRAIN_SECONDS)
        for put in done:
            if not put.cancelled() and put.exception() is not None:
                log.warning("a put under way at the stop failed", error=str(put.exception()))
        for put in late:
            put.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _until_fewer_ahead(self, ahead: int, in_flight: Callable[[], int]) -> None:
        """Until the buffer's held groups plus those in flight are fewer than `ahead`; the trainer
        taking a step's groups makes room. A buffer that is restarting does not hold this up:
        its puts wait it out."""
        while True:
            stats = await self._buffer.stats()
            if stats is None or stats.held + in_flight() < ahead:
                return
            await asyncio.sleep(PRODUCER_POLL_SECONDS)

    async def _produce_one(self, task, group_id: str, seed: int) -> None:
        try:
            group = await self._collector.make_group(task, group_id, seed)
            # Shielded: a stop cancels generation at once, but a put runs to its reply (_drain_puts).
            put = asyncio.ensure_future(self._collector.deliver(group, self._produced))
            self._puts.add(put)
            put.add_done_callback(self._puts.discard)
            await asyncio.shield(put)
            self._delivered.set()
        except asyncio.CancelledError:
            raise
        except RuntimeError as exc:  # the sandbox refused the job's own request: no retry helps
            self._fatal = exc
            self._delivered.set()
        except Exception as exc:  # noqa: BLE001 - one group's failure is counted, the job goes on
            self._produced.failed += 1
            self._last_error = exc
            error = exc.first if isinstance(exc, GroupUnscorable) else f"{type(exc).__name__}: {exc}"[:1000]
            self._collector.record_outcome(group_id, "failed", -1, error)
            log.warning("a group failed; it is counted and not retried", group=group_id, error=str(exc))
            await asyncio.sleep(1.0)  # keep a failing fleet from spinning

    async def wait_for_groups(self) -> None:
        """Until the buffer holds a step's worth of groups; fail if the producer stalls or stopped."""
        need = self._grpo.num_prompts_per_step
        last_held, deadline = -1, time.monotonic() + self._patience
        while True:
            if self._task is not None and self._task.done():
                self._task.result()
            if self._fatal is not None:
                raise self._fatal
            stats = await self._buffer.stats()
            held = -1 if stats is None else stats.held  # -1: the buffer is restarting
            if held >= need:
                return
            if held != last_held:
                last_held, deadline = held, time.monotonic() + self._patience
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"the buffer has held {held} of the {need} groups a step needs for {self._patience:.0f} s; "
                    f"last generation error: {self._last_error}"
                )
            self._delivered.clear()
            try:
                await asyncio.wait_for(self._delivered.wait(), 1.0)
            except TimeoutError:
                pass
