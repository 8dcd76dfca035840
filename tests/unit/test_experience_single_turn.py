"""The split of a single-turn group between the rollout (payload) and the coordinator (metadata): what each
side builds lines up, so the trainer reads the same group whichever side held the token arrays."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.experience import payload, single_turn
from dockyard.experience.checks import check_payload
from dockyard.experience.data_plane import DataPlane
from dockyard.rpc.errors import InvalidArgument
from services.coordinator.rewards import sampled_tokens

GROUP = "job-1/s1/g0"
PROMPT = [11, 12, 13]
COMPLETIONS = [
    rollout_pb2.Completion(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.2, -0.3, -0.4], num_tokens=4, text="a"),
    rollout_pb2.Completion(token_ids=[9], logprobs=[-1.5], num_tokens=1, text="b"),
]


def arrays_reply() -> rollout_pb2.GenerateResponse:
    return rollout_pb2.GenerateResponse(prompt_token_ids=PROMPT, completions=COMPLETIONS, weight_version=3)


def staged_reply(size: int) -> rollout_pb2.GenerateResponse:
    reply = rollout_pb2.GenerateResponse(weight_version=3, payload_key="k", payload_bytes=size)
    for c in COMPLETIONS:
        reply.completions.add(num_tokens=c.num_tokens, text=c.text)
    return reply


def scored(trajectories: list[common_pb2.Trajectory]) -> common_pb2.Group:
    """What the coordinator adds after generation: texts, versions, verdicts, rewards, validity."""
    for i, (t, c) in enumerate(zip(trajectories, COMPLETIONS, strict=True)):
        t.completion_text = c.text
        t.weight_version = 3
        t.verdict.status = common_pb2.VERDICT_STATUS_PASSED if i == 0 else common_pb2.VERDICT_STATUS_ERROR
        t.reward, t.valid = (1.0, True) if i == 0 else (0.0, False)
    return common_pb2.Group(group_id=GROUP, job_id="job-1", weight_version=3, trajectories=trajectories)


def rollout_payload() -> bytes:
    """The payload as the rollout packs it (single_turn.stage, before its SET)."""
    group = common_pb2.Group(group_id=GROUP, trajectories=single_turn.token_trajectories(GROUP, PROMPT, COMPLETIONS))
    return payload.split(group)[1]


def test_the_rollouts_payload_and_the_coordinators_metadata_make_the_group_the_arrays_path_makes() -> None:
    whole = scored(single_turn.reply_trajectories(GROUP, arrays_reply()))  # no data plane: arrays here
    metadata_then, payload_then = payload.split(whole)
    data = rollout_payload()
    assert data == payload_then  # the payload never depends on verdicts, rewards or validity

    metadata = scored(single_turn.reply_trajectories(GROUP, staged_reply(len(data))))
    assert [t.trajectory_id for t in metadata.trajectories] == [f"{GROUP}/0", f"{GROUP}/1"]
    assert not any(payload.has_tokens(t) for t in metadata.trajectories)
    check_payload(metadata, data, max_tokens=100)  # the buffer's rules, as the trainer will read it
    # Field for field the arrays path's group, but for the count metadata carries in place of the arrays.
    merged = payload.merge(metadata, data)
    for t in merged.trajectories:
        t.ClearField("sampled_tokens")
    assert merged == whole
    assert [sampled_tokens(t) for t in metadata.trajectories] == [sampled_tokens(t) for t in whole.trajectories]
    assert [sampled_tokens(t) for t in metadata.trajectories] == [4, 1]
    assert metadata_then.ByteSize() < metadata.ByteSize()  # sampled_tokens: the only addition


def test_arrays_in_a_reply_are_counted_and_a_staged_reply_carries_none() -> None:
    assert single_turn.array_bytes(arrays_reply()) == 4 * (3 + 2 * (4 + 1))
    assert single_turn.array_bytes(staged_reply(100)) == 0


async def test_the_rollout_checks_every_trajectory_as_valid_before_any_set() -> None:
    # No command reaches this client's Redis: the check refuses first (nothing listens on port 1).
    client = aioredis.Redis.from_url("redis://127.0.0.1:1/0")
    plane = DataPlane(client, buffer_pb2.GetDataPlaneResponse(key_prefix="p", max_trajectory_tokens=100))
    empty = rollout_pb2.Completion(num_tokens=0)
    with pytest.raises(InvalidArgument, match=r"trajectories\[0\].*prompt_token_ids is empty"):
        await single_turn.stage(plane, "job-1", GROUP, [], [empty])  # not yet scored, yet refused
    with pytest.raises(InvalidArgument, match="at most 5"):
        plane = DataPlane(client, buffer_pb2.GetDataPlaneResponse(key_prefix="p", max_trajectory_tokens=5))
        await single_turn.stage(plane, "job-1", GROUP, PROMPT, COMPLETIONS)
    await client.aclose()
