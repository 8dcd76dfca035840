"""The interface every buffer backend implements, and the semantics it must keep.

    open_job ─> put_group(group) ──> held ──sample()──> pending ──ack()──> acked
                   │                  │                   │  └─reclaim() (idle) ─> pending (new lease)
                   └─ already stale ──┴─ aged out ────────┴─> dropped_stale

The in-memory backend (memory.py) is the reference; the Redis Streams backend
(redis_backend.py) keeps the same behaviour, proved by one test suite run
against both. Inputs reach a backend already validated by the servicer
(non-empty ids, at least one trajectory, group version equal to the oldest
trajectory version, sizes within limits, positive counts, non-negative steps),
so backends check state, never shape.
"""

from __future__ import annotations

import abc
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.errors import FailedPrecondition


@dataclass(frozen=True)
class BufferStats:
    """State of one job. Invariant: puts == held + pending + acked + dropped_stale."""

    held: int = 0  # accepted, waiting to be sampled
    pending: int = 0  # leased by a sample or reclaim, not yet acked
    acked: int = 0  # acked after training; payload freed
    dropped_stale: int = 0  # aged out (on arrival, while held, or when reclaimed)
    puts: int = 0  # groups accepted (duplicates and refused puts excluded)
    duplicate_puts: int = 0  # puts answered duplicate=True
    reclaimed: int = 0  # leases taken over by reclaim()
    latest_version: int = 0  # the trainer's clock as the buffer last heard it
    max_groups: int = 0
    max_age: int = 0
    held_versions: dict[int, int] = field(default_factory=dict)  # weight_version -> held groups


@dataclass(frozen=True)
class StoredGroup:
    """A group as the buffer stores and returns it: bytes in, the same bytes out.

    `metadata` is a serialized Group: without token arrays when `payload` (dockyard/experience/payload.py)
    holds them, the whole group when it came by PutGroup (payload empty).
    """

    group_id: str
    weight_version: int
    metadata: bytes
    payload: bytes = b""
    # Set instead of `payload` when sampled by reference: the data-plane key holding the payload.
    payload_key: str = ""

    @property
    def size(self) -> int:
        return len(self.metadata) + len(self.payload)

    def group(self) -> common_pb2.Group:
        """The stored Group message (metadata only when the group has a payload)."""
        return common_pb2.Group.FromString(self.metadata)


@dataclass(frozen=True)
class StagedPayload:
    """A payload a writer SET in the data plane (dockyard/experience/data_plane.py): its key and length."""

    key: str
    size: int


# A trainer version never exceeds a job's steps; Lua numbers (doubles) hold it exactly.
MAX_VERSION = 10_000_000


def check_clock(job_id: str, version: int, latest: int, *, setting: bool = False) -> None:
    """Refuse a version the job cannot have reached, the same way on every backend.

    A sample, reclaim or ack of groups comes from a trainer at most one step past
    the clock. An ack of no groups (`setting`) moves nothing: one at or below the
    clock is a no-op, one above it is refused, so no call without acked work can
    move a running job's clock (the coordinator sets it with OpenJob's rewind_to_version).
    """
    if version > MAX_VERSION:
        raise FailedPrecondition(f"version {version} of job {job_id!r} is beyond any job's {MAX_VERSION} steps")
    if setting and version > latest:
        raise FailedPrecondition(
            f"AckGroups with no group_ids cannot move the clock of job {job_id!r} from {latest} to {version}: "
            "the clock advances only with acked groups (weight_version at most one past it); "
            "OpenJob's rewind_to_version sets it"
        )
    if version > latest + 1:
        raise FailedPrecondition(
            f"version {version} of job {job_id!r} is beyond its clock: the trainer has reached {latest}, "
            f"so a sample or ack is at most version {latest + 1}"
        )


def new_lease_id(consumer: str) -> str:
    """A fresh trainer lease: the consumer's name (for messages) and 128 random bits (the proof)."""
    return f"{consumer}/{secrets.token_hex(16)}"


def not_lease_holder(job_id: str, lease_id: str, what: str = "AckGroups") -> FailedPrecondition:
    """The refusal of a clock-moving call from a caller that does not hold the job's trainer lease."""
    shown = lease_id.split("/", 1)[0] + "/…" if lease_id else "(none)"
    return FailedPrecondition(
        f"{what} with lease {shown} does not hold the trainer lease of job {job_id!r}: only the job's "
        "trainer (the last caller of TakeTrainerLease) can ack and move its clock"
    )


def check_advance_lease(job_id: str, version: int, latest: int, lease: str | None, holder: str) -> None:
    """A sample or reclaim above the clock (which it advances) must carry the job's trainer lease;
    at or below the clock it moves nothing and needs none. `lease` None: an in-process caller."""
    if lease is not None and version > latest and (not lease or lease != holder):
        raise not_lease_holder(
            job_id, lease, f"a sample or reclaim at trainer_step {version} (above the clock {latest})"
        )


def unearned_advance(job_id: str, version: int, latest: int) -> FailedPrecondition:
    """The refusal of an ack that would move the clock without acking any leased group."""
    return FailedPrecondition(
        f"AckGroups at weight_version {version} acks no leased group of job {job_id!r} (every id is acked "
        f"already), so it cannot move the clock from {latest}: the clock moves with acked work only"
    )


def is_fresh(trainer_version: int, weight_version: int, max_age: int) -> bool:
    """The age bound: a group generated at `weight_version` may train at `trainer_version`."""
    return trainer_version - weight_version <= max_age


class BufferBackend(abc.ABC):
    """Whole GRPO groups in, fresh whole groups out, acked after the optimizer step.

    Everything is per job; jobs never see each other's groups or counters. A job
    has a clock, `latest_version`: the largest trainer version it has heard of
    (from sample, reclaim or ack), starting at 0.

    open_job(job_id, max_groups, max_age, rewind_to=None)
        Creates the job, or updates its capacity and age bound; rewind_to sets
        latest_version: forward as an ack moves it (the coordinator setting the clock
        on a resume), or back (the only way the clock moves back), dropping every held
        and pending group generated after it (counted in dropped_stale): they
        came from weights the rewound trainer never had. Every other
        method raises NotFound for a job never opened (or closed).

    close_job(job_id)
        Frees everything of the job: groups, ids, counters. NotFound if unknown.

    put_group(group, payload=b"") -> (duplicate, dropped_stale)
        Idempotent by group id: if the job remembers the id (see below), nothing
        changes and the answer is (True, False). A group from the future
        (weight_version > latest_version) raises FailedPrecondition. A group
        already too old (not is_fresh(latest_version, ...)) is accepted and
        dropped at once: (False, True), counted in puts and dropped_stale. Else,
        if held + pending equals max_groups, raises ResourceExhausted (nothing
        stored; the caller backs off); else the group is *held*: (False, False).
        A duplicate is answered even when full. The group is stored as
        StoredGroup(metadata=group serialized, payload) and returned as stored. Ids are remembered while a
        group of their version could still be fresh (version >= latest_version
        - max_age - 1); older ids are forgotten, which keeps memory bounded, and
        a late retry of such a put is dropped as stale on arrival.

    sample(job_id, consumer, trainer_version, max_groups, max_bytes) -> (groups, dropped)
        Advances latest_version to trainer_version if larger. Drops every held
        group that is not fresh at latest_version (never returned, payload
        freed, counted). Then leases held groups, oldest weight_version first,
        ties in put order, to `consumer`: at most max_groups, and at most
        max_bytes of stored groups (StoredGroup.size) in total (but always at least one group
        if any is held). Leased groups become *pending*, with their lease time.

    reclaim(job_id, consumer, trainer_version, max_groups, max_bytes, min_idle) -> (groups, dropped)
        Advances latest_version like sample. Takes over, for `consumer`, pending
        groups whose lease is at least `min_idle` seconds old (any consumer's,
        its own included), oldest lease first, within max_groups and max_bytes
        as sample; their lease time restarts. A reclaimed group that is no
        longer fresh is dropped instead (counted), never returned.

    put_staged(group, staged) -> (duplicate, dropped_stale)
        put_group for metadata whose payload a writer staged under staged.key
        (StagedPayload, in the job's staging keys): the same answers; the
        backend takes the key over when the group is held, deletes it when the
        put is a duplicate or stale, and leaves it to its expiry otherwise. A
        staged key that is missing or of another length than staged.size
        raises FailedPrecondition. Only backends with a data plane
        (data_plane_prefix() is not None) accept it.

    sample and reclaim with by_reference=True return each payload's key
    (StoredGroup.payload_key) instead of its bytes; only with a data plane.

    sample, reclaim and ack refuse with FailedPrecondition (changing nothing) a
    version above latest_version + 1; a sample or reclaim above latest_version
    (which it advances) with `lease` given must carry the job's trainer lease
    (check_advance_lease); an ack of no groups moves nothing and is
    refused above latest_version (check_clock).

    take_lease(job_id, consumer) -> lease_id
        Makes the caller the job's trainer: a new lease id (new_lease_id), stored with
        the job; every earlier one is void from then on (a dead or replaced trainer's
        acks are refused). NotFound for an unknown job.

    ack(job_id, group_ids, weight_version, lease=None) -> acked
        With `lease` (the service always passes the request's), refused with
        FailedPrecondition (not_lease_holder, nothing changes) unless it is the job's
        current trainer lease; None is an in-process caller (tests, tools). Advances
        latest_version to weight_version if larger, only when it acks at least one
        leased group (else FailedPrecondition, nothing changes: the clock moves with acked work). Moves pending groups
        to *acked* and frees their payload. All-or-nothing: an id the job never
        accepted (or has forgotten) raises NotFound; an id held (never leased)
        or dropped raises FailedPrecondition; then nothing changes. Acking an
        already-acked id is a no-op. Returns the number of groups newly acked.

    stats(job_id) -> BufferStats

    Methods are safe to call concurrently from coroutines of one event loop.
    """

    @abc.abstractmethod
    async def open_job(self, job_id: str, max_groups: int, max_age: int, rewind_to: int | None = None) -> None: ...

    @abc.abstractmethod
    async def close_job(self, job_id: str) -> None: ...

    @abc.abstractmethod
    async def put_group(self, group: common_pb2.Group, payload: bytes = b"") -> tuple[bool, bool]: ...

    def data_plane_prefix(self) -> str | None:
        """The key prefix of the data plane (the backend's Redis), or None: this backend has none."""
        return None

    async def put_staged(self, group: common_pb2.Group, staged: StagedPayload) -> tuple[bool, bool]:
        raise FailedPrecondition(
            "this buffer keeps groups in memory and has no data plane: put the payload with PutGroupStream"
        )

    @abc.abstractmethod
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
    ) -> tuple[list[StoredGroup], int]: ...

    @abc.abstractmethod
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
    ) -> tuple[list[StoredGroup], int]: ...

    @abc.abstractmethod
    async def take_lease(self, job_id: str, consumer: str) -> str: ...

    @abc.abstractmethod
    async def ack(
        self, job_id: str, group_ids: Sequence[str], weight_version: int, lease: str | None = None
    ) -> int: ...

    @abc.abstractmethod
    async def stats(self, job_id: str) -> BufferStats: ...

    async def close(self) -> None:
        """Release connections; called once when the service stops."""
