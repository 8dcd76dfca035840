"""BufferService over gRPC: validates every request, then delegates to a BufferBackend.

    OpenJob / CloseJob / PutGroup / SampleGroups / ReclaimGroups / AckGroups / GetStats
        --> validate --> backend

Sizes are enforced here: a put above DOCKYARD_BUFFER_MAX_GROUP_MB is refused,
and a sample or reclaim returns no more bytes than one message can carry.

Malformed input is refused with INVALID_ARGUMENT and a message naming the
group and field, before the backend sees it (a group the trainer could not
train on included: non-finite rewards or logprobs, positive logprobs, negative
token ids, an empty prompt, a loss mask that is not one 0/1 per completion
token, in any segment (an invalid trajectory may have no tokens at all); more than DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS
tokens in a trajectory over its segments, a job id outside dockyard.jobs.JOB_ID, a version above
MAX_VERSION); state errors come from the backend
(NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED). Either way nothing
already accepted changes and the server keeps serving.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence

import grpc
import structlog

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.jobs import job_id_error
from dockyard.rpc.errors import InvalidArgument
from services.buffer.backend import MAX_VERSION, BufferBackend

DEFAULT_MAX_TRAJECTORY_TOKENS = 65536

log = structlog.get_logger()


def validate_group(group: common_pb2.Group, max_trajectory_tokens: int = DEFAULT_MAX_TRAJECTORY_TOKENS) -> None:
    """Raise InvalidArgument unless `group` is a well-formed whole group the trainer can train on.

    The trainer's own checks (services/trainer/batch.py) minus the vocabulary, which the buffer
    does not know: a group refused here never reaches a batch, so it cannot fail one.
    """
    _require_job_id(group.job_id, "group.job_id")
    if not group.group_id:
        raise InvalidArgument("group.group_id is empty")
    if not group.trajectories:
        raise InvalidArgument(f"group {group.group_id!r} has no trajectories")
    if not 0 <= group.weight_version <= MAX_VERSION:
        raise InvalidArgument(
            f"group {group.group_id!r}: weight_version {group.weight_version} is not in [0, {MAX_VERSION}]"
        )
    for i, trajectory in enumerate(group.trajectories):
        where = f"group {group.group_id!r} trajectories[{i}] ({trajectory.trajectory_id!r})"
        if trajectory.weight_version < 0:
            raise InvalidArgument(f"{where}: weight_version {trajectory.weight_version} is negative")
        _check_trajectory(where, trajectory, max_trajectory_tokens)
    # The group's age is measured from its oldest trajectory; a different
    # stamp would let an over-age trajectory past the bound.
    oldest = min(t.weight_version for t in group.trajectories)
    if group.weight_version != oldest:
        raise InvalidArgument(
            f"group {group.group_id!r}: weight_version {group.weight_version} differs from the oldest "
            f"trajectory weight_version {oldest}; it must equal the minimum over its trajectories"
        )


def _check_trajectory(where: str, trajectory: common_pb2.Trajectory, max_tokens: int) -> None:
    if not math.isfinite(trajectory.reward):
        raise InvalidArgument(f"{where}: reward is {trajectory.reward}, not a finite number")
    if not trajectory.valid and not (
        trajectory.prompt_token_ids or trajectory.completion_token_ids or trajectory.later_segments
    ):
        return  # an infrastructure failure before any token (a failed agent trial): nothing to check
    tokens = 0
    for k, segment in enumerate([trajectory, *trajectory.later_segments]):
        tokens += _check_segment(where if k == 0 else f"{where} later_segments[{k - 1}]", segment)
    if tokens > max_tokens:
        raise InvalidArgument(
            f"{where}: {tokens} tokens (prompt_token_ids + completion_token_ids over its segments); "
            f"at most {max_tokens} (DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS)"
        )


def _check_segment(where: str, segment: common_pb2.Trajectory | common_pb2.Segment) -> int:
    """Refuse a segment (a trajectory's own fields, or a later segment) the trainer cannot use; its token count."""
    prompt, completion = segment.prompt_token_ids, segment.completion_token_ids
    if not prompt:
        raise InvalidArgument(f"{where}: prompt_token_ids is empty")
    for field, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
        if ids and min(ids) < 0:
            raise InvalidArgument(f"{where}: {field} holds the negative token id {min(ids)}")
    if len(segment.completion_logprobs) != len(completion):
        raise InvalidArgument(
            f"{where}: {len(segment.completion_logprobs)} completion_logprobs for "
            f"{len(completion)} completion_token_ids; need one logprob per token"
        )
    mask = segment.completion_loss_mask
    if mask and len(mask) != len(completion):
        raise InvalidArgument(
            f"{where}: {len(mask)} completion_loss_mask values for {len(completion)} completion_token_ids; "
            "need one per token (or none: all sampled)"
        )
    if any(m not in (0, 1) for m in mask):
        raise InvalidArgument(f"{where}: completion_loss_mask holds {next(m for m in mask if m not in (0, 1))}; 0 or 1")
    if bad := _bad_logprob(segment.completion_logprobs):
        raise InvalidArgument(f"{where}: completion_logprobs holds {bad}; a logprob is a finite number <= 0")
    return len(prompt) + len(completion)


def _bad_logprob(logprobs: Sequence[float]) -> str | None:
    # `not x <= 0` is True for NaN as well as for positive values.
    if any(not x <= 0.0 for x in logprobs):
        return str(next(x for x in logprobs if not x <= 0.0))
    if logprobs and min(logprobs) == -math.inf:
        return "-inf"
    return None


def _require_job_id(job_id: str, field: str = "job_id") -> None:
    if error := job_id_error(job_id, field):
        raise InvalidArgument(error)


def _require_version(field: str, version: int) -> None:
    if version < 0:
        raise InvalidArgument(f"{field} must be >= 0, got {version}")
    if version > MAX_VERSION:
        raise InvalidArgument(f"{field} {version} is beyond any job's {MAX_VERSION} steps")


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

    def __init__(
        self,
        backend: BufferBackend,
        *,
        max_group_bytes: int,
        max_message_bytes: int,
        max_trajectory_tokens: int = DEFAULT_MAX_TRAJECTORY_TOKENS,
    ) -> None:
        self._backend = backend
        self._max_trajectory_tokens = max_trajectory_tokens
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
        if rewind_to is not None:
            _require_version("rewind_to_version", rewind_to)
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
        validate_group(request.group, self._max_trajectory_tokens)
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
        _require_version("weight_version", request.weight_version)
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
    _require_version("trainer_step", request.trainer_step)
    if not request.consumer:
        raise InvalidArgument("consumer is empty: name the trainer that leases the groups")
