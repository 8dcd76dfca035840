"""Which rollout replica serves a session's call: sticky sessions, least-loaded spreading, failover, admission.

    call of session s ──route(s, live replicas, size)──┬─ s has a live replica ───────────> that replica
                                                       ├─ s's replica left ──────────────> least loaded (moved)
                                                       └─ s is new ──admission off──────> least loaded (admitted)
                                                                   └─admission on: a replica under the pressure
                                                                     threshold and no one queued ahead ─> admitted
                                                                     else wait in the FIFO queue (full: refused)
    Generate reply ──note(replica, kv stats); note_size(s, tokens)     session ends ──release(s)──> queue moves

Load of a replica = (sessions admitted to it, calls in flight to it plus the load it last reported).
Admission pressure of a replica = the tokens its admitted sessions' histories hold (each session's
last prompt + completion, at least the reserve: `session_tokens`, else the mean size of the latest
sessions that ended) over the KV capacity the replica reported with its last Generate reply
(services/rollout/prefix_cache.py); a replica that reports none (another engine) is never under
pressure, one that has not answered yet takes one session until it has. A new session is admitted
where the pressure with it stays at or under the threshold, or where no session runs.

Guarantees:
- every call of a session goes to the same replica while that replica is live; a session whose
  replica left (dead, deregistered or failing) moves to the least loaded live replica, whatever the
  pressure (a running session is always served), and stays there;
- with admission on (`pressure_threshold` > 0), a new session is admitted only when some replica has
  room for it and every session queued before it was admitted (FIFO); at most `queue_size`
  wait, a new session beyond that is refused (AdmissionRefused, a 503), and so is one that waited
  `wait_seconds`;
- `snapshot()` gives queue depth, admitted sessions, in-flight calls and pressure per replica.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class AdmissionRefused(Exception):
    """The admission queue is full, or a new session waited too long for room on a replica."""


@dataclass
class Replica:
    name: str
    address: str
    load: int = 0  # calls running on it, as it last reported to the coordinator


@dataclass
class ReplicaState:
    sessions: set[str] = field(default_factory=set)
    in_flight: int = 0
    kv: Any = None  # the replica's last KvCacheStats
    reports_kv: bool | None = None  # None until a call returned: does it report a KV capacity?
    failed_at: float = -1e9


@dataclass
class RouterStats:
    moved_sessions: int = 0  # sessions whose replica left and that went on elsewhere
    retried_calls: int = 0  # calls that failed on a replica and were sent to another
    queued_sessions: int = 0  # new sessions that had to wait for admission
    refused_sessions: int = 0


class Router:
    # A replica whose call failed is left out this long (the coordinator's member list lags its death).
    FAILED_SECONDS = 10.0

    def __init__(
        self,
        pressure_threshold: float = 0.0,
        queue_size: int = 256,
        wait_seconds: float = 600.0,
        session_tokens: int = 0,
    ) -> None:
        self.pressure_threshold = pressure_threshold
        self.session_tokens = session_tokens
        self._finished: deque[int] = deque(maxlen=64)  # sizes of the latest sessions that ended
        self.queue_size = queue_size
        self.wait_seconds = wait_seconds
        self.replicas: dict[str, ReplicaState] = {}
        self.session_replica: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.queue: deque[str] = deque()
        self.stats = RouterStats()
        self._changed = asyncio.Event()

    def _state(self, name: str) -> ReplicaState:
        return self.replicas.setdefault(name, ReplicaState())

    def live(self, replicas: list[Replica]) -> list[Replica]:
        now = time.monotonic()
        return [r for r in replicas if now - self._state(r.name).failed_at > self.FAILED_SECONDS]

    def reserve(self) -> int:
        """Tokens a session is expected to grow to: `session_tokens`, else the mean of the latest ended ones."""
        if self.session_tokens:
            return self.session_tokens
        return sum(self._finished) // len(self._finished) if self._finished else 0

    def pressure(self, name: str, joining: int = 0) -> float:
        """The admitted sessions' tokens (each at least the reserve) over the replica's KV capacity."""
        kv = self._state(name).kv
        if kv is None or not kv.capacity_tokens:
            return 0.0
        reserve = self.reserve()
        held = sum(max(self.sizes.get(s, 0), reserve) for s in self._state(name).sessions)
        return (held + joining) / kv.capacity_tokens

    def _has_room(self, name: str, size: int) -> bool:
        """Room for one more session: none admitted yet, or the pressure with it stays at the threshold or under."""
        state = self._state(name)
        if not state.sessions:
            return True
        if state.reports_kv is None:  # its capacity is not known yet: one session until its first reply
            return False
        return self.pressure(name, max(size, self.reserve())) <= self.pressure_threshold

    def _least_loaded(self, replicas: list[Replica]) -> Replica:
        def load(r: Replica) -> tuple:
            state = self._state(r.name)
            return (len(state.sessions), state.in_flight + r.load, r.name)

        return min(replicas, key=load)

    def _assign(self, session: str, replica: Replica) -> Replica:
        old = self.session_replica.get(session)
        if old is not None:
            self._state(old).sessions.discard(session)
        self.session_replica[session] = replica.name
        self._state(replica.name).sessions.add(session)
        return replica

    def route(self, session: str | None, replicas: list[Replica], size: int) -> Replica | None:
        """The replica for this call, or None: a new session that must wait (call `wait`, then route again).

        `replicas` are the live replicas holding the job (not empty); `size` the call's prompt tokens.
        """
        replicas = self.live(replicas) or replicas
        if session is None:  # a call no session records: no stickiness, no admission
            return self._least_loaded(replicas)
        sticky = self.session_replica.get(session)
        if sticky is not None:
            for r in replicas:
                if r.name == sticky:
                    return r
            self.stats.moved_sessions += 1
            return self._assign(session, self._least_loaded(replicas))
        self.sizes[session] = max(self.sizes.get(session, 0), size)
        if self.pressure_threshold <= 0:
            return self._assign(session, self._least_loaded(replicas))
        room = [r for r in replicas if self._has_room(r.name, size)]
        if session not in self.queue:
            if room and not self.queue:
                return self._assign(session, self._least_loaded(room))
            if len(self.queue) >= self.queue_size:
                self.stats.refused_sessions += 1
                raise AdmissionRefused(
                    f"{len(self.queue)} new sessions already wait for room on a replica (admission queue full)"
                )
            self.queue.append(session)
            self.stats.queued_sessions += 1
        if self.queue[0] != session or not room:
            return None
        self.queue.popleft()
        self._changed.set()  # the next in line may fit too
        return self._assign(session, self._least_loaded(room))

    async def wait(self, timeout: float) -> None:
        """Until something that may admit a queued session happened, or `timeout` seconds."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def abandon(self, session: str) -> None:
        """A queued session gave up (waited too long, or its caller left)."""
        if session in self.queue:
            self.queue.remove(session)
            self._changed.set()

    def failed(self, name: str) -> None:
        """A call to `name` failed: leave it out for a while; its sessions move on their next call."""
        self._state(name).failed_at = time.monotonic()

    def served(self, name: str, kv: Any) -> None:
        state = self._state(name)
        state.failed_at = -1e9
        state.reports_kv = kv is not None and kv.capacity_tokens > 0
        if kv is not None:
            state.kv = kv
        self._changed.set()

    def note_size(self, session: str, tokens: int) -> None:
        if session in self.session_replica:
            self.sizes[session] = tokens
            self._changed.set()

    def release(self, session: str) -> None:
        """The session ended (deleted, expired or lost): its replica has room again."""
        self.abandon(session)
        name = self.session_replica.pop(session, None)
        size = self.sizes.pop(session, None)
        if name is not None and size:
            self._finished.append(size)
        if name is not None:
            self._state(name).sessions.discard(session)
            self._changed.set()

    def snapshot(self) -> dict[str, Any]:
        replicas = {}
        for name, state in sorted(self.replicas.items()):
            kv = state.kv
            replicas[name] = {
                "sessions": len(state.sessions),
                "in_flight": state.in_flight,
                "admission_pressure": round(self.pressure(name), 4),
                "kv_pressure": round(kv.pressure, 4) if kv is not None else None,
                "kv_capacity_tokens": kv.capacity_tokens if kv is not None else None,
                "prefill_tokens_computed": kv.prefill_tokens_computed if kv is not None else None,
                "prefill_tokens_saved": kv.prefill_tokens_saved if kv is not None else None,
                "evictions": kv.evictions if kv is not None else None,
            }
        return {
            "admission": {
                "pressure_threshold": self.pressure_threshold,
                "queue_size": self.queue_size,
                "queue_depth": len(self.queue),
                "session_tokens": self.reserve(),
            },
            "sessions": len(self.session_replica),
            **vars(self.stats),
            "replicas": replicas,
        }
