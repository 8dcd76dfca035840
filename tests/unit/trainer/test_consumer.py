"""The buffer-consumer protocol against a scripted buffer stub: reclaim first, the ledger, acks retried until
they land, the trainer lease."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.errors import FailedPrecondition, Unavailable
from services.trainer.consumer import BufferConsumer
from services.trainer.ledger import TrainedLedger, read_ledger


def group(group_id: str) -> common_pb2.Group:
    return common_pb2.Group(
        group_id=group_id, job_id="job", trajectories=[common_pb2.Trajectory(trajectory_id=f"{group_id}/0")]
    )


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"scripted {code.name}")


class FakeBuffer:
    """A BufferService stub: each method answers its next scripted reply (or raises it); calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.replies: dict[str, list[object]] = {"ReclaimGroups": [], "SampleGroups": [], "AckGroups": []}
        self.leases = 0  # TakeTrainerLease calls (not in `calls`: the protocol's order is asserted without it)

    def script(self, method: str, *replies: object) -> None:
        self.replies[method] += replies

    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    def acks(self) -> list[tuple[list[str], int]]:
        return [(list(r.group_ids), r.weight_version) for m, r in self.calls if m == "AckGroups"]

    async def _answer(self, method: str, request: object, default: object) -> object:
        self.calls.append((method, request))
        reply = self.replies[method].pop(0) if self.replies[method] else default
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _stream(self, method: str, request: object, default: object):
        """The scripted reply as the buffer streams it: each group's bytes, then the closing chunk."""
        reply = await self._answer(method, request, default)
        for g in reply.groups:
            yield buffer_pb2.SampleGroupsStreamResponse(group=g.SerializeToString())
        yield buffer_pb2.SampleGroupsStreamResponse(dropped_stale=reply.dropped_stale, done=True)

    async def GetDataPlane(self, request, timeout=None):
        return buffer_pb2.GetDataPlaneResponse()  # none: payloads come in the stream

    def ReclaimGroupsStream(self, request, timeout=None):
        return self._stream("ReclaimGroups", request, buffer_pb2.ReclaimGroupsResponse())

    def SampleGroupsStream(self, request, timeout=None):
        return self._stream("SampleGroups", request, buffer_pb2.SampleGroupsResponse())

    async def AckGroups(self, request, timeout=None):
        return await self._answer("AckGroups", request, buffer_pb2.AckGroupsResponse(acked=len(request.group_ids)))

    async def TakeTrainerLease(self, request, timeout=None):
        self.leases += 1
        return buffer_pb2.TakeTrainerLeaseResponse(lease_id=f"{request.consumer}/lease{self.leases}")


@pytest.fixture
def buffer() -> FakeBuffer:
    return FakeBuffer()


def consumer(buffer: FakeBuffer, folder: Path) -> BufferConsumer:
    return BufferConsumer(buffer, "trainer-0", "job", TrainedLedger(folder), ack_timeout=5.0)


async def test_a_fresh_consumer_reclaims_before_it_samples(buffer: FakeBuffer, tmp_path: Path) -> None:
    buffer.script("ReclaimGroups", buffer_pb2.ReclaimGroupsResponse(groups=[group("left")], dropped_stale=1))
    buffer.script("SampleGroups", buffer_pb2.SampleGroupsResponse(groups=[group("fresh")], dropped_stale=2))
    c = consumer(buffer, tmp_path)
    lease = await c.lease(3, 2)
    assert [g.group_id for g in lease.groups] == ["left", "fresh"]
    assert (lease.reclaimed, lease.dropped_stale) == (1, 3)
    assert lease.metrics() == {"groups_dropped_stale": 3.0, "groups_reclaimed": 1.0}
    (_, reclaim), (_, sample) = buffer.calls
    assert (reclaim.job_id, reclaim.consumer, reclaim.trainer_step, reclaim.max_groups) == ("job", "trainer-0", 3, 2)
    assert reclaim.min_idle_seconds == 0.0  # a fresh trainer takes over every pending group
    assert (sample.consumer, sample.trainer_step, sample.max_groups) == ("trainer-0", 3, 1)

    buffer.calls.clear()
    buffer.script("SampleGroups", buffer_pb2.SampleGroupsResponse(groups=[group("next")]))
    assert [g.group_id for g in (await c.lease(4, 2)).groups] == ["next"]
    assert buffer.methods() == ["SampleGroups"]  # reclaimed once, then only sampled


async def test_a_failed_lease_reclaims_again_next_time(buffer: FakeBuffer, tmp_path: Path) -> None:
    c = consumer(buffer, tmp_path)
    buffer.script("SampleGroups", rpc_error(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(Unavailable, match="UNAVAILABLE"):
        await c.lease(0, 1)
    buffer.calls.clear()
    buffer.script("ReclaimGroups", buffer_pb2.ReclaimGroupsResponse(groups=[group("leased-by-the-failed-call")]))
    lease = await c.lease(0, 1)
    assert [g.group_id for g in lease.groups] == ["leased-by-the-failed-call"]
    assert buffer.methods() == ["ReclaimGroups"]  # enough reclaimed: nothing sampled


async def test_reclaimed_groups_the_ledger_names_are_acked_not_returned(buffer: FakeBuffer, tmp_path: Path) -> None:
    TrainedLedger(tmp_path).record(2, 2, ["trained"], ["trained/0"])
    buffer.script("ReclaimGroups", buffer_pb2.ReclaimGroupsResponse(groups=[group("trained"), group("pending")]))
    lease = await consumer(buffer, tmp_path).lease(2, 2)
    assert [g.group_id for g in lease.groups] == ["pending"] and lease.reclaimed == 1
    assert buffer.acks() == [(["trained"], 2)]
    assert buffer.methods() == ["ReclaimGroups", "AckGroups", "SampleGroups"]


async def test_a_trained_step_is_acked_until_it_lands_with_its_lease(buffer: FakeBuffer, tmp_path: Path) -> None:
    c = consumer(buffer, tmp_path)
    buffer.script("AckGroups", rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    await c.trained(1, 1, ["a"], ["a/0"])  # returns only once the buffer's clock has the version
    assert buffer.acks() == [(["a"], 1)] * 3 and c.unacked == []
    assert [line["group_ids"] for line in read_ledger(tmp_path)] == [["a"]]
    # One lease for the consumer's life, carried by every ack.
    assert buffer.leases == 1
    assert {r.lease_id for m, r in buffer.calls if m == "AckGroups"} == {"trainer-0/lease1"}


async def test_a_refused_batchs_deferred_ack_goes_before_the_next_lease(buffer: FakeBuffer, tmp_path: Path) -> None:
    c = consumer(buffer, tmp_path)
    buffer.script("AckGroups", rpc_error(grpc.StatusCode.UNAVAILABLE))
    await c.ack(["d"], 2)
    assert c.unacked == ["d"]
    buffer.calls.clear()
    buffer.script("SampleGroups", buffer_pb2.SampleGroupsResponse(groups=[group("e")]))
    await c.lease(2, 1)  # the deferred ack goes first, before the buffer is asked for more
    assert buffer.methods()[0] == "AckGroups" and buffer.acks() == [(["d"], 2)] and c.unacked == []


async def test_an_ack_waiting_out_an_outage_gives_up_when_the_job_stops(buffer: FakeBuffer, tmp_path: Path) -> None:
    c = consumer(buffer, tmp_path)
    buffer.script("AckGroups", *[rpc_error(grpc.StatusCode.UNAVAILABLE)] * 1000)
    waiting = asyncio.create_task(c.trained(1, 1, ["a"], ["a/0"]))
    while len(buffer.acks()) < 2:  # retried, not given up after one failure
        await asyncio.sleep(0.01)
    assert not waiting.done()
    c.stop()
    with pytest.raises(Unavailable, match="stopped while the ack of 1 group"):
        await waiting
    assert c.unacked == ["a"]


async def test_an_ack_refused_for_good_is_raised(buffer: FakeBuffer, tmp_path: Path) -> None:
    buffer.script("AckGroups", rpc_error(grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.aio.AioRpcError):
        await consumer(buffer, tmp_path).ack(["a"], 1)


async def test_nothing_fresh_is_a_failed_precondition(buffer: FakeBuffer, tmp_path: Path) -> None:
    c = consumer(buffer, tmp_path)
    buffer.script("SampleGroups", buffer_pb2.SampleGroupsResponse(dropped_stale=4))
    with pytest.raises(FailedPrecondition) as info:
        await c.lease(5, 2)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no fresh groups for step 6" in str(info.value) and "4 dropped as stale" in str(info.value)

    buffer.script("SampleGroups", rpc_error(grpc.StatusCode.NOT_FOUND))
    with pytest.raises(FailedPrecondition, match="refused to sample: scripted NOT_FOUND"):
        await c.lease(5, 2)
