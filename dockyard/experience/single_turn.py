"""A single-turn group's token arrays: one Generate's completions as trajectories, and their payload.

    rollout, told where to stage:  stage(plane, job, group, prompt ids, completions)
        ─token_trajectories─> split ─> payload ─DataPlane.stage (check_payload, SET EX ttl)─> the staged key
    coordinator: reply_trajectories(group, Generate reply) + verdicts ─> Group ─JobBuffer.put
        arrays in the reply (no data plane, staging failed): token_trajectories, packed and put as any group
        reply.payload_key: metadata trajectories (ids, sampled_tokens) ─> PutGroup(metadata, that key)

Guarantees: both writers build a group's trajectories with the same ids in the same order (completion
i is trajectory `<group>/<i>`), so a payload the rollout staged lines up with the metadata the
coordinator puts beside it; the payload holds token arrays only, never anything the coordinator
decides later (verdicts, rewards, validity); a reply's routing (a mixture-of-experts policy's, when the
job asked for it) goes into each trajectory as that completion's prompt rows then its own; the rollout
checks it as a valid trajectory of the group
(dockyard/experience/checks.py: every trajectory must have tokens), at least as strictly as any
verdict could make it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.experience import payload as packed
from dockyard.experience.data_plane import DataPlane

# A group's routing (a mixture-of-experts policy's): its shape and, per completion, the bytes of
# Trajectory.routing (its prompt's rows then its completion's).
Routing = tuple[common_pb2.RoutingShape, Sequence[bytes]]


class Sampled(Protocol):
    """One sampled completion: its token ids and one logprob per token (engine or protobuf Completion)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]


def trajectory_id(group_id: str, index: int) -> str:
    """The id of a group's `index`th completion."""
    return f"{group_id}/{index}"


def token_trajectories(
    group_id: str, prompt_token_ids: Sequence[int], completions: Sequence[Sampled], routing: Routing | None = None
) -> list[common_pb2.Trajectory]:
    """Each completion as a trajectory holding its id and token arrays (and routing) only, in order."""
    trajectories = [
        common_pb2.Trajectory(
            trajectory_id=trajectory_id(group_id, i),
            prompt_token_ids=prompt_token_ids,
            completion_token_ids=c.token_ids,
            completion_logprobs=c.logprobs,
        )
        for i, c in enumerate(completions)
    ]
    if routing is not None:
        shape, rows = routing
        for trajectory, data in zip(trajectories, rows, strict=True):
            trajectory.routing = data
            trajectory.routing_shape.CopyFrom(shape)
    return trajectories


def reply_routing(reply: rollout_pb2.GenerateResponse) -> Routing | None:
    """A Generate reply's routing per completion (GenerateRequest.return_routing); None when it has none."""
    if not reply.HasField("routing_shape"):
        return None
    return reply.routing_shape, [(c.prompt_routing or reply.prompt_routing) + c.routing for c in reply.completions]


async def stage(
    plane: DataPlane,
    job_id: str,
    group_id: str,
    prompt_token_ids: Sequence[int],
    completions: Sequence[Sampled],
    routing: Routing | None = None,
) -> tuple[str, int]:
    """Pack, check (InvalidArgument naming what is wrong) and stage the group's payload; (its key, its bytes)."""
    trajectories = token_trajectories(group_id, prompt_token_ids, completions, routing)
    group = common_pb2.Group(group_id=group_id, job_id=job_id, trajectories=trajectories)
    metadata, payload = packed.split(group)
    for trajectory in metadata.trajectories:
        trajectory.valid = True  # the strictest check: no verdict has made any trajectory invalid yet
    return await plane.stage(metadata, payload), len(payload)


def reply_trajectories(group_id: str, reply: rollout_pb2.GenerateResponse) -> list[common_pb2.Trajectory]:
    """A Generate reply's completions as trajectories: with their token arrays, or, where the rollout staged
    them (reply.payload_key), metadata only, each with the count of tokens it sampled."""
    if not reply.payload_key:
        return token_trajectories(group_id, reply.prompt_token_ids, reply.completions, reply_routing(reply))
    return [
        common_pb2.Trajectory(trajectory_id=trajectory_id(group_id, i), sampled_tokens=c.num_tokens)
        for i, c in enumerate(reply.completions)
    ]


def array_bytes(reply: rollout_pb2.GenerateResponse) -> int:
    """Bytes of token arrays a Generate reply carried (4 per prompt id, completion id and logprob; routing)."""
    tokens = 4 * (len(reply.prompt_token_ids) + sum(len(c.token_ids) + len(c.logprobs) for c in reply.completions))
    routing = len(reply.prompt_routing) + sum(len(c.routing) + len(c.prompt_routing) for c in reply.completions)
    return tokens + routing
