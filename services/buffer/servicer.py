"""BufferService over gRPC: validates every request, then delegates to a BufferBackend.

    OpenJob / CloseJob / PutGroup / SampleGroups / ReclaimGroups / AckGroups / GetStats
        --> validate --> backend

Sizes are enforced here: a put above DOCKYARD_BUFFER_MAX_GROUP_MB is refused,
and a sample or reclaim returns no more bytes than one message can carry.

Malformed input is refused with INVALID_ARGUMENT and a message naming the
field, before the backend sees it; state errors come from the backend
(NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED). Either way nothing
already accepted changes and the server keeps serving.
"""

from __future__ import annotations

import math
import time
from collections import deque

import grpc
import structlog

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.errors import InvalidArgument
from services.buffer.backend import BufferBackend

log = structlog.get_logger()


def validate_group(group: common_pb2.Group) -> None:
    """Raise InvalidArgument unless `group` is a well-formed whole group."""
    if not group.job_id:
        raise InvalidArgument("group.job_id is empty")
    if not group.group_id:
        raise InvalidArgument("group.group_id is empty")
    if not group.trajectories:
        raise InvalidArgument(f"group {group.group_id!r} has no trajectories")
    if group.weight_version < 0:
        raise InvalidArgument(f"group {group.group_id!r}: weight_version {group.weight_version} is negative")
    for i, trajectory in enumerate(group.trajectories):
        where = f"group {group.group_id!r} trajectories[{i}] ({trajectory.trajectory_id!r})"
        if trajectory.weight_version < 0:
            raise InvalidArgument(f"{where}: weight_version {trajectory.weight_version} is negative")
        if len(trajectory.completion_logprobs) != len(trajectory.completion_token_ids):
            raise InvalidArgument(
                f"{where}: {len(trajectory.completion_logprobs)} completion_logprobs for "
                f"{len(trajectory.completion_token_ids)} completion_token_ids; need one logprob per token"
            )
    # The group's age is measured from its oldest trajectory; a different
    # stamp would let an over-age trajectory past the bound.
    oldest = min(t.weight_version for t in group.trajectories)
    if group.weight_version != oldest:
        raise InvalidArgument(
            f"group {group.group_id!r}: weight_version {group.weight_version} differs from the oldest "
            f"trajectory weight_version {oldest}; it must equal the minimum over its trajectories"
        )


def _require_job_id(job_id: str) -> None:
    if not job_id:
        raise InvalidArgument("job_id is empty")


class RateMeter:
    """Events per second over a sliding window, per job."""

    def __init__(self, window: float = 60.0) -> None:
        self._window = window
        self._events: dict[str, deque[tuple[float, int]]] = {}
        self._started = time.monotonic()

    def add(self, job_id: str, count: int) -> None:
        if count:
            events = self._events.setdefault(job_id, deque())
            events.append((time.monotonic(), count))
            self._expire(events)  # bounded even if nobody asks for the rate

    def forget(self, job_id: str) -> None:
        self._events.pop(job_id, None)

    def _expire(self, events: deque[tuple[float, int]]) -> None:
        now = time.monotonic()
        while events and now - events[0][0] > self._window:
            events.popleft()

    def rate(self, job_id: str) -> float:
        now = time.monotonic()
        events = self._events.get(job_id, deque())
        self._expire(events)
        span = min(self._window, now - self._started)
        return sum(count for _, count in events) / span if span > 0 else 0.0


class BufferServicer(buffer_pb2_grpc.BufferServiceServicer):
    """The gRPC face of one BufferBackend."""

    def __init__(self, backend: BufferBackend, *, max_group_bytes: int, max_message_bytes: int) -> None:
        self._backend = backend
        self._max_group_bytes = max_group_bytes
        # A sample's reply must fit one message; keep room for the envelope.
        self._max_sample_bytes = max_message_bytes - 64 * 1024
        self._puts = RateMeter()
        self._samples = RateMeter()

    async def OpenJob(
        self, request: buffer_pb2.OpenJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.OpenJobResponse:
        _require_job_id(request.job_id)
        if request.max_groups < 1:
            raise InvalidArgument(f"max_groups must be >= 1, got {request.max_groups}")
        if request.max_trajectory_age_steps < 0:
            raise InvalidArgument(f"max_trajectory_age_steps must be >= 0, got {request.max_trajectory_age_steps}")
        rewind_to = request.rewind_to_version if request.HasField("rewind_to_version") else None
        if rewind_to is not None and rewind_to < 0:
            raise InvalidArgument(f"rewind_to_version must be >= 0, got {rewind_to}")
        await self._backend.open_job(request.job_id, request.max_groups, request.max_trajectory_age_steps, rewind_to)
        return buffer_pb2.OpenJobResponse()

    async def CloseJob(
        self, request: buffer_pb2.CloseJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.CloseJobResponse:
        _require_job_id(request.job_id)
        await self._backend.close_job(request.job_id)
        self._puts.forget(request.job_id)
        self._samples.forget(request.job_id)
        return buffer_pb2.CloseJobResponse()

    async def PutGroup(
        self, request: buffer_pb2.PutGroupRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.PutGroupResponse:
        if not request.HasField("group"):
            raise InvalidArgument("group is missing")
        # The interceptor binds a top-level job_id only; a put carries it inside the group.
        structlog.contextvars.bind_contextvars(job_id=request.group.job_id)
        validate_group(request.group)
        size = request.group.ByteSize()
        if size > self._max_group_bytes:
            raise InvalidArgument(
                f"group {request.group.group_id!r} is {size / 2**20:.1f} MiB; "
                f"the limit is {self._max_group_bytes / 2**20:.1f} MiB (DOCKYARD_BUFFER_MAX_GROUP_MB)"
            )
        duplicate, dropped = await self._backend.put_group(request.group)
        self._puts.add(request.group.job_id, 0 if duplicate else 1)
        return buffer_pb2.PutGroupResponse(duplicate=duplicate, dropped_stale=dropped)

    async def SampleGroups(
        self, request: buffer_pb2.SampleGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.SampleGroupsResponse:
        _check_lease_request(request)
        groups, dropped = await self._backend.sample(
            request.job_id, request.consumer, request.trainer_step, request.max_groups, self._max_sample_bytes
        )
        if dropped:
            log.info("dropped stale groups", dropped=dropped, trainer_step=request.trainer_step)
        self._samples.add(request.job_id, len(groups))
        return buffer_pb2.SampleGroupsResponse(groups=groups, dropped_stale=dropped)

    async def ReclaimGroups(
        self, request: buffer_pb2.ReclaimGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.ReclaimGroupsResponse:
        _check_lease_request(request)
        if not math.isfinite(request.min_idle_seconds) or request.min_idle_seconds < 0:
            raise InvalidArgument(f"min_idle_seconds must be a finite number >= 0, got {request.min_idle_seconds}")
        groups, dropped = await self._backend.reclaim(
            request.job_id,
            request.consumer,
            request.trainer_step,
            request.max_groups,
            self._max_sample_bytes,
            request.min_idle_seconds,
        )
        log.info("reclaimed groups", reclaimed=len(groups), dropped=dropped, consumer=request.consumer)
        self._samples.add(request.job_id, len(groups))
        return buffer_pb2.ReclaimGroupsResponse(groups=groups, dropped_stale=dropped)

    async def AckGroups(
        self, request: buffer_pb2.AckGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.AckGroupsResponse:
        _require_job_id(request.job_id)
        if request.weight_version < 0:
            raise InvalidArgument(f"weight_version must be >= 0, got {request.weight_version}")
        for i, group_id in enumerate(request.group_ids):
            if not group_id:
                raise InvalidArgument(f"group_ids[{i}] is empty")
        acked = await self._backend.ack(request.job_id, list(request.group_ids), request.weight_version)
        return buffer_pb2.AckGroupsResponse(acked=acked)

    async def GetStats(
        self, request: buffer_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.GetStatsResponse:
        _require_job_id(request.job_id)
        s = await self._backend.stats(request.job_id)
        ages: dict[int, int] = {}
        for version, count in s.held_versions.items():
            age = s.latest_version - version
            ages[age] = ages.get(age, 0) + count
        return buffer_pb2.GetStatsResponse(
            held=s.held,
            pending=s.pending,
            acked=s.acked,
            dropped_stale=s.dropped_stale,
            puts=s.puts,
            duplicate_puts=s.duplicate_puts,
            reclaimed=s.reclaimed,
            latest_version=s.latest_version,
            max_groups=s.max_groups,
            max_trajectory_age_steps=s.max_age,
            put_rate=self._puts.rate(request.job_id),
            sample_rate=self._samples.rate(request.job_id),
            age_histogram=ages,
        )


def _check_lease_request(request: buffer_pb2.SampleGroupsRequest | buffer_pb2.ReclaimGroupsRequest) -> None:
    _require_job_id(request.job_id)
    if request.max_groups < 1:
        raise InvalidArgument(f"max_groups must be >= 1, got {request.max_groups}")
    if request.trainer_step < 0:
        raise InvalidArgument(f"trainer_step must be >= 0, got {request.trainer_step}")
    if not request.consumer:
        raise InvalidArgument("consumer is empty: name the trainer that leases the groups")
