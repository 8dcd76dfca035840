"""The buffer's data plane as a real process, on both backends: packed payloads in, the same bytes out.

A group of 8 multi-turn trajectories of ~61k tokens each is bigger than the service's message cap
(DOCKYARD_BUFFER_MAX_MESSAGE_MB=2 here): it is put from the coordinator's JobBuffer, leased by the
trainer's BufferConsumer, and trains as the whole protobuf group would; the unary SampleGroups
cannot carry it. On Redis the payload goes around the service (staged in Redis, PutGroup of the
metadata, sampled by reference and read by MGET); in memory it streams through it
(PutGroupStream, SampleGroupsStream). Bad payloads are refused by name and the service keeps serving.
"""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2 as pb
from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload
from dockyard.rpc.client import connect
from services.coordinator.job_buffer import JobBuffer
from services.trainer.consumer import BufferConsumer
from services.trainer.ledger import TrainedLedger
from services.trainer.requests import training_group
from tests.conftest import expect_code, make_group

JOB = "job-1"


@pytest.fixture(params=["memory", "redis"])
def buffer(request: pytest.FixtureRequest, start_service):
    env = {"DOCKYARD_BUFFER_MAX_MESSAGE_MB": "2", "DOCKYARD_BUFFER_MAX_GROUP_MB": "16"}
    if request.param == "redis":
        import redis

        url = request.getfixturevalue("redis_server")
        redis.Redis.from_url(url).flushdb()
        env |= {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": url}
    service = start_service("buffer", env)
    service.backend = request.param
    return service


def multi_turn_group(group_id: str, trajectories: int = 8, tokens: int = 61_000) -> common_pb2.Group:
    """Trials of `tokens` completion tokens: sampled turns and masked tool output, one later segment each."""
    rng = random.Random(group_id)
    group = make_group(group_id, n=trajectories, tokens=1)
    for t in group.trajectories:
        t.prompt_token_ids[:] = [rng.randrange(151_936) for _ in range(1024)]
        t.completion_token_ids[:] = [rng.randrange(151_936) for _ in range(tokens)]
        t.completion_loss_mask[:] = [int(i % 7 != 0) for i in range(tokens)]
        t.completion_logprobs[:] = [-rng.random() if i % 7 else 0.0 for i in range(tokens)]
        t.later_segments.add(prompt_token_ids=[1, 2, 3], completion_token_ids=[4], completion_logprobs=[-0.5])
        t.num_turns = 12
    return group


async def test_a_group_above_the_message_cap_streams_in_and_out_byte_for_byte(buffer, tmp_path: Path) -> None:
    whole = multi_turn_group("big")
    assert whole.ByteSize() > 2 * 2**20  # more than one message may carry
    async with connect(buffer.address, default_timeout=60) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        producer = JobBuffer(stub, JOB, max_groups=4, max_age_steps=1)
        await producer.open()
        reply = await producer.put(whole)
        assert not reply.duplicate and not reply.dropped_stale
        assert (await producer.put(whole)).duplicate  # a retried put is still a no-op
        metadata, packed = payload.split(whole)
        # With a data plane (Redis) no payload byte crosses the service.
        via = "staged" if buffer.backend == "redis" else "payload"
        expected = {"metadata": 2 * metadata.ByteSize(), "payload": 0, "staged": 0, "rollout_staged": 0}
        expected |= {via: 2 * len(packed)}
        assert producer.sent_bytes == expected

        consumer = BufferConsumer(stub, "trainer-0", JOB, TrainedLedger(tmp_path), ack_timeout=10)
        lease = await consumer.lease(0, 2)
        [leased] = lease.groups
        assert (consumer.plane is not None) == (buffer.backend == "redis")
        assert (leased.group, leased.payload) == (metadata, packed)  # as stored, never re-encoded
        assert training_group(leased.group, leased.payload) == training_group(whole)

        # The unary reclaim fills the payload in, and cannot carry a group above the cap.
        await expect_code(
            stub.ReclaimGroups(pb.ReclaimGroupsRequest(job_id=JOB, max_groups=1, consumer="t1")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        await consumer.trained(1, 1, [leased.group_id], [t.trajectory_id for t in whole.trajectories])
        stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
        assert (stats.puts, stats.duplicate_puts, stats.acked, stats.held, stats.pending) == (1, 1, 1, 0, 0)

        small = make_group("small")
        small.trajectories[0].completion_loss_mask[:] = [1, 0, 1]
        await producer.put(small)
        reply = await stub.SampleGroups(pb.SampleGroupsRequest(job_id=JOB, trainer_step=1, max_groups=1, consumer="t"))
        assert list(reply.groups) == [small]  # the unary sample gives the whole group back
        await consumer.close()
        await producer.close()
    assert buffer.stop() == 0, buffer.logs()[-2000:]


def _chunks(group: common_pb2.Group, data: bytes) -> list[pb.PutGroupStreamRequest]:
    return [pb.PutGroupStreamRequest(group=group, payload=data)]


async def test_bad_payloads_are_refused_by_name_and_the_service_keeps_serving(buffer) -> None:
    async with connect(buffer.address, default_timeout=20) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=4, max_trajectory_age_steps=1))
        metadata, data = payload.split(make_group("g"))

        positive = make_group("g")
        positive.trajectories[1].completion_logprobs[0] = 0.5
        too_long = make_group("g", tokens=70_000)
        negative = make_group("g")
        negative.trajectories[0].later_segments.add(
            prompt_token_ids=[1], completion_token_ids=[-5], completion_logprobs=[-1.0]
        )
        two = make_group("g")
        two.trajectories[1].completion_loss_mask[:] = [1, 2, 0]
        hollow = make_group("g")
        for name in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
            hollow.trajectories[0].ClearField(name)
        cases = [
            (_chunks(metadata, data[:-4]), "payload is unreadable"),
            (_chunks(metadata, b"XXXX" + data[4:]), "payload is unreadable"),
            (_chunks(metadata, payload.pack(make_group("g", n=3).trajectories)), "holds 3 trajectories"),
            (_chunks(make_group("g"), data), "token arrays in the metadata"),
            (_chunks(*payload.split(positive)), "trajectories[1] ('g/1'): completion_logprobs holds 0.5"),
            (_chunks(*payload.split(too_long)), "DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS"),
            (_chunks(*payload.split(negative)), "later_segments[0]: completion_token_ids holds the negative"),
            (_chunks(*payload.split(two)), "trajectories[1] ('g/1'): completion_loss_mask holds 2"),
            (_chunks(*payload.split(hollow)), "a valid trajectory with no tokens"),
            ([pb.PutGroupStreamRequest(payload=data)], "first chunk of a PutGroupStream must carry the group"),
            (_chunks(metadata, data) * 2, "`group` is set on a later chunk too"),
            ([], "the PutGroupStream was empty"),
        ]
        for chunks, words in cases:
            await expect_code(stub.PutGroupStream(iter(chunks)), grpc.StatusCode.INVALID_ARGUMENT, words)
        stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
        assert stats.puts == 0
        assert await stub.PutGroupStream(iter(_chunks(metadata, data))) == pb.PutGroupStreamResponse()
        # A streamed sample's refusal arrives as its status code (NOT_FOUND here), not as INTERNAL.
        stream = stub.SampleGroupsStream(pb.SampleGroupsStreamRequest(job_id="nope", max_groups=1, consumer="t"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [chunk async for chunk in stream]
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()
