"""The interface every buffer backend implements, and the semantics it must keep.

    put_group(group) ----> held ----sample()----> pending ----ack()----> acked
                            |
                            +---- sample() finds it too old ----> dropped_stale

The in-memory backend (memory.py) is the reference; a Redis Streams backend
will sit behind the same class. Inputs reach a backend already validated by
the servicer (non-empty ids, at least one trajectory, group version equal to
the oldest trajectory version, max_groups >= 1, non-negative steps and ages),
so backends check state, never shape.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from dockyard.common.v1 import common_pb2


@dataclass(frozen=True)
class BufferStats:
    """Counters of one job. Invariant: puts == held + pending + acked + dropped_stale."""

    held: int = 0  # accepted, waiting to be sampled
    pending: int = 0  # leased by a sample, not yet acked
    acked: int = 0  # acked after training; payload freed, id kept
    dropped_stale: int = 0  # aged out before any sample leased them
    puts: int = 0  # groups accepted (duplicates and refused puts excluded)
    duplicate_puts: int = 0  # puts answered duplicate=True


def is_fresh(trainer_step: int, weight_version: int, max_age: int) -> bool:
    """The age bound: a group generated at `weight_version` may train at `trainer_step`."""
    return trainer_step - weight_version <= max_age


class BufferBackend(abc.ABC):
    """Whole GRPO groups in, fresh whole groups out, acked after the optimizer step.

    Every backend keeps these semantics; everything is per job (`group.job_id`),
    jobs never see each other's groups or counters.

    put_group(group) -> duplicate
        Stores the whole group as *held*. Idempotent by group id: if the job has
        ever accepted that id (held, pending, acked or dropped as stale), nothing
        changes and the answer is True. Otherwise, if held + pending already equals
        the capacity, raises ResourceExhausted (the caller backs off and retries;
        nothing is stored); else stores it and answers False. A duplicate is
        answered even when full, so a retried put never fails for capacity.

    sample(job_id, trainer_step, max_groups, max_age) -> (groups, dropped_stale)
        `trainer_step` is the trainer's current weight version (optimizer steps
        taken). First every *held* group with trainer_step - weight_version > max_age
        is dropped: never returned, its payload freed, counted in the second value
        and in stats. Then up to `max_groups` held groups are leased, oldest
        weight_version first, ties in put order, and become *pending*. Pending
        groups are not aged out and are never returned by another sample. An
        unknown job samples nothing.

    ack(job_id, group_ids) -> acked
        Moves pending groups to *acked* and frees their payload (the id is kept
        for idempotency). All-or-nothing: if any id was never accepted by the job,
        raises NotFound; if any id is held (never leased) or was dropped as stale,
        raises FailedPrecondition; in both cases nothing changes. Acking an
        already-acked id is a no-op. Returns the number of groups newly acked.

    stats(job_id) -> BufferStats
        The job's counters; all zero for a job never seen.

    Methods are safe to call concurrently from coroutines of one event loop.
    """

    @abc.abstractmethod
    async def put_group(self, group: common_pb2.Group) -> bool: ...

    @abc.abstractmethod
    async def sample(
        self, job_id: str, trainer_step: int, max_groups: int, max_age: int
    ) -> tuple[list[common_pb2.Group], int]: ...

    @abc.abstractmethod
    async def ack(self, job_id: str, group_ids: Sequence[str]) -> int: ...

    @abc.abstractmethod
    async def stats(self, job_id: str) -> BufferStats: ...

    async def close(self) -> None:
        """Release connections; called once when the service stops."""
