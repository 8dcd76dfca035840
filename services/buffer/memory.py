"""The in-memory buffer backend: the reference implementation of backend.BufferBackend.

    job --> heap of held groups keyed (weight_version, put order)
        --> pending: group_id -> Group      (payload kept until acked)
        --> acked, dropped: sets of ids     (payload freed, id kept for idempotency)

Groups live in this process only and are lost when it exits. Each method
holds one asyncio.Lock for its whole body, so concurrent coroutines see every
put, sample and ack as atomic.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from dockyard.common.v1 import common_pb2
from dockyard.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.buffer.backend import BufferBackend, BufferStats, is_fresh


@dataclass
class _Job:
    # (weight_version, put sequence, group_id, group): the heap top is both the
    # oldest group and the first to age out, so dropping and leasing are pops.
    held: list[tuple[int, int, str, common_pb2.Group]] = field(default_factory=list)
    held_ids: set[str] = field(default_factory=set)
    pending: dict[str, common_pb2.Group] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    puts: int = 0
    duplicate_puts: int = 0

    def knows(self, group_id: str) -> bool:
        return (
            group_id in self.held_ids or group_id in self.pending or group_id in self.acked or group_id in self.dropped
        )


class MemoryBuffer(BufferBackend):
    """Buffer state in a dict of jobs; `max_groups` bounds held plus pending per job."""

    def __init__(self, max_groups: int = 4096) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self._max_groups = max_groups
        self._jobs: dict[str, _Job] = {}
        self._lock = asyncio.Lock()

    async def put_group(self, group: common_pb2.Group) -> bool:
        async with self._lock:
            job = self._jobs.setdefault(group.job_id, _Job())
            if job.knows(group.group_id):
                job.duplicate_puts += 1
                return True
            in_flight = len(job.held) + len(job.pending)
            if in_flight >= self._max_groups:
                raise ResourceExhausted(
                    f"buffer full for job {group.job_id!r}: {in_flight} groups held or pending "
                    f"(max_groups={self._max_groups}); the collector should back off and retry "
                    f"once the trainer has sampled and acked"
                )
            stored = common_pb2.Group()
            stored.CopyFrom(group)  # the caller may reuse or mutate its message
            job.puts += 1
            heapq.heappush(job.held, (stored.weight_version, job.puts, stored.group_id, stored))
            job.held_ids.add(stored.group_id)
            return False

    async def sample(
        self, job_id: str, trainer_step: int, max_groups: int, max_age: int
    ) -> tuple[list[common_pb2.Group], int]:
        async with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return [], 0
            dropped = 0
            while job.held and not is_fresh(trainer_step, job.held[0][0], max_age):
                _, _, group_id, _ = heapq.heappop(job.held)
                job.held_ids.discard(group_id)
                job.dropped.add(group_id)
                dropped += 1
            leased: list[common_pb2.Group] = []
            while job.held and len(leased) < max_groups:
                _, _, group_id, group = heapq.heappop(job.held)
                job.held_ids.discard(group_id)
                job.pending[group_id] = group
                leased.append(group)
            return leased, dropped

    async def ack(self, job_id: str, group_ids: Sequence[str]) -> int:
        async with self._lock:
            job = self._jobs.get(job_id) or _Job()
            # Check every id before changing anything, so a refused ack leaves no trace.
            for group_id in group_ids:
                if group_id in job.pending or group_id in job.acked:
                    continue
                if group_id in job.held_ids:
                    raise FailedPrecondition(
                        f"group {group_id!r} of job {job_id!r} is held but was never sampled; "
                        f"only groups leased by SampleGroups can be acked"
                    )
                if group_id in job.dropped:
                    raise FailedPrecondition(
                        f"group {group_id!r} of job {job_id!r} aged out before it was sampled; "
                        f"only groups leased by SampleGroups can be acked"
                    )
                raise NotFound(f"group {group_id!r} was never put for job {job_id!r}")
            acked = 0
            for group_id in group_ids:
                if job.pending.pop(group_id, None) is not None:
                    job.acked.add(group_id)
                    acked += 1
            return acked

    async def stats(self, job_id: str) -> BufferStats:
        async with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return BufferStats()
            return BufferStats(
                held=len(job.held),
                pending=len(job.pending),
                acked=len(job.acked),
                dropped_stale=len(job.dropped),
                puts=job.puts,
                duplicate_puts=job.duplicate_puts,
            )
