"""The Redis-backed buffer as real processes: groups and leases survive a SIGKILL of either side.

Groups go in both ways, half staged in Redis by the coordinator's writer (the data plane: the
payload SET by the writer, PutGroup of the metadata), half streamed through the service
(PutGroupStream: metadata and packed payload), and come back whole.

redis-server runs with AOF on and appendfsync always, so every write it
acknowledged is on disk before the buffer service sees the reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dockyard.api.buffer.v1 import buffer_pb2 as pb
from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.experience import payload
from dockyard.rpc.client import connect
from services.coordinator.job_buffer import JobBuffer
from services.trainer.consumer import read_stream
from tests.conftest import RedisServer, make_group, redis_binary

pytestmark = pytest.mark.slow

JOB = "job-1"
PUT, SAMPLED = 8, 3


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, which the test may kill and start again on the same files."""
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(redis_binary(), directory)
    server.start()
    yield server
    server.stop()


def start_buffer(start_service, redis: RedisServer):
    return start_service("buffer", {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": redis.url})


def durable(stats: pb.GetStatsResponse) -> pb.GetStatsResponse:
    """The stats that live in Redis (rates are measured by each service process)."""
    stats = pb.GetStatsResponse.FromString(stats.SerializeToString())
    stats.ClearField("put_rate")
    stats.ClearField("sample_rate")
    return stats


async def fill(stub) -> tuple[list[str], pb.GetStatsResponse]:
    """PUT groups accepted, SAMPLED of them leased by a trainer that then dies; returns the leased ids."""
    writer = JobBuffer(stub, JOB, max_groups=100, max_age_steps=4)
    await writer.open()
    assert writer.data_plane is not None
    for i in range(PUT):
        if i % 2:  # staged in the data plane
            reply = await writer.put(make_group(f"g{i}", job_id=JOB))
        else:  # streamed through the service
            metadata, data = payload.split(make_group(f"g{i}", job_id=JOB))
            reply = await stub.PutGroupStream(iter([pb.PutGroupStreamRequest(group=metadata, payload=data)]))
        assert not reply.duplicate and not reply.dropped_stale
    await writer.close_plane()
    groups, _ = await read_stream(
        stub.SampleGroupsStream(
            pb.SampleGroupsStreamRequest(job_id=JOB, trainer_step=0, max_groups=SAMPLED, consumer="trainer-dead")
        )
    )
    leased = [g.group_id for g in groups]
    assert leased == [f"g{i}" for i in range(SAMPLED)]
    stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
    assert (stats.held, stats.pending, stats.puts) == (PUT - SAMPLED, SAMPLED, PUT)
    return leased, durable(stats)


async def check_nothing_lost_or_duplicated(stub, leased: list[str], before: pb.GetStatsResponse) -> None:
    assert durable(await stub.GetStats(pb.GetStatsRequest(job_id=JOB))) == before
    reclaimed = await stub.ReclaimGroups(
        pb.ReclaimGroupsRequest(job_id=JOB, trainer_step=0, max_groups=100, consumer="trainer-new", min_idle_seconds=0)
    )
    assert sorted(g.group_id for g in reclaimed.groups) == sorted(leased)
    # Byte for byte: the unary reclaim fills each stored payload back into its group.
    assert all(g == make_group(g.group_id, job_id=JOB) for g in reclaimed.groups)
    sampled = await stub.SampleGroups(
        pb.SampleGroupsRequest(job_id=JOB, trainer_step=0, max_groups=100, consumer="trainer-new")
    )
    assert [g.group_id for g in sampled.groups] == [f"g{i}" for i in range(SAMPLED, PUT)]
    for i in range(PUT):  # every retry is recognised, whichever way it comes
        reply = await stub.PutGroup(pb.PutGroupRequest(group=make_group(f"g{i}", job_id=JOB)))
        assert reply.duplicate
    owner = (await stub.TakeTrainerLease(pb.TakeTrainerLeaseRequest(job_id=JOB, consumer="t0"))).lease_id
    acked = await stub.AckGroups(
        pb.AckGroupsRequest(job_id=JOB, group_ids=[f"g{i}" for i in range(PUT)], weight_version=1, lease_id=owner)
    )
    assert acked.acked == PUT
    stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
    assert (stats.held, stats.pending, stats.acked, stats.puts) == (0, 0, PUT, PUT)
    assert (stats.duplicate_puts, stats.reclaimed) == (PUT, SAMPLED)


async def test_a_killed_buffer_service_loses_nothing_and_its_leases_are_reclaimable(start_service, redis):
    first = start_buffer(start_service, redis)
    async with connect(first.address, default_timeout=10) as channel:
        leased, before = await fill(buffer_pb2_grpc.BufferServiceStub(channel))
    first.proc.kill()
    first.proc.wait()

    second = start_buffer(start_service, redis)
    async with connect(second.address, default_timeout=10) as channel:
        await check_nothing_lost_or_duplicated(buffer_pb2_grpc.BufferServiceStub(channel), leased, before)


async def test_a_killed_redis_replays_its_aof_and_loses_nothing(start_service, redis):
    buffer = start_buffer(start_service, redis)
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        leased, before = await fill(stub)
        redis.kill()
        redis.start()  # same port and directory: replays appendonly files
        # The service keeps running; its client reconnects to the new server.
        await check_nothing_lost_or_duplicated(stub, leased, before)
