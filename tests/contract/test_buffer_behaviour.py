"""The semantics of services/buffer/backend.py, one property per test, for every backend.

Each test runs against the in-memory reference, against the Redis Streams
backend on a real redis-server (flushed before every test), and against that
backend driven through its data plane (every payload staged in Redis by its
writer and read back by reference, StagedPuts); a few tests at the end check
what only Redis has: PEL hygiene, deleted entries, key bounds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload
from dockyard.experience.data_plane import staging_base
from dockyard.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.buffer.backend import MAX_VERSION, BufferBackend, BufferStats, StagedPayload, StoredGroup
from services.buffer.memory import MemoryBuffer
from services.buffer.redis_backend import RedisBuffer
from services.buffer.settings import BufferSettings
from tests.conftest import dead_address, make_group

JOB = "job-1"
BIG = 1 << 30  # max_bytes that never limits


@pytest.fixture
async def raw(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the test Redis, its database flushed."""
    client = aioredis.Redis.from_url(redis_server)
    await client.flushdb()
    yield client
    await client.aclose()


class StagedPuts(BufferBackend):
    """The Redis backend as the data plane's clients drive it: each payload SET under a staging key by
    its writer and put by put_staged, each sample and reclaim by reference with the payloads read by
    GET. A group put whole is split on the way in and merged on the way out, so it comes back whole,
    as the other backends return it; StoredGroup.size is that of metadata and payload."""

    def __init__(self, inner: RedisBuffer, client: aioredis.Redis) -> None:
        self._inner, self._client = inner, client
        self._whole: set[str] = set()

    def data_plane_prefix(self) -> str:
        return self._inner.data_plane_prefix()

    async def open_job(self, job_id, max_groups, max_age, rewind_to=None):
        await self._inner.open_job(job_id, max_groups, max_age, rewind_to)

    async def close_job(self, job_id):
        await self._inner.close_job(job_id)

    async def put_group(self, group, payload_bytes=b""):
        metadata, data = (group, payload_bytes) if payload_bytes else payload.split(group)
        key = f"{staging_base(self._inner.data_plane_prefix(), group.job_id)}{group.group_id}:{random.random()}"
        await self._client.set(key, data, ex=600)
        answer = await self._inner.put_staged(metadata, StagedPayload(key, len(data)))
        if not payload_bytes and answer == (False, False):
            self._whole.add(group.group_id)
        return answer

    async def _read(self, groups: list[StoredGroup]) -> list[StoredGroup]:
        out = []
        for g in groups:
            data = await self._client.get(g.payload_key)
            assert data is not None, f"{g.group_id}: its payload key {g.payload_key} is gone while leased"
            if g.group_id in self._whole:
                whole = payload.merge(g.group(), data).SerializeToString()
                out.append(StoredGroup(g.group_id, g.weight_version, whole))
            else:
                out.append(StoredGroup(g.group_id, g.weight_version, g.metadata, data))
        return out

    async def sample(self, job_id, consumer, trainer_version, max_groups, max_bytes, *, by_reference=False, lease=None):
        groups, dropped = await self._inner.sample(
            job_id, consumer, trainer_version, max_groups, max_bytes, by_reference=True, lease=lease
        )
        return await self._read(groups), dropped

    async def reclaim(
        self, job_id, consumer, trainer_version, max_groups, max_bytes, min_idle, *, by_reference=False, lease=None
    ):
        groups, dropped = await self._inner.reclaim(
            job_id, consumer, trainer_version, max_groups, max_bytes, min_idle, by_reference=True, lease=lease
        )
        return await self._read(groups), dropped

    async def take_lease(self, job_id, consumer):
        return await self._inner.take_lease(job_id, consumer)

    async def ack(self, job_id, group_ids, weight_version, lease=None):
        return await self._inner.ack(job_id, group_ids, weight_version, lease)

    async def stats(self, job_id):
        return await self._inner.stats(job_id)

    async def close(self):
        await self._inner.close()
        await self._client.aclose()

    # What the Redis-only checks of these tests look at.
    @property
    def _redis(self) -> aioredis.Redis:
        return self._inner._redis

    def job_keys_base(self, job_id: str) -> str:
        return self._inner.job_keys_base(job_id)


def stored_size(buffer: BufferBackend, group: common_pb2.Group) -> int:
    """StoredGroup.size of `group` put whole: split into metadata and payload by the data plane's writer."""
    if isinstance(buffer, StagedPuts):
        metadata, data = payload.split(group)
        return metadata.ByteSize() + len(data)
    return group.ByteSize()


@pytest.fixture(params=["memory", "redis", "redis-data-plane"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[BufferBackend]:
    if request.param == "memory":
        buffer: BufferBackend = MemoryBuffer()
    else:
        url = request.getfixturevalue("redis_server")
        buffer = await RedisBuffer.connect(url)
        await buffer._redis.flushdb()
        if request.param == "redis-data-plane":
            buffer = StagedPuts(buffer, aioredis.Redis.from_url(url))
    yield buffer
    await buffer.close()


@pytest.fixture
async def redis_backend(redis_server: str, raw: aioredis.Redis) -> AsyncIterator[RedisBuffer]:
    buffer = await RedisBuffer.connect(redis_server)
    yield buffer
    await buffer.close()


def ids(groups: list[common_pb2.Group]) -> list[str]:
    return [g.group_id for g in groups]


async def opened(buffer: BufferBackend, max_groups: int = 100, max_age: int = 10, job_id: str = JOB) -> BufferBackend:
    await buffer.open_job(job_id, max_groups, max_age)
    return buffer


async def at_version(buffer: BufferBackend, version: int, job_id: str = JOB) -> None:
    """Moves the job's clock to `version`, as the coordinator does on a resume (OpenJob's rewind_to_version)."""
    stats = await buffer.stats(job_id)
    await buffer.open_job(job_id, stats.max_groups, stats.max_age, version)


async def sample(buffer: BufferBackend, version: int, n: int = 100, max_bytes: int = BIG, consumer: str = "t0"):
    return await buffer.sample(JOB, consumer, version, n, max_bytes)


async def reclaim(
    buffer: BufferBackend, version: int, n: int = 100, min_idle: float = 0.0, max_bytes: int = BIG, consumer="t1"
):
    return await buffer.reclaim(JOB, consumer, version, n, max_bytes, min_idle)


async def assert_balanced(buffer: BufferBackend, job_id: str = JOB) -> BufferStats:
    s = await buffer.stats(job_id)
    assert s.puts == s.held + s.pending + s.acked + s.dropped_stale, s
    assert sum(s.held_versions.values()) == s.held, s
    return s


# --- jobs -------------------------------------------------------------------------------------


async def test_every_method_of_an_unknown_job_is_not_found(backend):
    calls = [
        backend.put_group(make_group("g", job_id="nope")),
        backend.sample("nope", "t", 0, 1, BIG),
        backend.reclaim("nope", "t", 0, 1, BIG, 0.0),
        backend.ack("nope", [], 0),
        backend.take_lease("nope", "t"),
        backend.stats("nope"),
        backend.close_job("nope"),
    ]
    for call in calls:
        with pytest.raises(NotFound, match="nope"):
            await call


async def test_open_job_starts_empty_and_a_repeat_updates_settings_keeping_groups(backend):
    await backend.open_job(JOB, 5, 2)
    assert await backend.stats(JOB) == BufferStats(max_groups=5, max_age=2)
    await backend.put_group(make_group("g"))
    await backend.open_job(JOB, 7, 3)
    assert await backend.stats(JOB) == BufferStats(held=1, puts=1, max_groups=7, max_age=3, held_versions={0: 1})


async def test_close_job_forgets_everything_and_later_calls_are_not_found(backend):
    await opened(backend)
    await backend.put_group(make_group("g"))
    await backend.close_job(JOB)
    with pytest.raises(NotFound):
        await backend.stats(JOB)
    with pytest.raises(NotFound):
        await backend.put_group(make_group("g"))
    await backend.open_job(JOB, 3, 1)
    assert await backend.stats(JOB) == BufferStats(max_groups=3, max_age=1)
    assert await backend.put_group(make_group("g")) == (False, False)  # the id was forgotten too


async def test_jobs_never_see_each_others_groups_or_counters(backend):
    await opened(backend, job_id="a")
    await opened(backend, max_groups=1, job_id="b")
    await backend.put_group(make_group("g", job_id="a"))
    assert await backend.put_group(make_group("g", job_id="b")) == (False, False)
    groups, _ = await backend.sample("a", "t", 0, 10, BIG)
    assert [(g.group().job_id, g.group_id) for g in groups] == [("a", "g")]
    assert (await backend.stats("b")).held == 1
    await backend.close_job("a")
    assert (await backend.stats("b")).held == 1


async def test_job_ids_with_braces_and_percent_signs_stay_apart(backend):
    for job_id in ("x}y", "x%7Dy", "x"):
        await opened(backend, job_id=job_id)
        await backend.put_group(make_group(job_id, job_id=job_id))
    for job_id in ("x}y", "x%7Dy", "x"):
        groups, _ = await backend.sample(job_id, "t", 0, 10, BIG)
        assert ids(groups) == [job_id]


# --- put ------------------------------------------------------------------------------------


async def test_a_payload_comes_back_as_stored_by_sample_and_by_reclaim(backend):
    await opened(backend)
    whole = make_group("g", tokens=5)
    metadata, data = payload.split(whole)
    await backend.put_group(metadata, data)
    await backend.put_group(make_group("plain"))  # no payload: the whole Group is the metadata
    sampled, _ = await sample(backend, 0)
    assert [(g.group_id, g.metadata, g.payload) for g in sampled] == [
        ("g", metadata.SerializeToString(), data),
        ("plain", make_group("plain").SerializeToString(), b""),
    ]
    assert sampled[0].size == metadata.ByteSize() + len(data)
    again, _ = await reclaim(backend, 0, n=1)
    assert payload.merge(again[0].group(), again[0].payload) == whole


async def test_put_is_idempotent_by_group_id_in_every_state(backend):
    await opened(backend)
    assert await backend.put_group(make_group("g")) == (False, False)
    # Same id, different payload: still a duplicate, and the first payload stays.
    assert await backend.put_group(make_group("g", n=4)) == (True, False)
    groups, _ = await sample(backend, 0)
    assert ids(groups) == ["g"] and len(groups[0].group().trajectories) == 2
    assert await backend.put_group(make_group("g")) == (True, False)  # pending
    await backend.ack(JOB, ["g"], 0)
    assert await backend.put_group(make_group("g")) == (True, False)  # acked
    s = await assert_balanced(backend)
    assert (s.puts, s.duplicate_puts, s.acked) == (1, 3, 1)


async def test_put_of_a_dropped_id_is_a_duplicate(backend):
    await opened(backend, max_age=1)
    await backend.put_group(make_group("old", 0))
    await at_version(backend, 1)
    await sample(backend, 2)  # drops it
    assert await backend.put_group(make_group("old", 0)) == (True, False)
    assert (await backend.stats(JOB)).duplicate_puts == 1


async def test_a_duplicate_is_answered_even_when_full(backend):
    await opened(backend, max_groups=1)
    await backend.put_group(make_group("g"))
    assert await backend.put_group(make_group("g")) == (True, False)


async def test_stored_group_is_a_copy_of_the_callers_message(backend):
    await opened(backend)
    group = make_group("g")
    await backend.put_group(group)
    group.prompt = "mutated after put"
    groups, _ = await sample(backend, 0)
    assert [g.group() for g in groups] == [make_group("g")]


async def test_a_group_from_the_future_is_refused_and_nothing_stored(backend):
    await opened(backend)
    await at_version(backend, 3)
    with pytest.raises(FailedPrecondition, match="future"):
        await backend.put_group(make_group("g", 4))
    assert await backend.stats(JOB) == BufferStats(latest_version=3, max_groups=100, max_age=10)
    assert await backend.put_group(make_group("g", 3)) == (False, False)  # the id was not remembered


async def test_a_group_already_too_old_is_accepted_and_dropped_at_once(backend):
    await opened(backend, max_groups=1, max_age=2)
    await at_version(backend, 5)
    assert await backend.put_group(make_group("fresh", 3)) == (False, False)  # age 2: the bound is inclusive
    # Stale on arrival is answered before the capacity check: nothing would be stored.
    assert await backend.put_group(make_group("stale", 2)) == (False, True)
    s = await assert_balanced(backend)
    assert (s.puts, s.held, s.dropped_stale) == (2, 1, 1)
    groups, dropped = await sample(backend, 5)
    assert ids(groups) == ["fresh"] and dropped == 0


async def test_capacity_bounds_held_plus_pending_per_job(backend):
    await opened(backend, max_groups=2)
    await backend.put_group(make_group("a"))
    await backend.put_group(make_group("b"))
    with pytest.raises(ResourceExhausted, match="full"):
        await backend.put_group(make_group("c"))
    await sample(backend, 0, n=1)
    with pytest.raises(ResourceExhausted):  # pending still occupies space
        await backend.put_group(make_group("c"))
    await backend.ack(JOB, ["a"], 0)
    assert await backend.put_group(make_group("c")) == (False, False)
    s = await assert_balanced(backend)
    assert (s.held, s.pending, s.acked, s.puts) == (2, 0, 1, 3)
    assert await backend.put_group(make_group("c")) == (True, False)


async def test_capacity_change_by_open_job_applies_to_the_next_put(backend):
    await opened(backend, max_groups=1)
    await backend.put_group(make_group("a"))
    await backend.open_job(JOB, 2, 10)
    assert await backend.put_group(make_group("b")) == (False, False)


# --- sample ---------------------------------------------------------------------------------


async def test_sample_leases_oldest_version_first_ties_in_put_order(backend):
    await opened(backend)
    await at_version(backend, 3)
    for group_id, version in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 3)]:
        await backend.put_group(make_group(group_id, version))
    first, _ = await sample(backend, 3, n=3)
    rest, _ = await sample(backend, 3, n=3)
    assert ids(first) == ["b", "d", "c"]
    assert ids(rest) == ["a", "e"]
    assert await sample(backend, 3) == ([], 0)  # pending groups are never sampled again


async def test_sample_drops_stale_held_groups_counts_them_and_never_returns_them(backend):
    await opened(backend, max_age=1)
    for version in (0, 1, 2):
        await at_version(backend, version)  # held groups age without a sample
        await backend.put_group(make_group(f"v{version}", version))
    # At version 3 with max_age 1: ages 3 and 2 are too old, age 1 is fresh.
    groups, dropped = await sample(backend, 3, n=1)
    assert ids(groups) == ["v2"] and dropped == 2
    s = await assert_balanced(backend)
    assert (s.pending, s.dropped_stale, s.held, s.latest_version) == (1, 2, 0, 3)


async def test_sample_drops_every_stale_group_even_past_max_groups(backend):
    await opened(backend, max_age=0)
    for i in range(3):
        await backend.put_group(make_group(f"old{i}", 0))
    await at_version(backend, 4)
    await backend.put_group(make_group("new", 4))
    groups, dropped = await sample(backend, 4, n=1)
    assert ids(groups) == ["new"] and dropped == 3


async def test_sample_never_ages_out_pending_groups(backend):
    await opened(backend, max_age=0)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    await at_version(backend, 99)
    assert await sample(backend, 100) == ([], 0)
    assert (await backend.stats(JOB)).pending == 1
    assert await backend.ack(JOB, ["g"], 100) == 1


@pytest.mark.parametrize("call", ["sample", "reclaim", "ack"])
async def test_a_version_beyond_the_clock_is_refused_and_changes_nothing(backend, call):
    await opened(backend)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    before = await backend.stats(JOB)
    for version in (2, 2**53 + 1, 2**63 - 1):
        with pytest.raises(FailedPrecondition, match=f"version {version} "):
            if call == "sample":
                await sample(backend, version)
            elif call == "reclaim":
                await reclaim(backend, version)
            else:
                await backend.ack(JOB, ["g"], version)
    assert await backend.stats(JOB) == before
    # The clock is unharmed: the next step's puts, samples and acks go through.
    assert await backend.put_group(make_group("h", 0)) == (False, False)
    assert ids((await sample(backend, 1))[0]) == ["h"]
    assert await backend.ack(JOB, ["g", "h"], 1) == 2


async def test_an_ack_of_no_groups_never_moves_the_clock(backend):
    await opened(backend)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    before = await backend.stats(JOB)
    for version in (1, 3, 995, MAX_VERSION, MAX_VERSION + 1, 2**63 - 1):
        with pytest.raises(FailedPrecondition, match=f"(no group_ids.* to {version}|version {version} )"):
            await backend.ack(JOB, [], version)
    assert await backend.ack(JOB, [], 0) == 0  # at the clock: a no-op
    assert await backend.stats(JOB) == before
    # The job is undisturbed: its group is still fresh and acks at the next version.
    assert await backend.ack(JOB, ["g"], 1) == 1
    assert (await backend.stats(JOB)).latest_version == 1


async def test_an_ack_of_only_acked_groups_never_moves_the_clock(backend):
    await opened(backend)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    assert await backend.ack(JOB, ["g"], 0) == 1
    before = await backend.stats(JOB)
    with pytest.raises(FailedPrecondition, match="acks no leased group"):
        await backend.ack(JOB, ["g"], 1)
    assert await backend.stats(JOB) == before
    assert await backend.ack(JOB, ["g"], 0) == 0  # a retry at the clock: a no-op, as before


async def test_only_the_holder_of_the_trainer_lease_acks_and_moves_the_clock(backend):
    await opened(backend)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    before = await backend.stats(JOB)
    with pytest.raises(FailedPrecondition, match=f"lease \\(none\\) does not hold the trainer lease of job {JOB!r}"):
        await backend.ack(JOB, ["g"], 1, "")  # no lease taken yet: nobody holds it
    dead = await backend.take_lease(JOB, "trainer-0")
    owner = await backend.take_lease(JOB, "trainer-0")  # a restarted trainer takes it over
    assert dead != owner and owner.startswith("trainer-0/")
    for stranger in (dead, "", "trainer-0/" + "0" * 32, owner + "x"):
        with pytest.raises(FailedPrecondition, match=f"trainer lease of job {JOB!r}"):
            await backend.ack(JOB, ["g"], 1, stranger)
        with pytest.raises(FailedPrecondition, match="trainer lease"):
            await backend.ack(JOB, [], 0, stranger)
    assert await backend.stats(JOB) == before  # refused: nothing acked, the clock where it was
    assert await backend.ack(JOB, ["g"], 1, owner) == 1
    assert await backend.ack(JOB, ["g"], 1, owner) == 0  # the same ack again: a no-op that succeeds
    assert (await backend.stats(JOB)).latest_version == 1


@pytest.mark.parametrize("call", ["sample", "reclaim"])
async def test_a_sample_or_reclaim_that_moves_the_clock_needs_the_trainer_lease(backend, call):
    await opened(backend)
    await backend.put_group(make_group("g", 0))
    owner = await backend.take_lease(JOB, "trainer-0")

    def lease_at(version: int, lease: str):
        if call == "sample":
            return backend.sample(JOB, "trainer-0", version, 8, BIG, lease=lease)
        return backend.reclaim(JOB, "trainer-0", version, 8, BIG, 0.0, lease=lease)

    before = await backend.stats(JOB)
    for stranger in ("", "trainer-0/" + "0" * 32):
        with pytest.raises(FailedPrecondition, match=f"trainer_step 1 .*trainer lease of job {JOB!r}"):
            await lease_at(1, stranger)
    assert await backend.stats(JOB) == before  # refused: the clock where it was, nothing leased
    await lease_at(0, "")  # at the clock it moves nothing: no lease needed
    await lease_at(1, owner)
    assert (await backend.stats(JOB)).latest_version == 1


async def test_open_job_sets_the_clock_up_to_max_version(backend):
    await opened(backend)
    await at_version(backend, MAX_VERSION)
    assert (await backend.stats(JOB)).latest_version == MAX_VERSION
    assert await backend.put_group(make_group("g", MAX_VERSION)) == (False, False)
    assert await backend.put_group(make_group("old", MAX_VERSION - 11)) == (False, True)


async def test_sample_stops_at_max_bytes_but_returns_at_least_one_group(backend):
    await opened(backend)
    small, large = make_group("small", n=1), make_group("large", n=8)
    await backend.put_group(large)
    await backend.put_group(small)
    await backend.put_group(make_group("small2", n=1))
    groups, _ = await sample(backend, 0, max_bytes=1)  # nothing fits: one anyway
    assert ids(groups) == ["large"]
    budget = stored_size(backend, small) + stored_size(backend, make_group("small2", n=1))
    groups, _ = await sample(backend, 0, max_bytes=budget)
    assert ids(groups) == ["small", "small2"]


async def test_sample_stops_at_the_first_group_that_does_not_fit(backend):
    await opened(backend)
    small, large = make_group("s1", n=1), make_group("big", n=8)
    for group in (small, large, make_group("s2", n=1)):
        await backend.put_group(group)
    groups, _ = await sample(backend, 0, max_bytes=stored_size(backend, small) * 2)
    assert ids(groups) == ["s1"]  # "s2" would fit, but order comes first
    assert ids((await sample(backend, 0))[0]) == ["big", "s2"]


async def test_sample_and_reclaim_never_move_the_clock_backwards(backend):
    await opened(backend)
    await at_version(backend, 4)
    await sample(backend, 5)
    await sample(backend, 2)
    await reclaim(backend, 1)
    await backend.ack(JOB, [], 0)
    assert (await backend.stats(JOB)).latest_version == 5


async def test_open_job_rewinds_the_clock_for_a_resumed_trainer_keeping_groups(backend):
    await opened(backend, max_age=1)
    await backend.put_group(make_group("old", 0))
    await at_version(backend, 5)
    # Generated by weights resumed at version 2: stale against 5, fresh once the clock is rewound.
    assert await backend.put_group(make_group("lost-lineage", 2)) == (False, True)
    await backend.open_job(JOB, 100, 1, rewind_to=2)
    assert (await backend.stats(JOB)).latest_version == 2
    assert await backend.put_group(make_group("resumed", 2)) == (False, False)
    groups, dropped = await sample(backend, 2)
    assert ids(groups) == ["resumed"] and dropped == 1  # "old" (version 0) aged out
    await assert_balanced(backend)


async def test_a_rewind_drops_the_groups_of_versions_the_resumed_trainer_never_had(backend):
    await opened(backend, max_age=1)
    await at_version(backend, 3)
    for gid, version in (("v2", 2), ("v3-leased", 3), ("v3-held", 3)):
        await backend.put_group(make_group(gid, version))
    leased, _ = await sample(backend, 3, n=2)  # the trainer that dies holds a lease on v2 and v3-leased
    assert ids(leased) == ["v2", "v3-leased"]
    await backend.open_job(JOB, 100, 1, rewind_to=2)
    stats = await assert_balanced(backend)
    assert (stats.held, stats.pending, stats.dropped_stale) == (0, 1, 2)
    # Only the version-2 lease is left for the successor; nothing of version 3 is ever returned.
    again, _ = await reclaim(backend, 2)
    assert ids(again) == ["v2"]
    assert ids((await sample(backend, 2))[0]) == []
    # A retried put of a dropped group is a duplicate, never a second copy.
    assert await backend.put_group(make_group("v3-held", 2)) == (True, False)


async def test_age_bound_holds_for_every_returned_group_at_every_step(backend):
    rng = random.Random(0)
    max_age = 2
    await opened(backend, max_groups=1000, max_age=max_age)
    sampled: list[str] = []
    unacked: set[str] = set()
    dropped = stale_on_arrival = put = 0
    for step in range(30):
        # Collectors lag behind the trainer by 0..4 versions.
        for _ in range(rng.randint(0, 4)):
            answer = await backend.put_group(make_group(f"g{put}", version=max(0, step - rng.randint(0, 4))))
            stale_on_arrival += answer[1]
            put += 1
        groups, n_dropped = await sample(backend, step, n=rng.randint(1, 3))
        sampled += ids(groups)
        dropped += n_dropped
        if step % 3 == 2:  # the trainer died: its successor takes the leases over
            again, n_dropped = await reclaim(backend, step, n=rng.randint(1, 3))
            unacked = set()  # a stale lease was dropped, and the rest belong to the dead one
            groups += again
            dropped += n_dropped
        assert all(step - g.weight_version <= max_age for g in groups), (step, [g.weight_version for g in groups])
        assert all(step - t.weight_version <= max_age for g in groups for t in g.group().trajectories)
        unacked |= set(ids(groups))
        done = [group_id for group_id in sorted(unacked) if rng.random() < 0.5]
        if done:
            await backend.ack(JOB, done, step + 1)
        else:  # an ack of nothing cannot move the clock
            await at_version(backend, step + 1)
        unacked -= set(done)
        await assert_balanced(backend)
    s = await backend.stats(JOB)
    assert len(sampled) == len(set(sampled)), "sample returned a group twice"
    assert dropped > 0 and stale_on_arrival > 0 and s.reclaimed > 0, "the scenario missed a path"
    assert s.dropped_stale == dropped + stale_on_arrival
    assert s.puts == put


async def test_held_versions_counts_held_groups_per_version(backend):
    await opened(backend)
    await at_version(backend, 2)
    for group_id, version in [("a", 1), ("b", 1), ("c", 2)]:
        await backend.put_group(make_group(group_id, version))
    assert (await backend.stats(JOB)).held_versions == {1: 2, 2: 1}
    await sample(backend, 2, n=2)
    assert (await backend.stats(JOB)).held_versions == {2: 1}


# --- ack ------------------------------------------------------------------------------------


async def test_ack_moves_pending_to_acked_and_repeating_it_is_a_noop(backend):
    await opened(backend)
    for group_id in ("a", "b"):
        await backend.put_group(make_group(group_id))
    await sample(backend, 0)
    assert await backend.ack(JOB, ["a"], 0) == 1
    assert await backend.ack(JOB, ["a", "b", "b"], 0) == 1
    assert await backend.ack(JOB, ["a", "b"], 0) == 0
    s = await assert_balanced(backend)
    assert (s.acked, s.pending, s.puts) == (2, 0, 2)


async def test_ack_advances_the_clock_after_the_step(backend):
    await opened(backend)
    await backend.put_group(make_group("g"))
    await sample(backend, 0)
    await backend.ack(JOB, ["g"], 1)
    assert (await backend.stats(JOB)).latest_version == 1
    assert await backend.put_group(make_group("h", 1)) == (False, False)


async def test_ack_of_an_unknown_id_is_not_found_and_changes_nothing(backend):
    await opened(backend)
    await backend.put_group(make_group("a"))
    await sample(backend, 0)
    before = await backend.stats(JOB)
    with pytest.raises(NotFound, match="ghost"):
        await backend.ack(JOB, ["a", "ghost"], 1)
    assert await backend.stats(JOB) == before  # neither "a" acked nor the clock moved


async def test_ack_of_a_held_id_is_failed_precondition_and_changes_nothing(backend):
    await opened(backend)
    await backend.put_group(make_group("leased"))
    await sample(backend, 0)
    await backend.put_group(make_group("held"))
    before = await backend.stats(JOB)
    with pytest.raises(FailedPrecondition, match="never sampled"):
        await backend.ack(JOB, ["leased", "held"], 1)
    assert await backend.stats(JOB) == before


async def test_ack_of_a_dropped_id_is_failed_precondition_and_changes_nothing(backend):
    await opened(backend, max_age=0)
    await backend.put_group(make_group("old", 0))
    await at_version(backend, 1)
    await backend.put_group(make_group("leased", 1))
    groups, dropped = await sample(backend, 1)
    assert ids(groups) == ["leased"] and dropped == 1
    before = await backend.stats(JOB)
    with pytest.raises(FailedPrecondition, match="aged out"):
        await backend.ack(JOB, ["leased", "old"], 2)
    assert await backend.stats(JOB) == before


async def test_acked_payloads_are_freed(backend):
    await opened(backend)
    await backend.put_group(make_group("g"))
    await sample(backend, 0)
    await backend.ack(JOB, ["g"], 0)
    if isinstance(backend, MemoryBuffer):
        job = backend._jobs[JOB]
        assert job.pending == {} and job.held == []
    else:
        raw = backend._redis
        base = backend.job_keys_base(JOB)
        assert await raw.xlen(base + "v:0") == 0
        assert await raw.hlen(base + "entries") == 0


# --- reclaim --------------------------------------------------------------------------------


async def test_reclaim_takes_only_leases_idle_for_at_least_min_idle(backend):
    await opened(backend)
    await backend.put_group(make_group("g"))
    await sample(backend, 0)
    assert await reclaim(backend, 0, min_idle=60) == ([], 0)
    await asyncio.sleep(0.06)
    groups, dropped = await reclaim(backend, 0, min_idle=0.05)
    assert ids(groups) == ["g"] and dropped == 0
    s = await assert_balanced(backend)
    assert (s.pending, s.reclaimed) == (1, 1)


async def test_reclaim_restarts_the_lease_time(backend):
    await opened(backend)
    await backend.put_group(make_group("g"))
    await sample(backend, 0)
    await asyncio.sleep(0.06)
    assert ids((await reclaim(backend, 0, min_idle=0.05))[0]) == ["g"]
    assert await reclaim(backend, 0, min_idle=0.05) == ([], 0)


async def test_reclaim_takes_over_any_consumers_leases_its_own_included(backend):
    await opened(backend)
    for group_id in ("a", "b"):
        await backend.put_group(make_group(group_id))
    await sample(backend, 0, n=1, consumer="dead")
    await sample(backend, 0, n=1, consumer="me")
    groups, _ = await reclaim(backend, 0, consumer="me")
    assert sorted(ids(groups)) == ["a", "b"]
    assert await backend.ack(JOB, ["a", "b"], 1) == 2


async def test_reclaim_takes_the_oldest_lease_first(backend):
    await opened(backend)
    for group_id in ("a", "b"):
        await backend.put_group(make_group(group_id))
    await sample(backend, 0)  # both leased together: ties in put order
    await asyncio.sleep(0.02)
    assert ids((await reclaim(backend, 0, n=1))[0]) == ["a"]  # a's lease restarts
    await asyncio.sleep(0.02)
    assert ids((await reclaim(backend, 0, n=1))[0]) == ["b"]
    await asyncio.sleep(0.02)
    assert ids((await reclaim(backend, 0))[0]) == ["a", "b"]


async def test_reclaim_drops_stale_leases_counts_them_and_never_returns_them(backend):
    await opened(backend, max_age=1)
    await at_version(backend, 1)
    await backend.put_group(make_group("old", 0))
    await backend.put_group(make_group("new", 1))
    await sample(backend, 1)
    groups, dropped = await reclaim(backend, 2)
    assert ids(groups) == ["new"] and dropped == 1
    s = await assert_balanced(backend)
    assert (s.pending, s.dropped_stale, s.reclaimed) == (1, 1, 1)
    with pytest.raises(FailedPrecondition, match="aged out"):
        await backend.ack(JOB, ["old"], 2)


async def test_reclaim_keeps_stale_leases_that_are_not_idle_enough(backend):
    await opened(backend, max_age=0)
    await backend.put_group(make_group("g", 0))
    await sample(backend, 0)
    await at_version(backend, 4)
    assert await reclaim(backend, 5, min_idle=60) == ([], 0)
    assert await backend.ack(JOB, ["g"], 5) == 1


async def test_reclaim_never_returns_an_acked_group(backend):
    await opened(backend)
    for group_id in ("a", "b"):
        await backend.put_group(make_group(group_id))
    await sample(backend, 0)
    await backend.ack(JOB, ["a"], 0)
    groups, _ = await reclaim(backend, 0)
    assert ids(groups) == ["b"]


async def test_reclaim_stops_at_max_groups_and_max_bytes_but_returns_at_least_one(backend):
    await opened(backend)
    small = make_group("s1", n=1)
    for group in (make_group("big", n=8), small, make_group("s2", n=1)):
        await backend.put_group(group)
    await sample(backend, 0)
    # Sleeps keep lease times apart: Redis measures them in milliseconds.
    await asyncio.sleep(0.01)
    assert ids((await reclaim(backend, 0, max_bytes=1))[0]) == ["big"]
    await asyncio.sleep(0.01)
    assert ids((await reclaim(backend, 0, n=1))[0]) == ["s1"]
    await asyncio.sleep(0.01)
    # Oldest lease first: s2, then big (which does not fit) ends the reclaim.
    assert ids((await reclaim(backend, 0, max_bytes=stored_size(backend, small) * 3))[0]) == ["s2"]
    assert (await backend.stats(JOB)).reclaimed == 3


# --- invariants -----------------------------------------------------------------------------


async def test_counters_balance_after_every_operation_of_a_random_run(backend):
    rng = random.Random(1)
    await opened(backend, max_groups=12, max_age=2)
    version, n, leased = 0, 0, []
    for _ in range(150):
        op = rng.choice(["put", "put", "put", "sample", "reclaim", "ack", "tick"])
        try:
            if op == "put":
                group_id = f"g{rng.randint(0, n)}"  # sometimes a retry
                n += 1
                await backend.put_group(make_group(group_id, max(0, version - rng.randint(0, 3))))
            elif op == "sample":
                leased += ids((await sample(backend, version, n=rng.randint(1, 4)))[0])
            elif op == "reclaim":
                leased += ids((await reclaim(backend, version, n=rng.randint(1, 4)))[0])
            elif op == "ack" and leased:
                chosen = rng.sample(leased, rng.randint(1, len(leased)))
                await backend.ack(JOB, chosen, version)
            else:
                version += 1
        except (ResourceExhausted, FailedPrecondition, NotFound):
            pass  # full, from the future, an ack of a group that aged out or was long forgotten
        await assert_balanced(backend)
    s = await backend.stats(JOB)
    assert s.acked and s.dropped_stale and s.duplicate_puts and s.reclaimed, s


async def test_concurrent_calls_never_duplicate_or_lose_a_group(backend):
    await opened(backend, max_groups=1000)
    puts = [backend.put_group(make_group(f"g{i % 20}")) for i in range(60)]
    answers = await asyncio.gather(*puts)
    assert sum(not duplicate for duplicate, _ in answers) == 20
    results = await asyncio.gather(*(sample(backend, 0, n=3, consumer=f"t{i}") for i in range(10)))
    returned = [group_id for groups, _ in results for group_id in ids(groups)]
    assert sorted(returned) == sorted(f"g{i}" for i in range(20))


async def test_ids_are_remembered_while_their_version_could_be_fresh(backend):
    await opened(backend, max_age=2)
    await backend.put_group(make_group("v0", 0))
    await sample(backend, 0)
    await backend.ack(JOB, ["v0"], 0)
    await at_version(backend, 3)  # 0 >= 3 - 2 - 1: still remembered
    assert await backend.put_group(make_group("v0", 0)) == (True, False)
    await at_version(backend, 4)  # forgotten: a late retry is dropped as stale on arrival
    assert await backend.put_group(make_group("v0", 0)) == (False, True)
    with pytest.raises(NotFound):
        await backend.ack(JOB, ["never"], 4)


async def test_ids_of_a_version_still_pending_are_not_forgotten(backend):
    await opened(backend, max_age=0)
    await backend.put_group(make_group("slow", 0))
    await sample(backend, 0)
    await at_version(backend, 10)
    assert await backend.put_group(make_group("slow", 0)) == (True, False)
    assert await backend.ack(JOB, ["slow"], 10) == 1


async def remembered(buffer: BufferBackend) -> int:
    """What the backend keeps for the job: ids for memory, keys and hash fields for Redis."""
    if isinstance(buffer, MemoryBuffer):
        job = buffer._jobs[JOB]
        return buffer.num_remembered_ids(JOB) + len(job.held) + len(job.pending)
    raw, total = buffer._redis, 0
    async for key in raw.scan_iter(match="*"):
        kind = (await raw.type(key)).decode()
        total += 1
        if kind == "hash":
            total += await raw.hlen(key)
        elif kind == "zset":
            total += await raw.zcard(key)
        elif kind == "stream":
            total += await raw.xlen(key)
    return total


async def test_memory_stops_growing_over_many_versions(backend):
    await opened(backend, max_groups=50, max_age=2)
    sizes = []
    for step in range(40):
        for i in range(3):
            await backend.put_group(make_group(f"s{step}-{i}", step))
        await backend.put_group(make_group(f"late{step}", max(0, step - 3)))  # stale on arrival
        groups, _ = await sample(backend, step, n=2)
        await backend.ack(JOB, ids(groups), step + 1)
        sizes.append(await remembered(backend))
    # One group a step stays held and ages out; after the warm-up the size is periodic, not growing.
    assert max(sizes[20:]) == max(sizes[10:20]), sizes
    await assert_balanced(backend)


async def test_stats_of_a_fresh_job_report_its_settings(backend):
    await opened(backend, max_groups=9, max_age=4)
    assert await backend.stats(JOB) == BufferStats(max_groups=9, max_age=4)


# --- choosing a backend ---------------------------------------------------------------------


def test_settings_refuse_an_unknown_backend(monkeypatch):
    monkeypatch.setenv("DOCKYARD_BUFFER_BACKEND", "sqlite")
    with pytest.raises(ValidationError, match="backend"):
        BufferSettings()


def test_settings_refuse_the_redis_backend_without_a_url(monkeypatch):
    monkeypatch.setenv("DOCKYARD_BUFFER_BACKEND", "redis")
    monkeypatch.delenv("DOCKYARD_BUFFER_REDIS_URL", raising=False)
    with pytest.raises(ValidationError, match="DOCKYARD_BUFFER_REDIS_URL"):
        BufferSettings()
    monkeypatch.setenv("DOCKYARD_BUFFER_REDIS_URL", "redis://127.0.0.1:6379/0")
    assert BufferSettings().redis_url == "redis://127.0.0.1:6379/0"


async def test_connect_fails_at_once_on_an_unreachable_redis():
    with pytest.raises(aioredis.ConnectionError):
        await RedisBuffer.connect(f"redis://{dead_address()}/0")


# --- Redis only -----------------------------------------------------------------------------


async def xpending_total(raw: aioredis.Redis, base: str) -> int:
    total = 0
    async for key in raw.scan_iter(match=f"{base}v:*"):
        total += (await raw.xpending(key, "buffer"))["pending"]
    return total


async def test_redis_acks_and_drops_leave_no_pel_entries_or_stream_entries(redis_backend, raw):
    buffer = await opened(redis_backend, max_age=1)
    base = buffer.job_keys_base(JOB)
    for i in range(6):
        await buffer.put_group(make_group(f"g{i}", 0))
    groups, _ = await sample(buffer, 0, n=4)
    await buffer.ack(JOB, ids(groups)[:2], 0)
    assert await xpending_total(raw, base) == 2
    await buffer.ack(JOB, ids(groups)[2:], 1)
    await reclaim(buffer, 0)
    assert await xpending_total(raw, base) == 0
    assert await raw.xlen(base + "v:0") == 2  # the two still held
    await at_version(buffer, 4)
    await sample(buffer, 5)  # they age out
    assert await xpending_total(raw, base) == 0
    assert not await raw.exists(base + "v:0"), "a stale empty stream should be deleted"


async def test_redis_reclaim_skips_an_entry_deleted_while_pending_and_fixes_bookkeeping(redis_backend, raw):
    buffer = await opened(redis_backend)
    base = buffer.job_keys_base(JOB)
    for group_id in ("a", "b", "c"):
        await buffer.put_group(make_group(group_id))
    await sample(buffer, 0)
    entries = await raw.xrange(base + "v:0")
    assert await raw.xdel(base + "v:0", entries[1][0]) == 1  # "b", behind the buffer's back
    groups, dropped = await reclaim(buffer, 0)
    assert ids(groups) == ["a", "c"] and dropped == 1
    s = await assert_balanced(buffer)
    assert (s.pending, s.dropped_stale, s.reclaimed) == (2, 1, 2)
    assert await xpending_total(raw, base) == 2
    with pytest.raises(FailedPrecondition):
        await buffer.ack(JOB, ["b"], 0)
    assert await buffer.ack(JOB, ["a", "c"], 0) == 2
    assert await xpending_total(raw, base) == 0


async def test_redis_payload_keys_live_exactly_while_their_group_is_held_or_pending(redis_backend, raw):
    buffer = await opened(redis_backend, max_groups=2, max_age=1)
    base = buffer.job_keys_base(JOB)

    async def payload_keys() -> list[str]:
        return sorted([key.decode().removeprefix(base + "d:") async for key in raw.scan_iter(match=base + "d:*")])

    def put(group_id: str, version: int = 0, n: int = 2):
        return buffer.put_group(*payload.split(make_group(group_id, version, n=n)))

    await put("a")
    await put("a", n=5)  # a duplicate of a held group: the first payload stays
    await put("b")
    with pytest.raises(ResourceExhausted):
        await put("c")  # refused when full: nothing left behind
    assert await payload_keys() == ["a", "b"]
    [a], _ = await sample(buffer, 0, n=1)
    assert len(payload.unpack(a.payload)) == 2
    await buffer.ack(JOB, ["a"], 0)
    await put("a")  # a retry of an acked group: a duplicate, its payload freed again
    assert await payload_keys() == ["b"]
    await at_version(buffer, 2)
    await sample(buffer, 2)  # b ages out
    await put("old", 0)  # stale on arrival
    assert await payload_keys() == []
    await at_version(buffer, 3)
    await put("p", 3)
    await sample(buffer, 3)
    await buffer.open_job(JOB, 2, 1, rewind_to=2)  # the pending group came from lost weights
    assert await payload_keys() == []
    await put("q", 2)
    await put("r", 2)
    await sample(buffer, 2, n=1)  # one pending, one held at the close
    assert await payload_keys() == ["q", "r"]
    await buffer.close_job(JOB)
    assert await payload_keys() == []


async def test_redis_close_job_deletes_every_key_of_the_job_only(redis_backend, raw):
    await opened(redis_backend, max_age=0)
    await opened(redis_backend, job_id="other")
    await redis_backend.put_group(make_group("x", job_id="other"))
    for step in range(4):
        await redis_backend.put_group(make_group(f"g{step}", step))
        await sample(redis_backend, step)
        await redis_backend.put_group(make_group(f"h{step}", step))
        await at_version(redis_backend, step + 1)
    await redis_backend.close_job(JOB)
    left = [key.decode() async for key in raw.scan_iter(match="*")]
    assert left and all("{other}" in key for key in left), left


async def test_redis_key_count_stays_bounded_over_many_versions(redis_backend, raw):
    buffer = await opened(redis_backend, max_groups=50, max_age=1)
    counts = []
    for step in range(30):
        await buffer.put_group(make_group(f"g{step}", step))
        groups, _ = await sample(buffer, step)
        await buffer.ack(JOB, ids(groups), step + 1)
        counts.append(await raw.dbsize())
    assert max(counts[10:]) == counts[5], counts
    assert await raw.hlen(buffer.job_keys_base(JOB) + "index") <= 3


async def test_redis_state_is_shared_by_every_backend_instance(redis_backend, redis_server):
    await opened(redis_backend)
    await redis_backend.put_group(make_group("a"))
    await redis_backend.put_group(make_group("b"))
    await sample(redis_backend, 0, n=1)
    other = await RedisBuffer.connect(redis_server)
    try:
        assert await other.put_group(make_group("a")) == (True, False)
        assert ids((await other.reclaim(JOB, "t2", 0, 10, BIG, 0.0))[0]) == ["a"]
        assert ids((await other.sample(JOB, "t2", 0, 10, BIG))[0]) == ["b"]
        assert await other.stats(JOB) == await redis_backend.stats(JOB)
    finally:
        await other.close()


async def test_redis_and_memory_agree_on_a_random_run(redis_server, raw):
    rng = random.Random(7)
    memory, redis_buffer = MemoryBuffer(), await RedisBuffer.connect(redis_server)
    try:
        buffers = (memory, redis_buffer)
        for buffer in buffers:
            await opened(buffer, max_groups=10, max_age=2)
        version, n, leased = 0, 0, []
        for _ in range(120):
            op = rng.choice(["put", "put", "put", "sample", "reclaim", "ack", "tick"])
            args = (rng.randint(0, n), rng.randint(0, 3), rng.randint(1, 4), rng.randint(0, 2000))
            answers = []
            for buffer in buffers:
                try:
                    if op == "put":
                        answers.append(await buffer.put_group(make_group(f"g{args[0]}", max(0, version - args[1]))))
                    elif op == "sample":
                        groups, dropped = await sample(buffer, version, n=args[2], max_bytes=args[3])
                        answers.append((ids(groups), dropped))
                        if buffer is memory:
                            leased += ids(groups)
                    elif op == "reclaim":
                        # All of them: Redis ties leases of one millisecond, so a byte
                        # limit could pick a different subset of equally old leases.
                        groups, dropped = await reclaim(buffer, version)
                        answers.append((sorted(ids(groups)), dropped))
                    elif op == "ack":
                        answers.append(await buffer.ack(JOB, leased[args[0] % 3 :: 2], version))
                    else:
                        answers.append(None)
                except Exception as error:  # the same refusal from both is agreement too
                    answers.append(type(error).__name__)
                answers.append(await buffer.stats(JOB))
            assert answers[:2] == answers[2:], (op, args)
            n += op == "put"
            version += op == "tick"
    finally:
        await redis_buffer.close()
