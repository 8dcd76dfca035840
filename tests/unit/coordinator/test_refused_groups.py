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

    async def PutGroupStream(self, chunks, timeout=None) -> buffer_pb2.PutGroupStreamResponse:
        request = next(iter(chunks))  # the first chunk carries the group's metadata
        if request.group.group_id in self.bad:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=f"group {request.group.group_id!r} trajectories[0]: reward is nan, not a finite number",
            )
        self.held.append(request.group.group_id)
        return buffer_pb2.PutGroupStreamResponse()


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


class StagingBuffer:
    """A buffer whose data plane is the test's Redis; records the metadata puts that name a staged key."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url, self.held = redis_url, []

    async def OpenJob(self, request, timeout=None):
        return buffer_pb2.OpenJobResponse()

    async def GetDataPlane(self, request, timeout=None):
        return buffer_pb2.GetDataPlaneResponse(
            redis_url=self.redis_url, key_prefix="dockyard:buffer", staging_ttl_seconds=60, max_trajectory_tokens=100
        )

    async def PutGroup(self, request, timeout=None):
        assert request.payload_key and request.payload_bytes > 0
        self.held.append(request.group.group_id)
        return buffer_pb2.PutGroupResponse()


async def test_a_group_the_data_plane_writer_refuses_is_counted_and_never_staged(redis_server: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    buffer = StagingBuffer(redis_server)
    job_buffer = JobBuffer(buffer, "job")
    await job_buffer.open()
    assert job_buffer.data_plane is not None
    outcomes: dict[str, str] = {}
    collector = Collector(
        "job",
        load_config_text(CONFIG),
        Fleet(60.0),
        job_buffer,
        routing=None,
        max_generations=1,
        max_scoring=1,
        generate_timeout=10.0,
        on_group=lambda group_id, outcome, _: outcomes.__setitem__(group_id, outcome),
    )
    positive = make_group("job/s1/g1", job_id="job")
    positive.trajectories[1].completion_logprobs[0] = 0.5
    too_long = make_group("job/s1/g2", job_id="job", tokens=200)  # above the buffer's 100 tokens
    stats = CollectStats()
    groups = [make_group("job/s1/g0", job_id="job"), positive, too_long]
    held = [await collector.deliver(g, stats) for g in groups]
    assert held == [True, False, False]
    assert (stats.groups, stats.failed) == (1, 2)
    assert outcomes == {"job/s1/g0": "put", "job/s1/g1": "refused", "job/s1/g2": "refused"}
    assert buffer.held == ["job/s1/g0"]
    assert [k.decode().rsplit(":", 1)[0] for k in client.keys("*")] == ["dockyard:buffer:{job}:s:job/s1/g0"]
    await job_buffer.close_plane()
