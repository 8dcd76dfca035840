"""The buffer service as a real process: every RPC over gRPC, bad input, shutdown.

Backend semantics are proved in test_buffer_behaviour.py (memory and Redis);
this is the gRPC contract on the default (memory) backend.
"""

from __future__ import annotations

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2 as pb
from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.rpc.client import connect
from tests.conftest import expect_code, make_group

JOB = "job-1"
CAPACITY = 4


@pytest.fixture
def buffer(start_service):
    return start_service("buffer", {"DOCKYARD_BUFFER_MAX_GROUP_MB": "0.01"})


async def test_every_rpc_round_trips_and_sigterm_exits_cleanly(buffer) -> None:
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=CAPACITY, max_trajectory_age_steps=1))
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=CAPACITY, max_trajectory_age_steps=1))
        # The trainer reaches version 3 (the coordinator sets the clock); a group of version 1 is stale on arrival.
        opened = pb.OpenJobRequest(job_id=JOB, max_groups=CAPACITY, max_trajectory_age_steps=1, rewind_to_version=3)
        await stub.OpenJob(opened)
        await stub.SampleGroups(pb.SampleGroupsRequest(job_id=JOB, trainer_step=3, max_groups=1, consumer="t0"))
        sent = make_group("g-old", version=2)
        # A multi-turn trajectory: context tokens masked out, a later segment after an edited history.
        sent.trajectories[0].completion_loss_mask[:] = [1, 0, 1]
        sent.trajectories[0].num_turns = 2
        sent.trajectories[0].later_segments.add(
            prompt_token_ids=[5, 6],
            completion_token_ids=[7, 8],
            completion_logprobs=[-0.25, 0.0],
            completion_loss_mask=[1, 0],
        )
        assert await stub.PutGroup(pb.PutGroupRequest(group=sent)) == pb.PutGroupResponse()
        assert (await stub.PutGroup(pb.PutGroupRequest(group=sent))).duplicate
        assert await stub.PutGroup(pb.PutGroupRequest(group=make_group("g-new", version=3))) == pb.PutGroupResponse()
        late = await stub.PutGroup(pb.PutGroupRequest(group=make_group("g-late", version=1)))
        assert late.dropped_stale and not late.duplicate

        reply = await stub.SampleGroups(pb.SampleGroupsRequest(job_id=JOB, trainer_step=3, max_groups=1, consumer="t0"))
        assert list(reply.groups) == [sent]  # oldest fresh group, byte for byte
        reclaimed = await stub.ReclaimGroups(
            pb.ReclaimGroupsRequest(job_id=JOB, trainer_step=3, max_groups=8, consumer="t1", min_idle_seconds=0)
        )
        assert [g.group_id for g in reclaimed.groups] == ["g-old"]
        # Only the job's trainer acks: the lease it took, never a predecessor's or none.
        first = (await stub.TakeTrainerLease(pb.TakeTrainerLeaseRequest(job_id=JOB, consumer="t0"))).lease_id
        owner = (await stub.TakeTrainerLease(pb.TakeTrainerLeaseRequest(job_id=JOB, consumer="t1"))).lease_id
        assert first.startswith("t0/") and owner.startswith("t1/") and first != owner
        for stranger in (first, "", "t1/" + "0" * 32):
            refused = pb.AckGroupsRequest(job_id=JOB, group_ids=["g-old"], weight_version=4, lease_id=stranger)
            words = f"trainer lease of job {JOB!r}"
            await expect_code(stub.AckGroups(refused), grpc.StatusCode.FAILED_PRECONDITION, words)
        assert (await stub.GetStats(pb.GetStatsRequest(job_id=JOB))).latest_version == 3  # refused: nothing moved
        acked = pb.AckGroupsRequest(job_id=JOB, group_ids=["g-old"], weight_version=4, lease_id=owner)
        assert (await stub.AckGroups(acked)).acked == 1
        assert (await stub.AckGroups(acked)).acked == 0  # the same ack again: a no-op that succeeds

        stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
        assert (stats.held, stats.pending, stats.acked, stats.dropped_stale) == (1, 0, 1, 1)
        assert (stats.puts, stats.duplicate_puts, stats.reclaimed) == (3, 1, 1)
        assert (stats.latest_version, stats.max_groups, stats.max_trajectory_age_steps) == (4, CAPACITY, 1)
        assert dict(stats.age_histogram) == {1: 1}  # g-new (version 3) at version 4
        assert stats.put_rate > 0 and stats.sample_rate > 0

        await stub.CloseJob(pb.CloseJobRequest(job_id=JOB))
        await expect_code(stub.GetStats(pb.GetStatsRequest(job_id=JOB)), grpc.StatusCode.NOT_FOUND, JOB)
    assert buffer.stop() == 0, buffer.logs()[-2000:]


def _bad_group(name: str):
    group = make_group("g", version=0)
    if name == "job_id is empty":
        group.job_id = ""
    elif name == "group_id is empty":
        group.group_id = ""
    elif name == "no trajectories":
        del group.trajectories[:]
    elif name == "4 completion_logprobs for 3 completion_token_ids":
        group.trajectories[1].completion_logprobs.append(-1.0)
    elif name == "differs from the oldest trajectory weight_version 1":
        group.trajectories[0].weight_version = 1
        group.trajectories[1].weight_version = 2
        group.weight_version = 2
    elif name == "2 completion_loss_mask values for 3 completion_token_ids":
        group.trajectories[0].completion_loss_mask[:] = [1, 0]
    elif name == "completion_loss_mask holds 2; 0 or 1":
        group.trajectories[0].completion_loss_mask[:] = [1, 2, 0]
    elif name == "later_segments[0]: prompt_token_ids is empty":
        group.trajectories[0].later_segments.add(completion_token_ids=[1], completion_logprobs=[-0.5])
    elif name == "later_segments[1]: 1 completion_logprobs for 2 completion_token_ids":
        segments = group.trajectories[1].later_segments
        segments.add(prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-0.5])
        segments.add(prompt_token_ids=[1], completion_token_ids=[2, 3], completion_logprobs=[-0.5])
    elif name == "routing holds 8 bytes; its 2 prompt and 3 completion tokens need 4 positions":
        # A mixture-of-experts policy's routing (2 layers x top 2 of 8 experts) one position short.
        group.trajectories[0].routing_shape.moe_layers = 2
        group.trajectories[0].routing_shape.top_k = 2
        group.trajectories[0].routing_shape.num_experts = 8
        group.trajectories[0].routing = bytes(8)
    elif name == "routing names expert 9; the policy has 8":
        group.trajectories[0].routing_shape.moe_layers = 1
        group.trajectories[0].routing_shape.top_k = 1
        group.trajectories[0].routing_shape.num_experts = 8
        group.trajectories[0].routing = bytes([0, 1, 9, 2])
    elif name == "MiB; the limit is":
        group = make_group("g", version=0, tokens=4000)
    return group


# Each bad group is named by the part of the message that must explain it.
BAD_GROUPS = [
    "job_id is empty",
    "group_id is empty",
    "no trajectories",
    "4 completion_logprobs for 3 completion_token_ids",
    "differs from the oldest trajectory weight_version 1",
    "2 completion_loss_mask values for 3 completion_token_ids",
    "completion_loss_mask holds 2; 0 or 1",
    "later_segments[0]: prompt_token_ids is empty",
    "later_segments[1]: 1 completion_logprobs for 2 completion_token_ids",
    "routing holds 8 bytes; its 2 prompt and 3 completion tokens need 4 positions",
    "routing names expert 9; the policy has 8",
    "MiB; the limit is",
]


async def test_bad_input_is_refused_with_a_clear_error_and_nothing_is_stored(buffer) -> None:
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await expect_code(
            stub.PutGroup(pb.PutGroupRequest(group=make_group("g"))), grpc.StatusCode.NOT_FOUND, "OpenJob"
        )
        await stub.OpenJob(pb.OpenJobRequest(job_id=JOB, max_groups=CAPACITY, max_trajectory_age_steps=0))
        for expected in BAD_GROUPS:
            await expect_code(
                stub.PutGroup(pb.PutGroupRequest(group=_bad_group(expected))),
                grpc.StatusCode.INVALID_ARGUMENT,
                expected,
            )
        await expect_code(
            stub.PutGroup(pb.PutGroupRequest(group=make_group("future", version=5))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "from the future",
        )
        lease = dict(job_id=JOB, trainer_step=0, max_groups=1, consumer="t0")
        invalid = [
            ("group is missing", stub.PutGroup(pb.PutGroupRequest())),
            ("max_groups must be in [1, ", stub.OpenJob(pb.OpenJobRequest(job_id=JOB))),
            ("job_id is empty", stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "job_id": ""}))),
            ("max_groups must be >= 1", stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "max_groups": 0}))),
            ("trainer_step must be >= 0", stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "trainer_step": -1}))),
            ("consumer is empty", stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "consumer": ""}))),
            ("min_idle_seconds", stub.ReclaimGroups(pb.ReclaimGroupsRequest(**lease, min_idle_seconds=float("nan")))),
            ("group_ids[1] is empty", stub.AckGroups(pb.AckGroupsRequest(job_id=JOB, group_ids=["g", ""]))),
            ("weight_version must be >= 0", stub.AckGroups(pb.AckGroupsRequest(job_id=JOB, weight_version=-1))),
            ("job_id is empty", stub.GetStats(pb.GetStatsRequest())),
        ]
        for expected, call in invalid:
            await expect_code(call, grpc.StatusCode.INVALID_ARGUMENT, expected)
        await expect_code(
            stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "job_id": "nope"})), grpc.StatusCode.NOT_FOUND
        )

        # State errors on ack, then capacity.
        await stub.PutGroup(pb.PutGroupRequest(group=make_group("held")))
        owner = (await stub.TakeTrainerLease(pb.TakeTrainerLeaseRequest(job_id=JOB, consumer="t0"))).lease_id
        await expect_code(
            stub.AckGroups(pb.AckGroupsRequest(job_id=JOB, group_ids=["ghost"], lease_id=owner)),
            grpc.StatusCode.NOT_FOUND,
        )
        await expect_code(
            stub.AckGroups(pb.AckGroupsRequest(job_id=JOB, group_ids=["held"], lease_id=owner)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        for i in range(CAPACITY - 1):
            await stub.PutGroup(pb.PutGroupRequest(group=make_group(f"fill-{i}")))
        await expect_code(
            stub.PutGroup(pb.PutGroupRequest(group=make_group("one-too-many"))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "back off",
        )

        # Nothing refused was stored, nothing accepted was lost, and good calls still succeed.
        stats = await stub.GetStats(pb.GetStatsRequest(job_id=JOB))
        assert (stats.held, stats.puts, stats.pending) == (CAPACITY, CAPACITY, 0)
        reply = await stub.SampleGroups(pb.SampleGroupsRequest(**{**lease, "max_groups": CAPACITY}))
        assert [g.group_id for g in reply.groups] == ["held", *(f"fill-{i}" for i in range(CAPACITY - 1))]
