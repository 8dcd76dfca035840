"""A put refused as "from the future" is re-checked against the trainer's published version, never past it."""

from __future__ import annotations

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from services.coordinator.job_buffer import JobBuffer
from tests.conftest import make_group


def future(version: int, clock: int) -> grpc.aio.AioRpcError:
    details = (
        f"group 'g' was generated at weight version {version}, but the trainer of job 'job' has reached only "
        f"version {clock}: a version from the future"
    )
    return grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LaggingBuffer:
    """A buffer whose clock lost its last advance (the store died before the ack's write was durable)."""

    def __init__(self, clock: int) -> None:
        self.clock, self.rewinds, self.held = clock, [], []

    async def PutGroupStream(self, chunks, timeout=None) -> buffer_pb2.PutGroupStreamResponse:
        group = next(iter(chunks)).group
        if group.weight_version > self.clock:
            raise future(group.weight_version, self.clock)
        self.held.append(group.group_id)
        return buffer_pb2.PutGroupStreamResponse()

    async def GetStats(self, request, timeout=None) -> buffer_pb2.GetStatsResponse:
        return buffer_pb2.GetStatsResponse(latest_version=self.clock)

    async def OpenJob(self, request, timeout=None) -> buffer_pb2.OpenJobResponse:
        self.rewinds.append(request.rewind_to_version)
        self.clock = request.rewind_to_version
        return buffer_pb2.OpenJobResponse()

    async def GetDataPlane(self, request, timeout=None) -> buffer_pb2.GetDataPlaneResponse:
        return buffer_pb2.GetDataPlaneResponse()  # none: payloads stream through the service


async def test_a_put_the_trainers_published_version_proves_sets_the_clock_and_goes_in() -> None:
    buffer = LaggingBuffer(clock=3)
    await JobBuffer(buffer, "job", published=lambda: 4).put(make_group("g", version=4))
    assert buffer.rewinds == [4] and buffer.held == ["g"]


@pytest.mark.parametrize("published", [0, 3])
async def test_a_put_beyond_the_trainers_published_version_is_still_refused(published: int) -> None:
    buffer = LaggingBuffer(clock=3)
    with pytest.raises(grpc.aio.AioRpcError, match="from the future"):
        await JobBuffer(buffer, "job", published=lambda: published).put(make_group("g", version=4))
    assert buffer.rewinds == [] and buffer.held == []
