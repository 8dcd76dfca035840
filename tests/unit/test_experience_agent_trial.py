"""Agent trials' parts assembled in Redis: the group's payload is payload.pack's, byte for byte, and a part
that is gone or unreadable changes nothing (real redis-server: the assembly is a Lua script)."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.agent_trial import PartGone, assemble, stage_part
from dockyard.experience.data_plane import DataPlane, staging_base
from dockyard.rpc.errors import InvalidArgument

JOB = "job-1"


def trajectory(seed: int, segments: int) -> common_pb2.Trajectory:
    """A trial's tokens: `segments` segments of random ids, logprobs (not exact in float32) and 0/1 masks."""
    rng = random.Random(seed)
    t = common_pb2.Trajectory(trajectory_id=f"g/{seed}")
    for k in range(segments):
        n = rng.randrange(1, 9)
        fields = {
            "prompt_token_ids": [rng.randrange(50_000) for _ in range(rng.randrange(1, 7))],
            "completion_token_ids": [rng.randrange(50_000) for _ in range(n)],
            "completion_logprobs": [-rng.random() * 5 for _ in range(n)],
            "completion_loss_mask": [rng.randrange(2) for _ in range(n)],
        }
        target = t if k == 0 else t.later_segments.add()
        for name, values in fields.items():
            getattr(target, name).extend(values)
    return t


async def connected(url: str) -> DataPlane:
    limits = buffer_pb2.GetDataPlaneResponse(
        redis_url=url, key_prefix="dockyard:buffer", staging_ttl_seconds=60, max_trajectory_tokens=200
    )
    plane = await DataPlane.connect(limits)
    assert plane is not None
    return plane


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("shape", [(1, 3, 0, 2), (0, 0), (5,), (1, 1, 1, 1, 1, 1, 1, 1)])
def test_assembled_parts_are_the_packed_group_byte_for_byte(redis_server: str, shape) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        trials = [trajectory(i + 10 * len(shape), n) for i, n in enumerate(shape)]
        parts = [(await stage_part(plane, JOB, t))[0] if n else None for t, n in zip(trials, shape, strict=True)]
        key, size = await assemble(plane, JOB, "g", parts)
        assert key.startswith(staging_base("dockyard:buffer", JOB) + "g:")
        assert client.get(key) == packed.pack(trials) and size == len(packed.pack(trials))
        assert 0 < client.ttl(key) <= 60
        assert client.dbsize() == 1  # every part went into the group's payload
        await plane.close()

    run(go())


def test_a_part_gone_or_unreadable_changes_nothing(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        parts = [(await stage_part(plane, JOB, trajectory(i, 2)))[0] for i in range(3)]
        client.delete(parts[1])  # expired
        with pytest.raises(PartGone, match="PARTGONE"):
            await assemble(plane, JOB, "g", parts)
        assert sorted(k.decode() for k in client.keys()) == sorted([parts[0], parts[2]])  # nothing written or deleted
        client.set(parts[1], b"DYP\x01garbage")
        with pytest.raises(PartGone, match="one-trajectory payload"):
            await assemble(plane, JOB, "g", parts)
        client.set(parts[1], packed.pack([trajectory(1, 2), trajectory(2, 1)]))  # two trajectories: not a part
        with pytest.raises(PartGone, match="one-trajectory payload"):
            await assemble(plane, JOB, "g", parts)
        truncated = packed.pack([trajectory(1, 2)])[:-4]
        client.set(parts[1], truncated)
        with pytest.raises(PartGone, match="does not match its header"):
            await assemble(plane, JOB, "g", parts)
        assert client.dbsize() == 3
        await plane.close()

    run(go())


def test_a_part_the_trainer_could_not_train_on_is_never_staged(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()

    async def go() -> None:
        plane = await connected(redis_server)
        bad = trajectory(0, 1)
        bad.completion_logprobs[0] = 0.5  # a positive logprob
        with pytest.raises(InvalidArgument, match="completion_logprobs"):
            await stage_part(plane, JOB, bad)
        long = trajectory(1, 40)  # more than max_trajectory_tokens (200) over its segments
        with pytest.raises(InvalidArgument, match="DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS"):
            await stage_part(plane, JOB, long)
        assert client.dbsize() == 0
        await plane.close()

    run(go())
