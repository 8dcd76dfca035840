"""BufferService over gRPC: validates every request, then delegates to a BufferBackend.

    PutGroup / SampleGroups / AckGroups / GetStats --> validate --> backend

Malformed input is refused with INVALID_ARGUMENT and a message naming the
field, before the backend sees it; state errors come from the backend
(NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED). Either way nothing
already accepted changes and the server keeps serving.
"""

from __future__ import annotations

import grpc
import structlog

from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.common.v1 import common_pb2
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


class BufferServicer(buffer_pb2_grpc.BufferServiceServicer):
    """The gRPC face of one BufferBackend."""

    def __init__(self, backend: BufferBackend) -> None:
        self._backend = backend

    async def PutGroup(
        self, request: buffer_pb2.PutGroupRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.PutGroupResponse:
        if not request.HasField("group"):
            raise InvalidArgument("group is missing")
        # The interceptor binds a top-level job_id only; a put carries it inside the group.
        structlog.contextvars.bind_contextvars(job_id=request.group.job_id)
        validate_group(request.group)
        duplicate = await self._backend.put_group(request.group)
        return buffer_pb2.PutGroupResponse(duplicate=duplicate)

    async def SampleGroups(
        self, request: buffer_pb2.SampleGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.SampleGroupsResponse:
        _require_job_id(request.job_id)
        if request.max_groups < 1:
            raise InvalidArgument(f"max_groups must be >= 1, got {request.max_groups}")
        if request.trainer_step < 0:
            raise InvalidArgument(f"trainer_step must be >= 0, got {request.trainer_step}")
        if request.max_trajectory_age_steps < 0:
            raise InvalidArgument(f"max_trajectory_age_steps must be >= 0, got {request.max_trajectory_age_steps}")
        groups, dropped = await self._backend.sample(
            request.job_id, request.trainer_step, request.max_groups, request.max_trajectory_age_steps
        )
        if dropped:
            log.info("dropped stale groups", dropped=dropped, trainer_step=request.trainer_step)
        return buffer_pb2.SampleGroupsResponse(groups=groups, dropped_stale=dropped)

    async def AckGroups(
        self, request: buffer_pb2.AckGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.AckGroupsResponse:
        _require_job_id(request.job_id)
        for i, group_id in enumerate(request.group_ids):
            if not group_id:
                raise InvalidArgument(f"group_ids[{i}] is empty")
        acked = await self._backend.ack(request.job_id, list(request.group_ids))
        return buffer_pb2.AckGroupsResponse(acked=acked)

    async def GetStats(
        self, request: buffer_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.GetStatsResponse:
        _require_job_id(request.job_id)
        s = await self._backend.stats(request.job_id)
        return buffer_pb2.GetStatsResponse(
            held=s.held,
            pending=s.pending,
            acked=s.acked,
            dropped_stale=s.dropped_stale,
            puts=s.puts,
            duplicate_puts=s.duplicate_puts,
        )
