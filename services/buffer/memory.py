"""The in-memory buffer backend: the reference implementation of backend.BufferBackend.

    job --> heap of held groups keyed (weight_version, put order)
        --> pending: group_id -> (Group, consumer, lease time)
        --> ids: weight_version -> {group_id: state}   (pruned with the age bound)

Groups (StoredGroup: metadata and payload bytes) live in this process only and are lost when it exits. Each method
holds one asyncio.Lock for its whole body, so concurrent coroutines see every
put, sample, reclaim and ack as atomic.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.buffer.backend import (
    BufferBackend,
    BufferStats,
    StoredGroup,
    check_advance_lease,
    check_clock,
    is_fresh,
    new_lease_id,
    not_lease_holder,
    unearned_advance,
)

HELD, PENDING, ACKED, DROPPED = "held", "pending", "acked", "dropped"


@dataclass
class _Lease:
    group: StoredGroup
    consumer: str
    since: float


@dataclass
class _Job:
    max_groups: int
    max_age: int
    latest_version: int = 0
    trainer_lease: str = ""  # the job's trainer lease (take_lease); "" until a trainer takes it
    # (weight_version, put sequence, group_id, group): the heap top is both the
    # oldest group and the first to age out, so dropping and leasing are pops.
    held: list[tuple[int, int, str, StoredGroup]] = field(default_factory=list)
    pending: dict[str, _Lease] = field(default_factory=dict)
    ids: dict[int, dict[str, str]] = field(default_factory=dict)
    puts: int = 0
    duplicate_puts: int = 0
    acked: int = 0
    dropped: int = 0
    reclaimed: int = 0

    def state(self, group_id: str) -> tuple[int, str] | None:
        for version, states in self.ids.items():
            if group_id in states:
                return version, states[group_id]
        return None

    def set_state(self, version: int, group_id: str, state: str) -> None:
        self.ids.setdefault(version, {})[group_id] = state

    def advance(self, version: int) -> None:
        self.latest_version = max(self.latest_version, version)
        # Ids of versions that can no longer be fresh are forgotten: a late
        # retry of such a put is dropped as stale on arrival anyway.
        horizon = self.latest_version - self.max_age - 1
        for old in [v for v in self.ids if v < horizon and not self._live(v)]:
            del self.ids[old]

    def _live(self, version: int) -> bool:
        return any(state in (HELD, PENDING) for state in self.ids[version].values())


def _take(candidates: list[StoredGroup], max_groups: int, max_bytes: int) -> int:
    """How many of `candidates` (in order) fit in max_groups and max_bytes; at least one."""
    size = 0
    for n, group in enumerate(candidates[:max_groups]):
        size += group.size
        if n and size > max_bytes:
            return n
    return min(len(candidates), max_groups)


class MemoryBuffer(BufferBackend):
    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._lock = asyncio.Lock()

    def _job(self, job_id: str) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFound(f"the buffer has no job {job_id!r}; OpenJob first") from None

    async def open_job(self, job_id: str, max_groups: int, max_age: int, rewind_to: int | None = None) -> None:
        async with self._lock:
            job = self._jobs.setdefault(job_id, _Job(max_groups=max_groups, max_age=max_age))
            job.max_groups, job.max_age = max_groups, max_age
            if rewind_to is not None and rewind_to > job.latest_version:
                job.advance(rewind_to)  # forward: as an ack moves it
            elif rewind_to is not None:
                job.latest_version = rewind_to
                job.dropped += self._drop_after(job, rewind_to)

    @staticmethod
    def _drop_after(job: _Job, version: int) -> int:
        """Drop every held and pending group generated after `version`; how many."""
        later = [entry for entry in job.held if entry[0] > version]
        job.held = [entry for entry in job.held if entry[0] <= version]
        heapq.heapify(job.held)
        for v, _, group_id, _ in later:
            job.set_state(v, group_id, DROPPED)
        leased = [lease.group for lease in job.pending.values() if lease.group.weight_version > version]
        for group in leased:
            del job.pending[group.group_id]
            job.set_state(group.weight_version, group.group_id, DROPPED)
        return len(later) + len(leased)

    async def close_job(self, job_id: str) -> None:
        async with self._lock:
            self._job(job_id)
            del self._jobs[job_id]

    async def put_group(self, group: common_pb2.Group, payload: bytes = b"") -> tuple[bool, bool]:
        async with self._lock:
            job = self._job(group.job_id)
            if job.state(group.group_id) is not None:
                job.duplicate_puts += 1
                return True, False
            version = group.weight_version
            if version > job.latest_version:
                raise FailedPrecondition(
                    f"group {group.group_id!r} was generated at weight version {version}, but the trainer of job "
                    f"{group.job_id!r} has reached only version {job.latest_version}: a version from the future"
                )
            if not is_fresh(job.latest_version, version, job.max_age):
                job.puts += 1
                job.dropped += 1
                job.set_state(version, group.group_id, DROPPED)
                return False, True
            in_flight = len(job.held) + len(job.pending)
            if in_flight >= job.max_groups:
                raise ResourceExhausted(
                    f"buffer full for job {group.job_id!r}: {in_flight} groups held or pending "
                    f"(max_groups={job.max_groups}); back off and retry once the trainer has sampled and acked"
                )
            # Serialized now: the caller may reuse or mutate its message, and a sample returns bytes.
            stored = StoredGroup(group.group_id, version, group.SerializeToString(), bytes(payload))
            job.puts += 1
            heapq.heappush(job.held, (version, job.puts, stored.group_id, stored))
            job.set_state(version, stored.group_id, HELD)
            return False, False

    async def sample(
        self,
        job_id: str,
        consumer: str,
        trainer_version: int,
        max_groups: int,
        max_bytes: int,
        *,
        by_reference: bool = False,
        lease: str | None = None,
    ) -> tuple[list[StoredGroup], int]:
        _no_references(by_reference)
        async with self._lock:
            job = self._job(job_id)
            check_clock(job_id, trainer_version, job.latest_version)
            check_advance_lease(job_id, trainer_version, job.latest_version, lease, job.trainer_lease)
            job.advance(trainer_version)
            dropped = 0
            while job.held and not is_fresh(job.latest_version, job.held[0][0], job.max_age):
                version, _, group_id, _ = heapq.heappop(job.held)
                job.set_state(version, group_id, DROPPED)
                dropped += 1
            job.dropped += dropped
            ordered = [entry[3] for entry in heapq.nsmallest(max_groups, job.held)]
            leased = ordered[: _take(ordered, max_groups, max_bytes)]
            now = time.monotonic()
            for group in leased:
                heapq.heappop(job.held)
                job.pending[group.group_id] = _Lease(group, consumer, now)
                job.set_state(group.weight_version, group.group_id, PENDING)
            return leased, dropped

    async def reclaim(
        self,
        job_id: str,
        consumer: str,
        trainer_version: int,
        max_groups: int,
        max_bytes: int,
        min_idle: float,
        *,
        by_reference: bool = False,
        lease: str | None = None,
    ) -> tuple[list[StoredGroup], int]:
        _no_references(by_reference)
        async with self._lock:
            job = self._job(job_id)
            check_clock(job_id, trainer_version, job.latest_version)
            check_advance_lease(job_id, trainer_version, job.latest_version, lease, job.trainer_lease)
            job.advance(trainer_version)
            now = time.monotonic()
            idle = sorted(
                (lease for lease in job.pending.values() if now - lease.since >= min_idle), key=lambda x: x.since
            )
            dropped = 0
            fresh = []
            for lease in idle:
                group = lease.group
                if is_fresh(job.latest_version, group.weight_version, job.max_age):
                    fresh.append(lease)
                else:
                    del job.pending[group.group_id]
                    job.set_state(group.weight_version, group.group_id, DROPPED)
                    dropped += 1
            job.dropped += dropped
            taken = fresh[: _take([lease.group for lease in fresh], max_groups, max_bytes)]
            for lease in taken:
                lease.consumer, lease.since = consumer, now
            job.reclaimed += len(taken)
            return [lease.group for lease in taken], dropped

    async def take_lease(self, job_id: str, consumer: str) -> str:
        async with self._lock:
            job = self._job(job_id)
            job.trainer_lease = new_lease_id(consumer)
            return job.trainer_lease

    async def ack(self, job_id: str, group_ids: Sequence[str], weight_version: int, lease: str | None = None) -> int:
        async with self._lock:
            job = self._job(job_id)
            if lease is not None and (not lease or lease != job.trainer_lease):
                raise not_lease_holder(job_id, lease)
            check_clock(job_id, weight_version, job.latest_version, setting=not group_ids)
            # Check every id before changing anything, so a refused ack leaves no trace.
            for group_id in group_ids:
                known = job.state(group_id)
                if known is None:
                    raise NotFound(f"group {group_id!r} was never put for job {job_id!r} (or is long forgotten)")
                state = known[1]
                if state == HELD:
                    raise FailedPrecondition(
                        f"group {group_id!r} of job {job_id!r} is held but was never sampled; "
                        f"only leased groups can be acked"
                    )
                if state == DROPPED:
                    raise FailedPrecondition(f"group {group_id!r} of job {job_id!r} aged out; it cannot be acked")
            if weight_version > job.latest_version and not any(g in job.pending for g in group_ids):
                raise unearned_advance(job_id, weight_version, job.latest_version)
            acked = 0
            for group_id in group_ids:
                lease = job.pending.pop(group_id, None)
                if lease is not None:
                    job.set_state(lease.group.weight_version, group_id, ACKED)
                    acked += 1
            job.acked += acked
            job.advance(weight_version)
            return acked

    async def stats(self, job_id: str) -> BufferStats:
        async with self._lock:
            job = self._job(job_id)
            versions: dict[int, int] = {}
            for version, *_ in job.held:
                versions[version] = versions.get(version, 0) + 1
            return BufferStats(
                held=len(job.held),
                pending=len(job.pending),
                acked=job.acked,
                dropped_stale=job.dropped,
                puts=job.puts,
                duplicate_puts=job.duplicate_puts,
                reclaimed=job.reclaimed,
                latest_version=job.latest_version,
                max_groups=job.max_groups,
                max_age=job.max_age,
                held_versions=versions,
            )

    def num_remembered_ids(self, job_id: str) -> int:
        """How many ids the job keeps for idempotency (for tests of the memory bound)."""
        return sum(len(states) for states in self._jobs[job_id].ids.values())


def _no_references(by_reference: bool) -> None:
    if by_reference:
        raise FailedPrecondition("this buffer keeps groups in memory and has no data plane: sample without references")
