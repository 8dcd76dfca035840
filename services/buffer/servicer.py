"""BufferService over gRPC: validates every request, then delegates to a BufferBackend.

    OpenJob / CloseJob / PutGroup / SampleGroups / ReclaimGroups / AckGroups / GetStats / TakeTrainerLease
        --> validate --> backend
    PutGroupStream (metadata + packed payload in chunks) --> validate --> backend stores both as sent
    PutGroup (metadata + payload_key: staged in the data plane) --> validate --> backend takes the key over
    SampleGroupsStream / ReclaimGroupsStream <-- each group's stored bytes, the payload in chunks
        (payload_by_reference: each payload's data-plane key instead of its bytes)
    GetDataPlane <-- where the data plane is (dockyard/experience/data_plane.py), empty when there is none

Sizes are enforced here: a put above DOCKYARD_BUFFER_MAX_GROUP_MB is refused,
and a unary sample or reclaim returns no more bytes than one message can carry
(the streamed ones have no such cap; a group with a payload is filled in for
the unary ones, the streamed ones never decode it).

Malformed input is refused with INVALID_ARGUMENT and a message naming the
group and field, before the backend sees it (a group the trainer could not
train on included: non-finite rewards or logprobs, positive logprobs, negative
token ids, an empty prompt, a loss mask that is not one 0/1 per completion
token, in any segment (an invalid trajectory may have no tokens at all); more than DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS
tokens in a trajectory over its segments, a job id outside dockyard.jobs.JOB_ID, a version above
MAX_VERSION); state errors come from the backend
(NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED; an AckGroups whose lease_id is not the job's
trainer lease is FAILED_PRECONDITION naming the job and the lease's consumer). Either way nothing
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
from dockyard.experience import payload as packed
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument
from services.buffer.backend import BufferBackend, StagedPayload, StoredGroup
from services.buffer.validation import (
    DEFAULT_MAX_TRAJECTORY_TOKENS,
    require_consumer,
    require_job_bounds,
    require_job_id,
    require_lease_id,
    require_version,
    validate_group,
)

# A streamed sample has no message cap: max_groups bounds it, and no group exceeds DOCKYARD_BUFFER_MAX_GROUP_MB.
STREAM_MAX_BYTES = 1 << 50
# How much of a refused PutGroupStream is read (and dropped) so its client sees the status, not a broken write.
DRAIN_MAX_BYTES = 1 << 30
# The requests that lease groups: the unary and streamed samples and reclaims share their fields.
LeaseRequest = (
    buffer_pb2.SampleGroupsRequest
    | buffer_pb2.SampleGroupsStreamRequest
    | buffer_pb2.ReclaimGroupsRequest
    | buffer_pb2.ReclaimGroupsStreamRequest
)

log = structlog.get_logger()


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
        data_plane_url: str = "",
        staging_ttl_seconds: int = 3600,
    ) -> None:
        self._backend = backend
        # What GetDataPlane advertises: the Redis URL clients use (never with a password), if the backend has one.
        prefix = backend.data_plane_prefix()
        self._data_plane = buffer_pb2.GetDataPlaneResponse()
        if data_plane_url and prefix is not None:
            self._data_plane = buffer_pb2.GetDataPlaneResponse(
                redis_url=data_plane_url,
                key_prefix=prefix,
                staging_ttl_seconds=staging_ttl_seconds,
                max_trajectory_tokens=max_trajectory_tokens,
                max_group_bytes=max_group_bytes,
            )
        self._max_trajectory_tokens = max_trajectory_tokens
        self._max_group_bytes = max_group_bytes
        # A sample's reply must fit one message; keep room for the envelope.
        self._max_sample_bytes = max_message_bytes - 64 * 1024
        self._puts = RateMeter()
        self._samples = RateMeter()

    async def OpenJob(
        self, request: buffer_pb2.OpenJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.OpenJobResponse:
        require_job_id(request.job_id)
        require_job_bounds(request.max_groups, request.max_trajectory_age_steps)
        rewind_to = request.rewind_to_version if request.HasField("rewind_to_version") else None
        if rewind_to is not None:
            require_version("rewind_to_version", rewind_to)
        await self._backend.open_job(request.job_id, request.max_groups, request.max_trajectory_age_steps, rewind_to)
        return buffer_pb2.OpenJobResponse()

    async def CloseJob(
        self, request: buffer_pb2.CloseJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.CloseJobResponse:
        require_job_id(request.job_id)
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
        if request.payload_key:
            duplicate, dropped = await self._put_staged(request)
        else:
            duplicate, dropped = await self._put(request.group, None)
        return buffer_pb2.PutGroupResponse(duplicate=duplicate, dropped_stale=dropped)

    async def _put_staged(self, request: buffer_pb2.PutGroupRequest) -> tuple[bool, bool]:
        """A put whose payload a writer staged in the data plane: the metadata is checked here, the payload
        by its writer (dockyard/experience/data_plane.py), its presence and length by the backend."""
        group = request.group
        if not self._data_plane.redis_url:
            raise FailedPrecondition(
                "payload_key is set but this buffer has no data plane (GetDataPlane is empty): "
                "put the payload with PutGroupStream"
            )
        validate_group(group, self._max_trajectory_tokens, staged=True)
        if request.payload_bytes < 1:
            raise InvalidArgument(f"group {group.group_id!r}: payload_bytes must be >= 1, got {request.payload_bytes}")
        size = group.ByteSize() + request.payload_bytes
        if size > self._max_group_bytes:
            self._refuse_size(group.group_id, size)
        duplicate, dropped = await self._backend.put_staged(
            group, StagedPayload(request.payload_key, request.payload_bytes)
        )
        self._puts.add(group.job_id, 0 if duplicate else 1)
        return duplicate, dropped

    async def PutGroupStream(
        self, request_iterator, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.PutGroupStreamResponse:
        group: common_pb2.Group | None = None
        pieces: list[bytes] = []
        size = 0
        chunks = aiter(request_iterator)
        async for chunk in chunks:
            if chunk.HasField("group"):
                if group is not None:
                    await _drain(chunks)
                    raise InvalidArgument("a PutGroupStream carries one group: `group` is set on a later chunk too")
                group = chunk.group
                structlog.contextvars.bind_contextvars(job_id=group.job_id)
            elif group is None:
                await _drain(chunks)
                raise InvalidArgument("the first chunk of a PutGroupStream must carry the group")
            size += len(chunk.payload)
            if size > self._max_group_bytes:  # refused while streaming: never held in memory whole
                pieces.clear()
                size += await _drain(chunks)
                self._refuse_size(group.group_id, size, streamed=True)
            pieces.append(chunk.payload)
        if group is None:
            raise InvalidArgument("group is missing: the PutGroupStream was empty")
        duplicate, dropped = await self._put(group, b"".join(pieces))
        return buffer_pb2.PutGroupStreamResponse(duplicate=duplicate, dropped_stale=dropped)

    async def _put(self, group: common_pb2.Group, payload: bytes | None) -> tuple[bool, bool]:
        """Validate and store; (duplicate, dropped_stale)."""
        validate_group(group, self._max_trajectory_tokens, payload)
        size = group.ByteSize() + len(payload or b"")
        if size > self._max_group_bytes:
            self._refuse_size(group.group_id, size)
        duplicate, dropped = await self._backend.put_group(group, payload or b"")
        self._puts.add(group.job_id, 0 if duplicate else 1)
        return duplicate, dropped

    def _refuse_size(self, group_id: str, size: int, *, streamed: bool = False) -> None:
        raise InvalidArgument(
            f"group {group_id!r} is {'at least ' if streamed else ''}{size / 2**20:.1f} MiB; "
            f"the limit is {self._max_group_bytes / 2**20:.1f} MiB (DOCKYARD_BUFFER_MAX_GROUP_MB)"
        )

    async def SampleGroups(
        self, request: buffer_pb2.SampleGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.SampleGroupsResponse:
        groups, dropped = await self._sample(request, self._max_sample_bytes)
        return buffer_pb2.SampleGroupsResponse(groups=[_whole(g) for g in groups], dropped_stale=dropped)

    async def SampleGroupsStream(
        self, request: buffer_pb2.SampleGroupsStreamRequest, context: grpc.aio.ServicerContext
    ):
        groups, dropped = await self._sample(request, STREAM_MAX_BYTES, self._by_reference(request))
        for piece in _stream(groups, dropped, buffer_pb2.SampleGroupsStreamResponse):
            yield piece

    def _by_reference(
        self, request: buffer_pb2.SampleGroupsStreamRequest | buffer_pb2.ReclaimGroupsStreamRequest
    ) -> bool:
        if request.payload_by_reference and not self._data_plane.redis_url:
            raise FailedPrecondition(
                "payload_by_reference is set but this buffer has no data plane (GetDataPlane is empty): "
                "sample without it to get the payloads' bytes"
            )
        return request.payload_by_reference

    async def _sample(
        self, request: LeaseRequest, max_bytes: int, by_reference: bool = False
    ) -> tuple[list[StoredGroup], int]:
        _check_lease_request(request)
        groups, dropped = await self._backend.sample(
            request.job_id,
            request.consumer,
            request.trainer_step,
            request.max_groups,
            max_bytes,
            by_reference=by_reference,
            lease=request.lease_id,
        )
        if dropped:
            log.info("dropped stale groups", dropped=dropped, trainer_step=request.trainer_step)
        self._samples.add(request.job_id, len(groups))
        return groups, dropped

    async def ReclaimGroups(
        self, request: buffer_pb2.ReclaimGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.ReclaimGroupsResponse:
        groups, dropped = await self._reclaim(request, self._max_sample_bytes)
        return buffer_pb2.ReclaimGroupsResponse(groups=[_whole(g) for g in groups], dropped_stale=dropped)

    async def ReclaimGroupsStream(
        self, request: buffer_pb2.ReclaimGroupsStreamRequest, context: grpc.aio.ServicerContext
    ):
        groups, dropped = await self._reclaim(request, STREAM_MAX_BYTES, self._by_reference(request))
        for piece in _stream(groups, dropped, buffer_pb2.ReclaimGroupsStreamResponse):
            yield piece

    async def _reclaim(
        self,
        request: buffer_pb2.ReclaimGroupsRequest | buffer_pb2.ReclaimGroupsStreamRequest,
        max_bytes: int,
        by_reference: bool = False,
    ) -> tuple[list[StoredGroup], int]:
        _check_lease_request(request)
        if not math.isfinite(request.min_idle_seconds) or request.min_idle_seconds < 0:
            raise InvalidArgument(f"min_idle_seconds must be a finite number >= 0, got {request.min_idle_seconds}")
        groups, dropped = await self._backend.reclaim(
            request.job_id,
            request.consumer,
            request.trainer_step,
            request.max_groups,
            max_bytes,
            request.min_idle_seconds,
            by_reference=by_reference,
            lease=request.lease_id,
        )
        log.info("reclaimed groups", reclaimed=len(groups), dropped=dropped, consumer=request.consumer)
        self._samples.add(request.job_id, len(groups))
        return groups, dropped

    async def AckGroups(
        self, request: buffer_pb2.AckGroupsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.AckGroupsResponse:
        require_job_id(request.job_id)
        require_version("weight_version", request.weight_version)
        require_lease_id(request.lease_id)
        for i, group_id in enumerate(request.group_ids):
            if not group_id:
                raise InvalidArgument(f"group_ids[{i}] is empty")
        acked = await self._backend.ack(
            request.job_id, list(request.group_ids), request.weight_version, lease=request.lease_id
        )
        return buffer_pb2.AckGroupsResponse(acked=acked)

    async def TakeTrainerLease(
        self, request: buffer_pb2.TakeTrainerLeaseRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.TakeTrainerLeaseResponse:
        require_job_id(request.job_id)
        require_consumer(request.consumer)
        lease_id = await self._backend.take_lease(request.job_id, request.consumer)
        log.info("trainer lease taken", consumer=request.consumer)
        return buffer_pb2.TakeTrainerLeaseResponse(lease_id=lease_id)

    async def GetDataPlane(
        self, request: buffer_pb2.GetDataPlaneRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.GetDataPlaneResponse:
        return self._data_plane

    async def GetStats(
        self, request: buffer_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.GetStatsResponse:
        require_job_id(request.job_id)
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


def _whole(stored: StoredGroup) -> common_pb2.Group:
    """The whole Group message of a stored group, for the unary sample and reclaim."""
    group = stored.group()
    return packed.merge(group, stored.payload) if stored.payload else group


def _stream(groups: list[StoredGroup], dropped: int, piece_type):
    """Pieces (`piece_type` messages) of stored groups, bytes as stored: each group's metadata, then its
    payload in chunks (or its data-plane key); the last piece says done."""
    for stored in groups:
        for k, chunk in enumerate(packed.chunks(stored.payload)):
            if k == 0:
                yield piece_type(group=stored.metadata, payload=chunk, payload_key=stored.payload_key)
            else:
                yield piece_type(payload=chunk)
    yield piece_type(dropped_stale=dropped, done=True)


async def _drain(chunks) -> int:
    """Read and drop what is left of a refused stream (up to DRAIN_MAX_BYTES); the bytes read.

    A server that answers while the client still writes races the client's writes: the aio client
    then sees INTERNAL ("Internal error from Core") instead of the status. Reading the rest first,
    keeping none of it, lets the status arrive after the client's last write.
    """
    drained = 0
    async for chunk in chunks:
        drained += len(chunk.payload)
        if drained > DRAIN_MAX_BYTES:
            break
    return drained


def _check_lease_request(request: LeaseRequest) -> None:
    require_job_id(request.job_id)
    if request.max_groups < 1:
        raise InvalidArgument(f"max_groups must be >= 1, got {request.max_groups}")
    require_version("trainer_step", request.trainer_step)
    require_consumer(request.consumer)
    require_lease_id(request.lease_id)
