"""The payloads staged for the collector's groups, from their making to the put: a single-turn group's by
its rollout replica, an agent group's by the policy endpoint, one part per trial.

    Collector._make_group_once ─received(reply)─> byte counters (arrays here, or staged there)
                               ─keep(group, reply, task, seed)─> held by group id
    agent groups: agent_trials(agent, ...) ─AgentTrials.group─> trials (each with its staged part, or its
        arrays where the endpoint could not stage: staged from here) ─agent_trial.assemble─> the group's
        payload, held as above (hold); a part gone before the assembly: the group is made again
    Collector.deliver ─take(group)─> JobBuffer.put(metadata, staged)   (StagedPayloadGone: make it again)
    a group that will not be put (dropped, made again, unscorable) ─discard(group)─> JobBuffer.discard: DEL
    (a group the buffer refused: Collector.deliver discards what it took)

Guarantees: at most one staged payload is held per group id, the latest attempt's: keeping another
deletes the one before; `take` hands it out once; `discard` deletes it from the data plane (a Redis
failure leaves it to its expiry, logged by JobBuffer); `forget` drops it without awaiting anything (a
cancelled making), leaving it to expire. An agent group with a data plane is put only as one assembled
payload, its trials' parts in trajectory order, so its metadata carries no token array: a trial whose
endpoint could not stage is staged from here (the same agent_trial.stage_part, checked the same way: one
it refuses fails the group, its parts deleted), and a group whose parts could not be assembled (one
expired, the Redis failed) is made again, at most max_regenerations times (counted in the agent's
regenerated_groups), its leftover parts deleted. Either failure ends as GroupUnscorable: one failed group,
never the job. `received()` counts the payload bytes that came to the
coordinator (`arrays`: token arrays in Generate replies, 4 per prompt id, completion id and logprob;
`trial_arrays`: those of trajectories read from the endpoint, endpoint_sessions.py) and those staged
elsewhere instead (`rollout_staged`, `endpoint_staged`).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import SamplingConfig
from dockyard.experience import payload as packed
from dockyard.experience import single_turn
from dockyard.experience.agent_trial import PartGone, assemble, stage_part
from dockyard.experience.data_plane import DataPlane
from dockyard.rpc.errors import InvalidArgument
from dockyard.tasks.task import Task
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.endpoint_sessions import discard
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.job_buffer import JobBuffer, StagedPayload
from services.coordinator.trials import Trial

log = structlog.get_logger()


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
        self._received = {"arrays": 0, "rollout_staged": 0, "trial_arrays": 0, "endpoint_staged": 0}

    def received(self, reply: rollout_pb2.GenerateResponse | None = None) -> dict[str, int]:
        """Count `reply`'s payload bytes (if given); a copy of the counts so far."""
        if reply is not None:
            self._received["arrays"] += single_turn.array_bytes(reply)
            self._received["rollout_staged"] += reply.payload_bytes
        return dict(self._received)

    async def keep(self, group_id: str, reply: rollout_pb2.GenerateResponse, task: Task, seed: int) -> None:
        """Hold the payload `reply` staged (if it did) for the group's put; an earlier attempt's is deleted."""
        await self.hold(
            group_id, StagedPayload(reply.payload_key, reply.payload_bytes) if reply.payload_key else None, task, seed
        )

    async def hold(self, group_id: str, payload: StagedPayload | None, task: Task, seed: int) -> None:
        """Hold a payload staged for the group (if any) for its put; an earlier attempt's is deleted."""
        await self.discard(group_id)
        if payload is not None:
            self._held[group_id] = Staged(payload, task, seed)

    async def agent_trials(
        self, agent: AgentTrials, task: Task, group_id: str, seed: int, n: int, sampling: SamplingConfig, retries: int
    ) -> tuple[list[Trial], StagedPayload | None]:
        """The group's scored trials and, with a data plane, their payload assembled there (None without one)."""
        for attempt in range(retries + 1):
            trials = await agent.group(task, group_id, seed, n, sampling)
            for trial in trials:
                self._received["trial_arrays"] += trial.received_bytes
                self._received["endpoint_staged"] += trial.part.size if trial.part else 0
            plane = self._buffer.data_plane
            if plane is None:
                return trials, None
            try:
                return trials, await self._assemble(plane, group_id, trials)
            except InvalidArgument as exc:  # a carried trial the buffer would refuse: the group fails, named by it
                await discard(plane, [t.part for t in trials])
                raise GroupUnscorable(f"group {group_id!r}: the buffer refuses a trial: {exc}", str(exc)) from None
            except (PartGone, RedisError, OSError) as exc:
                await discard(plane, [t.part for t in trials])
                if attempt == retries:
                    raise GroupUnscorable(
                        f"group {group_id!r}: its parts could not be assembled in {retries + 1} attempts",
                        f"{type(exc).__name__}: {exc}",
                    ) from None
                agent.regenerated_groups += 1
                log.warning("an agent group's parts could not be assembled; making it again", error=repr(exc))
        raise AssertionError("unreachable")

    async def _assemble(self, plane: DataPlane, group_id: str, trials: list[Trial]) -> StagedPayload:
        parts: list[str | None] = []
        for trial in trials:
            if trial.part is None and packed.has_tokens(trial.trajectory):  # the endpoint could not stage it
                key, size = await stage_part(plane, self._buffer.job_id, trial.trajectory)
                self._buffer.sent_bytes["staged"] += size
                metadata, _ = packed.split(common_pb2.Group(trajectories=[trial.trajectory]))
                trial.part, trial.trajectory = StagedPayload(key, size), metadata.trajectories[0]
            parts.append(trial.part.key if trial.part else None)
        key, size = await assemble(plane, self._buffer.job_id, group_id, parts)
        for trial in trials:
            trial.part = None  # the parts are gone: the group's payload holds them
        return StagedPayload(key, size)

    def take(self, group_id: str) -> Staged | None:
        return self._held.pop(group_id, None)

    async def discard(self, group_id: str) -> None:
        """Delete the group's staged payload, if one is held: the group will not be put."""
        if (staged := self._held.pop(group_id, None)) is not None:
            await self._buffer.discard(staged.payload)

    def forget(self, group_id: str) -> None:
        self._held.pop(group_id, None)
