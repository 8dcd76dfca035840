"""Semantics of the in-memory buffer backend, one property per test."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from dockyard.common.v1 import common_pb2
from dockyard.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.buffer.backend import BufferStats
from services.buffer.memory import MemoryBuffer
from services.buffer.settings import BufferSettings

JOB = "job-1"


def make_group(group_id: str, version: int = 0, job_id: str = JOB, n: int = 2) -> common_pb2.Group:
    """A valid group of `n` trajectories, all generated at `version`."""
    return common_pb2.Group(
        group_id=group_id,
        job_id=job_id,
        task_id=f"task-{group_id}",
        prompt="fix the bug",
        weight_version=version,
        trajectories=[
            common_pb2.Trajectory(
                trajectory_id=f"{group_id}/{i}",
                prompt_token_ids=[1, 2],
                completion_token_ids=[3, 4, 5],
                completion_logprobs=[-0.1, -0.2, -0.3],
                weight_version=version,
                reward=float(i),
                valid=True,
            )
            for i in range(n)
        ],
    )


def ids(groups: list[common_pb2.Group]) -> list[str]:
    return [g.group_id for g in groups]


async def test_put_is_idempotent_by_group_id():
    buffer = MemoryBuffer()
    assert await buffer.put_group(make_group("g1", version=0)) is False
    # Same id, different payload: still a duplicate, and the first payload stays.
    assert await buffer.put_group(make_group("g1", version=5, n=4)) is True
    groups, _ = await buffer.sample(JOB, trainer_step=0, max_groups=10, max_age=0)
    assert ids(groups) == ["g1"] and len(groups[0].trajectories) == 2
    assert await buffer.put_group(make_group("g1")) is True  # pending
    await buffer.ack(JOB, ["g1"])
    assert await buffer.put_group(make_group("g1")) is True  # acked
    assert await buffer.stats(JOB) == BufferStats(acked=1, puts=1, duplicate_puts=3)


async def test_put_of_a_dropped_id_is_a_duplicate():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("old", version=0))
    await buffer.sample(JOB, trainer_step=5, max_groups=1, max_age=1)
    assert await buffer.put_group(make_group("old", version=0)) is True
    assert (await buffer.stats(JOB)).held == 0


async def test_stored_group_is_a_copy_of_the_callers_message():
    buffer = MemoryBuffer()
    group = make_group("g1")
    await buffer.put_group(group)
    group.prompt = "mutated after put"
    groups, _ = await buffer.sample(JOB, 0, 1, 0)
    assert groups[0].prompt == "fix the bug"


async def test_age_bound_holds_for_every_returned_group_at_every_step():
    rng = random.Random(0)
    buffer = MemoryBuffer()
    max_age = 2
    returned: list[str] = []
    dropped = 0
    put = 0
    for step in range(30):
        # Collectors lag behind the trainer by 0..4 versions.
        for _ in range(rng.randint(0, 4)):
            await buffer.put_group(make_group(f"g{put}", version=max(0, step - rng.randint(0, 4))))
            put += 1
        groups, n_dropped = await buffer.sample(JOB, step, rng.randint(1, 3), max_age)
        assert all(step - g.weight_version <= max_age for g in groups), (step, [g.weight_version for g in groups])
        assert all(step - t.weight_version <= max_age for g in groups for t in g.trajectories)
        returned += ids(groups)
        dropped += n_dropped
    stats = await buffer.stats(JOB)
    assert len(returned) == len(set(returned)), "a group was returned twice"
    assert dropped > 0, "the scenario never exercised the age bound"
    assert len(returned) + dropped + stats.held == put


async def test_sample_returns_oldest_weight_version_first_then_put_order():
    buffer = MemoryBuffer()
    for group_id, version in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 3)]:
        await buffer.put_group(make_group(group_id, version))
    first, _ = await buffer.sample(JOB, trainer_step=3, max_groups=3, max_age=10)
    rest, _ = await buffer.sample(JOB, trainer_step=3, max_groups=3, max_age=10)
    assert ids(first) == ["b", "d", "c"]
    assert ids(rest) == ["a", "e"]


async def test_stale_groups_are_dropped_counted_and_never_returned():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("v0", 0))
    await buffer.put_group(make_group("v1", 1))
    await buffer.put_group(make_group("v2", 2))
    # At step 3 with max_age 1: ages 3 and 2 are too old, age 1 is fresh (bound inclusive).
    groups, dropped = await buffer.sample(JOB, trainer_step=3, max_groups=1, max_age=1)
    assert ids(groups) == ["v2"] and dropped == 2
    assert await buffer.stats(JOB) == BufferStats(pending=1, dropped_stale=2, puts=3)


async def test_stale_groups_are_dropped_even_when_max_groups_is_reached():
    buffer = MemoryBuffer()
    for i in range(3):
        await buffer.put_group(make_group(f"old{i}", 0))
    await buffer.put_group(make_group("new", 10))
    groups, dropped = await buffer.sample(JOB, trainer_step=10, max_groups=1, max_age=0)
    assert ids(groups) == ["new"] and dropped == 3


async def test_pending_groups_are_not_aged_out_or_returned_again():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("g", 0))
    await buffer.sample(JOB, 0, 1, 0)
    groups, dropped = await buffer.sample(JOB, trainer_step=100, max_groups=5, max_age=0)
    assert groups == [] and dropped == 0
    assert (await buffer.stats(JOB)).pending == 1
    assert await buffer.ack(JOB, ["g"]) == 1


async def test_ack_moves_pending_to_acked_and_repeating_it_is_a_noop():
    buffer = MemoryBuffer()
    for group_id in ("a", "b"):
        await buffer.put_group(make_group(group_id))
    await buffer.sample(JOB, 0, 2, 0)
    assert await buffer.ack(JOB, ["a"]) == 1
    assert await buffer.ack(JOB, ["a", "b", "b"]) == 1
    assert await buffer.ack(JOB, ["a", "b"]) == 0
    assert await buffer.stats(JOB) == BufferStats(acked=2, puts=2)


async def test_ack_of_an_id_never_put_is_not_found_and_changes_nothing():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("a"))
    await buffer.sample(JOB, 0, 1, 0)
    with pytest.raises(NotFound, match="'ghost'"):
        await buffer.ack(JOB, ["a", "ghost"])
    with pytest.raises(NotFound):
        await buffer.ack("other-job", ["a"])
    assert (await buffer.stats(JOB)).pending == 1


async def test_ack_of_a_held_id_never_sampled_is_failed_precondition():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("leased"))
    await buffer.sample(JOB, 0, 1, 0)
    await buffer.put_group(make_group("held"))
    with pytest.raises(FailedPrecondition, match="never sampled"):
        await buffer.ack(JOB, ["leased", "held"])
    assert await buffer.stats(JOB) == BufferStats(held=1, pending=1, puts=2)


async def test_ack_of_a_dropped_id_is_failed_precondition():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("old", 0))
    await buffer.sample(JOB, trainer_step=9, max_groups=1, max_age=0)
    with pytest.raises(FailedPrecondition, match="aged out"):
        await buffer.ack(JOB, ["old"])


async def test_acked_payloads_are_freed():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("g"))
    await buffer.sample(JOB, 0, 1, 0)
    await buffer.ack(JOB, ["g"])
    job = buffer._jobs[JOB]
    assert job.pending == {} and job.held == [] and job.acked == {"g"}


async def test_capacity_bounds_held_plus_pending_per_job():
    buffer = MemoryBuffer(max_groups=2)
    await buffer.put_group(make_group("a"))
    await buffer.put_group(make_group("b"))
    with pytest.raises(ResourceExhausted, match="full.*back off"):
        await buffer.put_group(make_group("c"))
    assert await buffer.put_group(make_group("a")) is True  # a retry is answered even when full
    assert await buffer.put_group(make_group("c", job_id="other-job")) is False  # per job
    await buffer.sample(JOB, 0, 1, 0)
    with pytest.raises(ResourceExhausted):  # pending still occupies space
        await buffer.put_group(make_group("c"))
    await buffer.ack(JOB, ["a"])
    assert await buffer.put_group(make_group("c")) is False
    assert await buffer.stats(JOB) == BufferStats(held=2, acked=1, puts=3, duplicate_puts=1)


async def test_jobs_are_isolated():
    buffer = MemoryBuffer()
    await buffer.put_group(make_group("g", job_id="a"))
    assert await buffer.put_group(make_group("g", job_id="b")) is False
    groups, _ = await buffer.sample("a", 0, 10, 0)
    assert [(g.job_id, g.group_id) for g in groups] == [("a", "g")]
    assert await buffer.stats("b") == BufferStats(held=1, puts=1)
    assert await buffer.stats("never-seen") == BufferStats()


def test_settings_refuse_an_unknown_backend(monkeypatch):
    monkeypatch.setenv("DOCKYARD_BUFFER_BACKEND", "redis")
    with pytest.raises(ValidationError, match="backend"):
        BufferSettings()


def test_settings_read_capacity_from_the_environment(monkeypatch):
    monkeypatch.setenv("DOCKYARD_BUFFER_MAX_GROUPS", "7")
    assert BufferSettings().max_groups == 7
    monkeypatch.setenv("DOCKYARD_BUFFER_MAX_GROUPS", "0")
    with pytest.raises(ValidationError, match="max_groups"):
        BufferSettings()
