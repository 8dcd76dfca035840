"""One job's calls to the buffer service: open (and rewind), the clock, puts, stats, close.

    runner/recovery ─open(rewind_to)─> OpenJob      collector ─put(group)─> PutGroup (waited out while full or down)
    recovery ─set_clock(v)─> AckGroups(no ids)      producer, metrics ─stats()─> GetStats (None while restarting)

Guarantees: `open` and `set_clock` wait out a buffer that is down (UNAVAILABLE, DEADLINE_EXCEEDED)
for up to `recovery_timeout` seconds. `put` is the one place a PutGroup is retried
(dockyard.rpc.retry lists it as CALLER_RETRIED, so the channel does not retry it too): a full buffer
(RESOURCE_EXHAUSTED) and an unreachable one (UNAVAILABLE, DEADLINE_EXCEEDED) are waited out with
backoff up to `max_wait` seconds, which is safe because a put is idempotent by group id; any other
error is raised at once. `stats` never raises for a buffer that is restarting: it answers None.
"""

from __future__ import annotations

import grpc

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.retry import OVERLOADED, TRANSIENT, retry

# How long a put waits for a full or unreachable buffer before the error fails the job.
PUT_MAX_WAIT_SECONDS = 600.0


class JobBuffer:
    def __init__(
        self,
        stub: buffer_pb2_grpc.BufferServiceStub,
        job_id: str,
        *,
        max_groups: int = 0,
        max_age_steps: int = 0,
        recovery_timeout: float = 300.0,
    ) -> None:
        self._stub = stub
        self.job_id = job_id
        self._max_groups, self._max_age_steps = max_groups, max_age_steps
        self._recovery_timeout = recovery_timeout  # how long open and set_clock wait out a buffer that is down

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

    async def set_clock(self, version: int) -> None:
        """The buffer's clock (age bound, puts from the future) at `version`: an ack of nothing."""
        request = buffer_pb2.AckGroupsRequest(job_id=self.job_id, weight_version=version)
        await retry(
            lambda: self._stub.AckGroups(request, timeout=10), what="AckGroups", budget_seconds=self._recovery_timeout
        )

    async def put(self, group: common_pb2.Group, max_wait: float = PUT_MAX_WAIT_SECONDS) -> buffer_pb2.PutGroupResponse:
        """PutGroup, waiting with exponential backoff while the buffer is full or unreachable."""
        request = buffer_pb2.PutGroupRequest(group=group)
        return await retry(
            lambda: self._stub.PutGroup(request, timeout=30),
            what="PutGroup",
            budget_seconds=max_wait,
            codes=OVERLOADED | TRANSIENT,
        )

    async def stats(self) -> buffer_pb2.GetStatsResponse | None:
        """The buffer's counters of the job; None while the buffer is restarting."""
        try:
            return await self._stub.GetStats(buffer_pb2.GetStatsRequest(job_id=self.job_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in TRANSIENT:
                raise
            return None

    async def close(self) -> None:
        await self._stub.CloseJob(buffer_pb2.CloseJobRequest(job_id=self.job_id), timeout=10)
