"""The fleet: rollout replicas and sandbox workers that registered with the coordinator.

    RegisterMember(kind, name, address) ──> Member (channel + stub, a new incarnation, no job loaded)
    Heartbeat(name, load)               ──> last_seen = now, load; a FAILED member is usable again
    no heartbeat for member_timeout     ──> EXPIRED: never routed to; its next heartbeat is NOT_FOUND,
                                            so it registers again (as a new incarnation)
    a call to it fails (UNAVAILABLE...) ──> FAILED until its next heartbeat

    pick_replica(job, group, version)   ──> sticky: the group's replica while it stays usable,
                                            else the least loaded usable replica holding `version`
    pick_sandbox(exclude)               ──> the least loaded usable worker

Guarantees: registration is the one way the coordinator finds rollouts and
sandboxes; a member is routed to only while alive (a heartbeat within the
timeout), not failed since its last heartbeat, and, for a replica, while it
holds the job's policy at the weight version asked for (`version=None`: any
synced version, for asynchronous loops). Load is the member's own report
plus the calls this coordinator has in flight to it; ties go to the member
given the fewest calls so far, so an idle fleet is used in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.api.rollout.v1 import rollout_pb2_grpc
from dockyard.api.sandbox.v1 import sandbox_pb2_grpc
from dockyard.rpc.client import connect
from dockyard.rpc.settings import member_name_pattern

ROLLOUT, SANDBOX = "rollout", "sandbox"
KINDS = {coordinator_pb2.MEMBER_KIND_ROLLOUT: ROLLOUT, coordinator_pb2.MEMBER_KIND_SANDBOX: SANDBOX}
NAME = {kind: re.compile(member_name_pattern(kind)) for kind in (ROLLOUT, SANDBOX)}
ADDRESS = re.compile(r"^[^\s:]+:[0-9]{1,5}$")
STICKY_GROUPS = 10_000


class NoReplica(RuntimeError):
    """No rollout replica became ready within the fleet wait timeout."""


class FleetError(ValueError):
    """A registration that names no valid kind, name or address."""


@dataclass
class Member:
    kind: str
    name: str
    address: str
    last_seen: float
    incarnation: int
    channel: grpc.aio.Channel | None = None
    stub: object = None
    load: int = 0
    running: int = 0
    queued: int = 0
    kv_pressure: float = 0.0
    in_flight: int = 0
    assigned: int = 0
    failed_at: float | None = None
    # job id -> weight version this incarnation holds (rollout replicas).
    versions: dict[str, int] = field(default_factory=dict)

    def expired(self, now: float, timeout: float) -> bool:
        return now - self.last_seen > timeout

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    def status(self, now: float, timeout: float) -> str:
        if self.expired(now, timeout):
            return "EXPIRED"
        return "FAILED" if self.failed else "ALIVE"


def _channel(kind: str, address: str, max_message_mb: int):
    # Sandbox calls are not retried on the channel: the collector retries them on another worker.
    service = "dockyard.rollout.v1.RolloutService" if kind == ROLLOUT else None
    channel = connect(address, service=service, max_message_mb=max_message_mb, max_reconnect_backoff=2.0)
    stub = (
        rollout_pb2_grpc.RolloutServiceStub(channel)
        if kind == ROLLOUT
        else sandbox_pb2_grpc.SandboxServiceStub(channel)
    )
    return channel, stub


class Fleet:
    def __init__(
        self,
        member_timeout: float,
        *,
        max_message_mb: int = 64,
        clock: Callable[[], float] = time.monotonic,
        channel_factory: Callable[[str, str, int], tuple] = _channel,
    ) -> None:
        self.member_timeout = member_timeout
        self._max_message_mb = max_message_mb
        self._clock = clock
        self._channel_factory = channel_factory
        self._members: dict[str, Member] = {}
        self._incarnations = 0
        self._sticky: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._changed = asyncio.Event()

    # Membership, driven by the members' RPCs.

    def register(self, kind: str, name: str, address: str) -> Member:
        if kind not in NAME:
            raise FleetError(f"kind must be rollout or sandbox, not {kind!r}")
        if not NAME[kind].match(name):
            raise FleetError(f"a {kind} member's name must be '{kind}' or '{kind}-<name>', not {name!r}")
        if not ADDRESS.match(address):
            raise FleetError(f"address must be host:port, not {address!r}")
        old = self._members.pop(name, None)
        if old is not None:
            self._close_later(old)
        self._incarnations += 1
        channel, stub = self._channel_factory(kind, address, self._max_message_mb)
        member = Member(kind, name, address, self._clock(), self._incarnations, channel, stub)
        self._members[name] = member
        self._notify()
        return member

    def held_elsewhere(self, name: str, address: str) -> Member | None:
        """The live member that holds `name` at another address (a second process under one name), else None."""
        held = self._members.get(name)
        if held is not None and held.address != address and held.status(self._clock(), self.member_timeout) == "ALIVE":
            return held
        return None

    def heartbeat(
        self, name: str, load: int, running: int = 0, queued: int = 0, kv_pressure: float = 0.0
    ) -> Member | None:
        """Record a sign of life; None for an unknown or expired member (it must register again)."""
        member = self._members.get(name)
        if member is None or member.expired(self._clock(), self.member_timeout):
            return None
        member.last_seen = self._clock()
        member.load, member.running, member.queued = load, running, queued
        member.kv_pressure = kv_pressure
        if member.failed:
            member.failed_at = None
            self._notify()
        return member

    def unregister(self, name: str) -> bool:
        member = self._members.pop(name, None)
        if member is None:
            return False
        self._close_later(member)
        self._notify()
        return True

    # What the coordinator learns from its own calls.

    def mark_failed(self, member: Member) -> None:
        if self._members.get(member.name) is member and not member.failed:
            member.failed_at = self._clock()
            self._notify()

    def set_version(self, member: Member, job_id: str, version: int) -> None:
        member.versions[job_id] = version
        self._notify()

    def unsync(self, member: Member, job_id: str) -> None:
        """`member` took part in a weight sync of the job that failed: its weights may be part old,
        part new, so it gets no work of the job until a sync succeeds on it."""
        if member.versions.pop(job_id, None) is not None:
            self._notify()

    def forget_job(self, job_id: str) -> None:
        for member in self._members.values():
            member.versions.pop(job_id, None)
        for key in [k for k in self._sticky if k[0] == job_id]:
            del self._sticky[key]

    # Views.

    def members(self, kind: str | None = None) -> list[Member]:
        return sorted(
            (m for m in self._members.values() if kind is None or m.kind == kind), key=lambda m: (m.kind, m.name)
        )

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    def usable(self, member: Member) -> bool:
        """Alive, not failed since its last heartbeat, and still the registered incarnation."""
        return (
            self._members.get(member.name) is member
            and not member.failed
            and not member.expired(self._clock(), self.member_timeout)
        )

    def alive(self, kind: str) -> list[Member]:
        return [m for m in self.members(kind) if self.usable(m)]

    def replicas(self, job_id: str, version: int | None = None) -> list[Member]:
        """Usable replicas holding the job's policy at `version` (None: at any synced version)."""
        return [
            m
            for m in self.alive(ROLLOUT)
            if job_id in m.versions and (version is None or m.versions[job_id] == version)
        ]

    def _least_loaded(self, members: list[Member]) -> Member | None:
        if not members:
            return None
        return min(members, key=lambda m: (m.load + m.in_flight, m.assigned, m.name))

    def pick_replica(
        self, job_id: str, group_id: str, version: int | None, exclude: frozenset[str] = frozenset()
    ) -> Member | None:
        """The group's sticky replica if still usable at `version`, else the least loaded one (None: none)."""
        ready = [m for m in self.replicas(job_id, version) if m.name not in exclude]
        key = (job_id, group_id)
        sticky = self._sticky.get(key)
        choice = next((m for m in ready if m.name == sticky), None) or self._least_loaded(ready)
        if choice is not None:
            self._sticky[key] = choice.name
            self._sticky.move_to_end(key)
            while len(self._sticky) > STICKY_GROUPS:
                self._sticky.popitem(last=False)
        return choice

    def pick_sandbox(self, exclude: frozenset[str] = frozenset()) -> Member | None:
        return self._least_loaded([m for m in self.alive(SANDBOX) if m.name not in exclude])

    @contextlib.contextmanager
    def calling(self, member: Member) -> Iterator[None]:
        """Count one call in flight to `member` for the body (it weighs in routing)."""
        member.in_flight += 1
        member.assigned += 1
        try:
            yield
        finally:
            member.in_flight -= 1

    async def changed(self, timeout: float) -> None:
        """Wait until the membership changes (or `timeout` passes; expiry is not an event)."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def to_proto(self) -> list[coordinator_pb2.Member]:
        now, kinds = self._clock(), {v: k for k, v in KINDS.items()}
        return [
            coordinator_pb2.Member(
                kind=kinds[m.kind],
                name=m.name,
                address=m.address,
                status=m.status(now, self.member_timeout),
                load=m.load,
                in_flight=m.in_flight,
                seconds_since_heartbeat=now - m.last_seen,
                weight_versions=m.versions,
                kv_pressure=m.kv_pressure,
            )
            for m in self.members()
        ]

    def _close_later(self, member: Member) -> None:
        if member.channel is None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop (unit tests): nothing to close
            asyncio.get_running_loop().create_task(member.channel.close())

    async def close(self) -> None:
        await asyncio.gather(
            *(m.channel.close() for m in self._members.values() if m.channel is not None), return_exceptions=True
        )
        self._members.clear()
