"""The payloads rollout replicas staged for the collector's single-turn groups, from Generate to the put.

    Collector._make_group_once ─received(reply)─> byte counters (arrays here, or staged there)
                               ─keep(group, reply, task, seed)─> held by group id
    Collector.deliver ─take(group)─> JobBuffer.put(metadata, staged)   (StagedPayloadGone: make it again)
    a group that will not be put (dropped, made again, unscorable) ─discard(group)─> JobBuffer.discard: DEL
    (a group the buffer refused: Collector.deliver discards what it took)

Guarantees: at most one staged payload is held per group id, the latest attempt's: keeping another
deletes the one before; `take` hands it out once; `discard` deletes it from the data plane (a Redis
failure leaves it to its expiry, logged by JobBuffer); `forget` drops it without awaiting anything
(a cancelled making), leaving it to expire. `received()` counts the payload bytes replicas sent the
coordinator (token arrays in replies: 4 per prompt id, completion id and logprob) and those they
staged instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.experience import single_turn
from dockyard.tasks.task import Task
from services.coordinator.job_buffer import JobBuffer, StagedPayload


@dataclass(frozen=True)
class Staged:
    """A made group's payload, staged by the rollout, and what makes the group again should it expire."""

    payload: StagedPayload
    task: Task
    seed: int


class StagedPayloads:
    def __init__(self, buffer: JobBuffer) -> None:
        self._buffer = buffer
        self._held: dict[str, Staged] = {}
        self._received = {"arrays": 0, "rollout_staged": 0}

    def received(self, reply: rollout_pb2.GenerateResponse | None = None) -> dict[str, int]:
        """Count `reply`'s payload bytes (if given); a copy of the counts so far."""
        if reply is not None:
            self._received["arrays"] += single_turn.array_bytes(reply)
            self._received["rollout_staged"] += reply.payload_bytes
        return dict(self._received)

    async def keep(self, group_id: str, reply: rollout_pb2.GenerateResponse, task: Task, seed: int) -> None:
        """Hold the payload `reply` staged (if it did) for the group's put; an earlier attempt's is deleted."""
        await self.discard(group_id)
        if reply.payload_key:
            self._held[group_id] = Staged(StagedPayload(reply.payload_key, reply.payload_bytes), task, seed)

    def take(self, group_id: str) -> Staged | None:
        return self._held.pop(group_id, None)

    async def discard(self, group_id: str) -> None:
        """Delete the group's staged payload, if one is held: the group will not be put."""
        if (staged := self._held.pop(group_id, None)) is not None:
            await self._buffer.discard(staged.payload)

    def forget(self, group_id: str) -> None:
        self._held.pop(group_id, None)
