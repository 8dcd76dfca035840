"""A group the buffer refuses (INVALID_ARGUMENT) is counted and skipped; the groups around it are kept."""

from __future__ import annotations

import grpc

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.config import load_config_text
from services.coordinator.collector import Collector, CollectStats
from services.coordinator.fleet import Fleet
from services.coordinator.job_buffer import JobBuffer
from tests.conftest import make_group

CONFIG = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64}\n"


class RefusingBuffer:
    """Refuses the groups named in `bad` as the buffer service does; accepts the rest."""

    def __init__(self, bad: set[str]) -> None:
        self.bad, self.held = bad, []

    async def PutGroup(self, request: buffer_pb2.PutGroupRequest, timeout=None) -> buffer_pb2.PutGroupResponse:
        if request.group.group_id in self.bad:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=f"group {request.group.group_id!r} trajectories[0]: reward is nan, not a finite number",
            )
        self.held.append(request.group.group_id)
        return buffer_pb2.PutGroupResponse()


async def test_a_refused_group_is_counted_and_the_good_ones_are_kept() -> None:
    buffer = RefusingBuffer({"job/s1/g3"})
    outcomes: dict[str, str] = {}
    collector = Collector(
        "job",
        load_config_text(CONFIG),
        Fleet(60.0),
        JobBuffer(buffer, "job"),
        routing=None,
        max_generations=1,
        max_scoring=1,
        generate_timeout=10.0,
        on_group=lambda group_id, outcome, _: outcomes.__setitem__(group_id, outcome),
    )
    stats = CollectStats()
    held = [await collector.deliver(make_group(f"job/s1/g{i}", job_id="job"), stats) for i in range(8)]
    assert held == [True, True, True, False, True, True, True, True]
    assert (stats.groups, stats.failed) == (7, 1)
    assert outcomes["job/s1/g3"] == "refused"
    assert buffer.held == [f"job/s1/g{i}" for i in range(8) if i != 3]
