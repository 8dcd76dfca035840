"""The data plane on Redis, against a real buffer process and a real redis-server.

- GetDataPlane advertises the buffer's Redis without its password; a buffer in memory or with
  DOCKYARD_BUFFER_DATA_PLANE=false advertises none, and refuses staged puts and samples by reference.
- A staged payload is taken over by its put (the staging key disappears, the group's payload key
  holds the same bytes, without expiry), deleted by a duplicate or stale put, kept for a retry by a
  refused one, and freed with the group at ack.
- A staged key that is missing, of another length, or outside the job's staging keys is refused by
  name; a payload the trainer could not train on is refused by its writer before it is staged.
- CloseJob deletes the job's staged payloads whose puts never came, and no other job's.
"""

from __future__ import annotations

import grpc
import pytest
import redis

from dockyard.api.buffer.v1 import buffer_pb2 as pb
from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.experience import payload
from dockyard.experience.data_plane import DataPlane, staging_base
from dockyard.rpc.client import connect
from dockyard.rpc.errors import InvalidArgument
from services.coordinator.job_buffer import JobBuffer
from tests.conftest import expect_code, make_group

JOB = "job-1"
PREFIX = "dockyard:buffer"


@pytest.fixture
def redis_url(redis_server: str) -> str:
    redis.Redis.from_url(redis_server).flushdb()
    return redis_server


def start_redis_buffer(start_service, url: str, **env: str):
    return start_service("buffer", {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": url, **env})


def keys(client: redis.Redis, pattern: str) -> list[str]:
    return sorted(k.decode() for k in client.keys(pattern))


async def test_a_staged_payload_is_taken_over_by_its_put_and_freed_at_ack(start_service, redis_url: str) -> None:
    buffer = start_redis_buffer(start_service, redis_url)
    client = redis.Redis.from_url(redis_url)
    async with connect(buffer.address, default_timeout=20) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        plane = await stub.GetDataPlane(pb.GetDataPlaneRequest())
        assert (plane.redis_url, plane.key_prefix) == (redis_url, PREFIX)
        assert plane.staging_ttl_seconds == 3600 and plane.max_trajectory_tokens == 65536

        producer = JobBuffer(stub, JOB, max_groups=1, max_age_steps=0)
        await producer.open()
        whole = make_group("g0")
        metadata, data = payload.split(whole)
        await producer.put(whole)
        base = staging_base(PREFIX, JOB)
        assert keys(client, base + "*") == []  # taken over
        stored = f"{PREFIX}:{{{JOB}}}:d:g0"
        assert client.get(stored) == data and client.ttl(stored) == -1  # the same bytes, no expiry

        # A duplicate put deletes its own staged copy; the first stays.
        assert (await producer.put(whole)).duplicate
        assert keys(client, base + "*") == [] and client.get(stored) == data

        # Full: the staged key stays (the writer retries with it) until its expiry.
        staged = client_stage(client, base + "g1:x", make_group("g1"))
        request = pb.PutGroupRequest(group=payload.split(make_group("g1"))[0], payload_key=staged[0])
        request.payload_bytes = staged[1]
        await expect_code(stub.PutGroup(request), grpc.StatusCode.RESOURCE_EXHAUSTED, "buffer full")
        assert client.exists(base + "g1:x") and 0 < client.ttl(base + "g1:x") <= 600

        # Leased by reference, then acked: the payload key goes with the group.
        stream = stub.SampleGroupsStream(
            pb.SampleGroupsStreamRequest(job_id=JOB, max_groups=4, consumer="t", payload_by_reference=True)
        )
        pieces = [piece async for piece in stream]
        assert [(p.group, p.payload, p.payload_key) for p in pieces[:-1]] == [
            (metadata.SerializeToString(), b"", stored)
        ]
        owner = (await stub.TakeTrainerLease(pb.TakeTrainerLeaseRequest(job_id=JOB, consumer="t0"))).lease_id
        await stub.AckGroups(pb.AckGroupsRequest(job_id=JOB, group_ids=["g0"], weight_version=1, lease_id=owner))
        assert not client.exists(stored)

        # A put of an already stale group deletes its staged payload.
        staged = client_stage(client, base + "old:x", make_group("old"))
        request = pb.PutGroupRequest(
            group=payload.split(make_group("old"))[0], payload_key=staged[0], payload_bytes=staged[1]
        )
        assert (await stub.PutGroup(request)).dropped_stale
        assert not client.exists(base + "old:x")
        await producer.close()
    assert buffer.stop() == 0, buffer.logs()[-2000:]


def client_stage(client: redis.Redis, key: str, group) -> tuple[str, int]:
    """Stage `group`'s payload under `key` as a writer would; (key, length)."""
    data = payload.split(group)[1]
    client.set(key, data, ex=600)
    return key, len(data)


async def test_bad_staged_puts_are_refused_by_name_and_the_service_keeps_serving(start_service, redis_url: str) -> None:
    buffer = start_redis_buffer(start_service, redis_url)
    client = redis.Redis.from_url(redis_url)
    base = staging_base(PREFIX, JOB)
    async with connect(buffer.address, default_timeout=20) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=4, max_trajectory_age_steps=1))
        metadata, data = payload.split(make_group("g"))
        client.set(base + "g:ok", data, ex=600)
        client.set(f"{PREFIX}:{{other}}:s:g:1", data, ex=600)

        def put(key: str, size: int = len(data), group=metadata):
            return stub.PutGroup(pb.PutGroupRequest(group=group, payload_key=key, payload_bytes=size))

        await expect_code(put(base + "g:missing"), grpc.StatusCode.FAILED_PRECONDITION, "not in Redis")
        await expect_code(put(base + "g:ok", len(data) + 4), grpc.StatusCode.FAILED_PRECONDITION, "bytes, not the")
        await expect_code(put(f"{PREFIX}:{{other}}:s:g:1"), grpc.StatusCode.INVALID_ARGUMENT, "not one of job 'job-1'")
        await expect_code(put(base + "g:ok", 0), grpc.StatusCode.INVALID_ARGUMENT, "payload_bytes must be >= 1")
        await expect_code(
            put(base + "g:ok", group=make_group("g")), grpc.StatusCode.INVALID_ARGUMENT, "beside a staged payload"
        )
        await expect_code(put(base + "g:ok", 64 * 2**20), grpc.StatusCode.INVALID_ARGUMENT, "MAX_GROUP_MB")
        assert (await stub.GetStats(pb.GetStatsRequest(job_id=JOB))).puts == 0

        # The writer refuses a payload the trainer could not train on before staging it.
        plane = await DataPlane.discover(stub)
        assert plane is not None
        positive = make_group("p")
        positive.trajectories[1].completion_logprobs[0] = 0.5
        with pytest.raises(InvalidArgument, match=r"trajectories\[1\] \('p/1'\): completion_logprobs holds 0.5"):
            await plane.stage(*payload.split(positive))
        assert keys(client, base + "p:*") == []
        huge = make_group("h", tokens=60_000, n=40)  # above DOCKYARD_BUFFER_MAX_GROUP_MB=16
        with pytest.raises(InvalidArgument, match="DOCKYARD_BUFFER_MAX_GROUP_MB"):
            await plane.stage(*payload.split(huge))
        assert keys(client, base + "h:*") == []

        # And the service still serves: the good staged put goes in.
        assert await put(base + "g:ok") == pb.PutGroupResponse()
        await plane.close()
    assert buffer.stop() == 0, buffer.logs()[-2000:]


async def test_close_job_deletes_the_payloads_staged_for_puts_that_never_came(start_service, redis_url: str) -> None:
    buffer = start_redis_buffer(start_service, redis_url)
    client = redis.Redis.from_url(redis_url)
    data = payload.split(make_group("g"))[1]
    other = "job-2"
    async with connect(buffer.address, default_timeout=20) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        for job in (other, JOB):
            await stub.OpenJob(pb.OpenJobRequest(job_id=job, max_groups=4, max_trajectory_age_steps=1))
            for i in range(3):
                client.set(staging_base(PREFIX, job) + f"g{i}:n", data, ex=600)
        await stub.CloseJob(pb.CloseJobRequest(job_id=other))
        assert keys(client, staging_base(PREFIX, other) + "*") == []
        assert len(keys(client, staging_base(PREFIX, JOB) + "*")) == 3
        await stub.CloseJob(pb.CloseJobRequest(job_id=JOB))
        assert client.keys(f"{PREFIX}:*") == []
    assert buffer.stop() == 0, buffer.logs()[-2000:]


@pytest.mark.parametrize("setting", ["memory", "off"])
async def test_a_buffer_without_a_data_plane_says_so_and_refuses_references(
    setting: str, start_service, redis_url: str
) -> None:
    if setting == "memory":
        buffer = start_service("buffer", {})
    else:
        buffer = start_redis_buffer(start_service, redis_url, DOCKYARD_BUFFER_DATA_PLANE="false")
    async with connect(buffer.address, default_timeout=20) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        assert await stub.GetDataPlane(pb.GetDataPlaneRequest()) == pb.GetDataPlaneResponse()
        assert await DataPlane.discover(stub) is None
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=4, max_trajectory_age_steps=1))
        metadata, data = payload.split(make_group("g"))
        await expect_code(
            stub.PutGroup(pb.PutGroupRequest(group=metadata, payload_key="k", payload_bytes=len(data))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "has no data plane",
        )
        stream = stub.SampleGroupsStream(
            pb.SampleGroupsStreamRequest(job_id=JOB, max_groups=1, consumer="t", payload_by_reference=True)
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [piece async for piece in stream]
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no data plane" in info.value.details()
    assert buffer.stop() == 0, buffer.logs()[-2000:]
