"""The buffer service as a real process: every RPC over gRPC, bad input, shutdown."""

from __future__ import annotations

import grpc
import pytest

from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.common.v1 import common_pb2
from dockyard.rpc.client import connect
from tests.unit.test_buffer_memory import make_group

JOB = "job-1"
CAPACITY = 4


@pytest.fixture
def buffer(start_service):
    # Sync fixture: start_service polls health with asyncio.run, outside the test's loop.
    return start_service("buffer", {"DOCKYARD_BUFFER_MAX_GROUPS": str(CAPACITY)})


async def put(stub, group: common_pb2.Group) -> bool:
    return (await stub.PutGroup(buffer_pb2.PutGroupRequest(group=group))).duplicate


async def stats(stub, job_id: str = JOB) -> buffer_pb2.GetStatsResponse:
    return await stub.GetStats(buffer_pb2.GetStatsRequest(job_id=job_id))


async def test_every_rpc_round_trips_and_sigterm_exits_cleanly(buffer):
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        sent = make_group("g-old", version=1)
        assert await put(stub, sent) is False
        assert await put(stub, sent) is True
        assert await put(stub, make_group("g-new", version=3)) is False
        assert await put(stub, make_group("g-stale", version=0)) is False

        reply = await stub.SampleGroups(
            buffer_pb2.SampleGroupsRequest(job_id=JOB, trainer_step=3, max_groups=1, max_trajectory_age_steps=2)
        )
        assert reply.dropped_stale == 1
        assert list(reply.groups) == [sent]  # oldest fresh group, byte-for-byte

        ack = await stub.AckGroups(buffer_pb2.AckGroupsRequest(job_id=JOB, group_ids=["g-old"]))
        assert ack.acked == 1
        assert await stats(stub) == buffer_pb2.GetStatsResponse(
            held=1, pending=0, acked=1, dropped_stale=1, puts=3, duplicate_puts=1
        )
    assert buffer.stop() == 0, buffer.logs()[-2000:]


def _bad_group(name: str) -> common_pb2.Group:
    group = make_group("g", version=2)
    if name == "job_id is empty":
        group.job_id = ""
    elif name == "group_id is empty":
        group.group_id = ""
    elif name == "no trajectories":
        del group.trajectories[:]
    elif name == "weight_version -1 is negative":
        group.weight_version = -1
    elif name == "trajectories[1] ('g/1'): weight_version -3 is negative":
        group.trajectories[1].weight_version = -3
    elif name == "4 completion_logprobs for 3 completion_token_ids":
        group.trajectories[1].completion_logprobs.append(-1.0)
    elif name == "differs from the oldest trajectory weight_version 1":
        group.trajectories[0].weight_version = 1
    return group


# Each bad group is named by the part of the message that must explain it.
BAD_GROUPS = [
    "job_id is empty",
    "group_id is empty",
    "no trajectories",
    "weight_version -1 is negative",
    "trajectories[1] ('g/1'): weight_version -3 is negative",
    "4 completion_logprobs for 3 completion_token_ids",
    "differs from the oldest trajectory weight_version 1",
]


async def test_bad_input_is_refused_with_the_exact_code_and_the_server_keeps_serving(buffer):
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        for expected in BAD_GROUPS:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PutGroup(buffer_pb2.PutGroupRequest(group=_bad_group(expected)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
            assert expected in err.value.details(), (expected, err.value.details())
        sample = dict(job_id=JOB, trainer_step=0, max_groups=1, max_trajectory_age_steps=0)
        other_calls = [
            ("group is missing", stub.PutGroup, buffer_pb2.PutGroupRequest()),
            ("job_id is empty", stub.SampleGroups, buffer_pb2.SampleGroupsRequest(**{**sample, "job_id": ""})),
            (
                "max_groups must be >= 1",
                stub.SampleGroups,
                buffer_pb2.SampleGroupsRequest(**{**sample, "max_groups": 0}),
            ),
            (
                "trainer_step must be >= 0",
                stub.SampleGroups,
                buffer_pb2.SampleGroupsRequest(**{**sample, "trainer_step": -1}),
            ),
            (
                "max_trajectory_age_steps must be >= 0",
                stub.SampleGroups,
                buffer_pb2.SampleGroupsRequest(**{**sample, "max_trajectory_age_steps": -1}),
            ),
            ("job_id is empty", stub.AckGroups, buffer_pb2.AckGroupsRequest(group_ids=["g"])),
            ("group_ids[1] is empty", stub.AckGroups, buffer_pb2.AckGroupsRequest(job_id=JOB, group_ids=["g", ""])),
            ("job_id is empty", stub.GetStats, buffer_pb2.GetStatsRequest()),
        ]
        for expected, method, request in other_calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await method(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
            assert expected in err.value.details(), (expected, err.value.details())

        # State errors on ack, then capacity.
        assert await put(stub, make_group("held")) is False
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AckGroups(buffer_pb2.AckGroupsRequest(job_id=JOB, group_ids=["ghost"]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AckGroups(buffer_pb2.AckGroupsRequest(job_id=JOB, group_ids=["held"]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for i in range(CAPACITY - 1):
            assert await put(stub, make_group(f"fill-{i}")) is False
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(stub, make_group("one-too-many"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "back off" in err.value.details()

        # Nothing accepted was lost, and good calls still succeed.
        assert await stats(stub) == buffer_pb2.GetStatsResponse(held=CAPACITY, puts=CAPACITY)
        reply = await stub.SampleGroups(buffer_pb2.SampleGroupsRequest(**{**sample, "max_groups": CAPACITY}))
        assert [g.group_id for g in reply.groups] == ["held", *(f"fill-{i}" for i in range(CAPACITY - 1))]
        ack = await stub.AckGroups(buffer_pb2.AckGroupsRequest(job_id=JOB, group_ids=["held"]))
        assert ack.acked == 1
        assert await put(stub, make_group("after-ack")) is False
