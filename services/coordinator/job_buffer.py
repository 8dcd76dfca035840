"""One job's calls to the buffer service: open (and rewind), the clock, puts, stats, close.

    runner/recovery ─open(rewind_to)─> OpenJob      collector ─put(group)─> (full, down: waited out)
        (the first open also asks GetDataPlane)       with a data plane: payload SET in Redis, PutGroup(metadata, key)
                                                       without: PutGroupStream(metadata + packed payload)
                                                     ─put(metadata, staged)─> the payload the rollout staged:
                                                       PutGroup(metadata, its key) (single_turn.py)
                                                       (dockyard/experience/payload.py, data_plane.py)
    recovery ─set_clock(v)─> OpenJob(rewind_to v)    producer, metrics ─stats()─> GetStats (None while restarting)

Guarantees: `open` and `set_clock` wait out a buffer that is down (UNAVAILABLE, DEADLINE_EXCEEDED)
for up to `recovery_timeout` seconds. `put` is the one place a put is retried
(dockyard.rpc.retry lists it as CALLER_RETRIED, so the channel does not retry it too): a full buffer
(RESOURCE_EXHAUSTED) and an unreachable one (UNAVAILABLE, DEADLINE_EXCEEDED) are waited out with
backoff up to `max_wait` seconds, which is safe because a put is idempotent by group id; any other
error is raised at once, but one: a put refused as "from the future" while the trainer's published
version (`published`, the version the coordinator recorded from the trainer's own TrainStep or
LoadPolicy reply) already covers the group's version is re-checked, not failed: the buffer's clock
is behind the trainer only if the store lost the ack that moved it (a Redis with appendfsync everysec
that died within the second), so `set_clock` brings it up to the group's version (never past what the
trainer published) and the put is sent again. The trainer's acks land before it publishes a version
(services/trainer/consumer.py), so with a durable store this never happens. A staged payload's
expiry is renewed before every retry and the payload staged again if it expired, so a put waited
out for long still finds it. A payload the rollout staged (`staged`) cannot be staged again here,
since these bytes never reached this side: when its key expired before a put (scoring outlasted the
buffer's DOCKYARD_BUFFER_STAGING_TTL_SECONDS), `put` raises StagedPayloadGone and the caller generates
the group again (Collector.deliver); one whose group will not be put is deleted (`discard`). A data
plane whose Redis
is down is waited out as the buffer is (UNAVAILABLE). `stats` never raises for
a buffer that is restarting: it answers None. `sent_bytes` counts what this side sent the buffer
service (metadata, payload), what it staged in the data plane (staged), and the payloads the rollout
staged that its puts committed (rollout_staged, bytes this side never held: a single-turn group's, or an
agent group's assembled from the parts the endpoint staged); `sent()` is a copy for readers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
from redis.exceptions import RedisError

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.data_plane import DataPlane
from dockyard.rpc.retry import OVERLOADED, TRANSIENT, retry

# How long a put waits for a full or unreachable buffer before the error fails the job.
PUT_MAX_WAIT_SECONDS = 600.0
# The words of the buffer's refusal of a put whose version is above its clock (services/buffer: memory.py,
# redis_backend.py; tests/contract/test_buffer_service.py holds the buffer to them).
FROM_THE_FUTURE = "from the future"

log = structlog.get_logger()


@dataclass(frozen=True)
class StagedPayload:
    """A group's payload another writer (the rollout) staged in the data plane: its key and size in bytes."""

    key: str
    size: int


class StagedPayloadGone(Exception):
    """A payload the rollout staged expired before its put; only generating the group again brings it back."""


class JobBuffer:
    def __init__(
        self,
        stub: buffer_pb2_grpc.BufferServiceStub,
        job_id: str,
        *,
        max_groups: int = 0,
        max_age_steps: int = 0,
        recovery_timeout: float = 300.0,
        published: Callable[[], int] = lambda: 0,
    ) -> None:
        self._stub = stub
        self._published = published  # the trainer's published weight version, as the coordinator recorded it
        self.job_id = job_id
        self._max_groups, self._max_age_steps = max_groups, max_age_steps
        self._recovery_timeout = recovery_timeout  # how long open and set_clock wait out a buffer that is down
        # Bytes of experience this side sent: metadata and payload to the buffer service, payload to the data plane.
        self.sent_bytes = {"metadata": 0, "payload": 0, "staged": 0, "rollout_staged": 0}
        self._plane: DataPlane | None = None
        self._plane_asked = False

    async def open(self, rewind_to: int | None = None) -> None:
        """OpenJob with the job's capacity and age bound; `rewind_to` sets the clock back to that version."""
        request = buffer_pb2.OpenJobRequest(
            job_id=self.job_id, max_groups=self._max_groups, max_trajectory_age_steps=self._max_age_steps
        )
        if rewind_to is not None:
            request.rewind_to_version = rewind_to
        await retry(
            lambda: self._stub.OpenJob(request, timeout=30), what="OpenJob", budget_seconds=self._recovery_timeout
        )
        if not self._plane_asked:
            self._plane = await DataPlane.discover(self._stub)
            self._plane_asked = True

    async def set_clock(self, version: int) -> None:
        """The buffer's clock (age bound, puts from the future) at least at `version`: OpenJob's
        rewind_to_version when the clock is behind (an ack of no groups moves nothing), else nothing."""
        asked = buffer_pb2.GetStatsRequest(job_id=self.job_id)
        stats = await retry(
            lambda: self._stub.GetStats(asked, timeout=10), what="GetStats", budget_seconds=self._recovery_timeout
        )
        if stats.latest_version < version:
            await self.open(rewind_to=version)

    async def put(
        self, group: common_pb2.Group, max_wait: float = PUT_MAX_WAIT_SECONDS, *, staged: StagedPayload | None = None
    ) -> buffer_pb2.PutGroupResponse:
        """The group's payload into the data plane (or PutGroupStream without one), its metadata to the buffer,
        waiting with exponential backoff while the buffer is full or unreachable. With `staged`, `group` is
        metadata only and its payload is the one the rollout staged (StagedPayloadGone once that expired).
        A group the buffer would refuse is INVALID_ARGUMENT: from the buffer (AioRpcError), or from the
        data plane's check before staging (dockyard.rpc.errors.InvalidArgument)."""
        if staged is None:
            metadata, payload = packed.split(group)
        else:
            metadata, payload = group, staged
        try:
            return await self._put_once(metadata, payload, max_wait)
        except grpc.aio.AioRpcError as exc:
            if not self._clock_behind_trainer(exc, metadata.weight_version):
                raise
            log.warning(
                "the buffer's clock is behind the trainer's published version; setting it and putting again",
                group_id=metadata.group_id,
                weight_version=metadata.weight_version,
                published=self._published(),
            )
            await self.set_clock(metadata.weight_version)
            return await self._put_once(metadata, payload, max_wait)

    def _clock_behind_trainer(self, exc: grpc.aio.AioRpcError, version: int) -> bool:
        """Whether `exc` refused a put as from the future that the trainer's published version proves is not."""
        future = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and FROM_THE_FUTURE in (exc.details() or "")
        return future and version <= self._published()

    async def _put_once(
        self, metadata: common_pb2.Group, payload: bytes | StagedPayload, max_wait: float
    ) -> buffer_pb2.PutGroupResponse | buffer_pb2.PutGroupStreamResponse:
        if isinstance(payload, StagedPayload):
            reply = await self._put_staged(self._plane, metadata, payload, max_wait)
            self.sent_bytes["rollout_staged"] += payload.size
        elif self._plane is None:
            reply = await self._put_streamed(metadata, payload, max_wait)
            self.sent_bytes["payload"] += len(payload)
        else:
            reply = await self._put_staged(self._plane, metadata, payload, max_wait)
            self.sent_bytes["staged"] += len(payload)
        self.sent_bytes["metadata"] += metadata.ByteSize()
        return reply

    async def _put_streamed(
        self, metadata: common_pb2.Group, payload: bytes, max_wait: float
    ) -> buffer_pb2.PutGroupStreamResponse:
        pieces = list(packed.chunks(payload))
        chunks = [buffer_pb2.PutGroupStreamRequest(group=metadata, payload=pieces[0])]
        chunks += [buffer_pb2.PutGroupStreamRequest(payload=piece) for piece in pieces[1:]]
        return await retry(
            lambda: self._stub.PutGroupStream(iter(chunks), timeout=30),
            what="PutGroupStream",
            budget_seconds=max_wait,
            codes=OVERLOADED | TRANSIENT,
        )

    async def _put_staged(
        self, plane: DataPlane | None, metadata: common_pb2.Group, payload: bytes | StagedPayload, max_wait: float
    ) -> buffer_pb2.PutGroupResponse:
        """PutGroup(metadata, key) of `payload`: bytes, staged here (again, if their key expired), or a
        StagedPayload the rollout staged, renewed here (without a plane, left to the buffer's take-over)."""
        staged = isinstance(payload, StagedPayload)
        key, size = (payload.key, payload.size) if staged else ("", len(payload))

        async def attempt() -> buffer_pb2.PutGroupResponse:
            nonlocal key
            try:
                if staged:
                    if plane is not None and not await plane.renew(key):
                        raise StagedPayloadGone(
                            f"group {metadata.group_id!r}: the payload staged for it ({key!r}) expired before "
                            "its put; raise DOCKYARD_BUFFER_STAGING_TTL_SECONDS above the time a group takes to score"
                        )
                elif not key or not await plane.renew(key):
                    key = await plane.stage(metadata, payload)
            except (RedisError, OSError) as exc:
                # The buffer's own store is down (restarting, unreachable): waited out like the buffer itself.
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details=f"the data plane's Redis: {type(exc).__name__}: {exc}",
                ) from None
            request = buffer_pb2.PutGroupRequest(group=metadata, payload_key=key, payload_bytes=size)
            return await self._stub.PutGroup(request, timeout=30)

        return await retry(attempt, what="PutGroup", budget_seconds=max_wait, codes=OVERLOADED | TRANSIENT)

    async def discard(self, staged: StagedPayload) -> None:
        """Delete a payload the rollout staged whose group will not be put; a Redis failure leaves it to expire."""
        if self._plane is None:
            return
        try:
            await self._plane.discard(staged.key)
        except (RedisError, OSError) as exc:
            log.warning("a staged payload is left to expire", key=staged.key, error=repr(exc))

    def sent(self) -> dict[str, int]:
        """A copy of the bytes sent so far by kind: metadata and payload to the buffer service, staged in the plane."""
        return dict(self.sent_bytes)

    @property
    def data_plane(self) -> DataPlane | None:
        """The data plane puts stage payloads in (None: they stream through the service); known after open()."""
        return self._plane

    async def stats(self) -> buffer_pb2.GetStatsResponse | None:
        """The buffer's counters of the job; None while the buffer is restarting."""
        try:
            return await self._stub.GetStats(buffer_pb2.GetStatsRequest(job_id=self.job_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in TRANSIENT:
                raise
            return None

    async def close(self) -> None:
        """CloseJob, then close_plane."""
        try:
            await self._stub.CloseJob(buffer_pb2.CloseJobRequest(job_id=self.job_id), timeout=10)
        finally:
            await self.close_plane()

    async def close_plane(self) -> None:
        """Release the data plane's connection; later puts stream through the service."""
        if self._plane is not None:
            await self._plane.close()
            self._plane = None
