"""One job's side of the buffer's lease protocol: lease groups, check them against the ledger, ack them.

    first:   TakeTrainerLease ─> this trainer's lease id, on every ack, sample and reclaim (a predecessor's is void)
    lease:   reclaim due (fresh start, or the last lease failed)? ─yes─> ReclaimGroupsStream (any idle time)
                 ─> ledger names the group? ─yes─> ack it (trained already, its ack was lost)
                                            └no──> this step's groups
             fewer than wanted ─> SampleGroupsStream for the rest
             each group arrives as stored: its metadata, then its packed payload (dockyard/experience/payload.py);
             with a data plane (asked once, GetDataPlane), its payload key, and every payload of the lease
             is read from Redis by one MGET (dockyard/experience/data_plane.py)
    trained: ledger.record (fsynced) ─> ack until it lands (a store outage is waited out, with backoff)
    ack:     AckGroups(these + every earlier unacked) ─transient failure─> kept in `unacked`,
             sent with the next ack (a refused batch, reclaimed groups the ledger names)

Guarantees: a fresh consumer reclaims before it samples, so the groups a dead
predecessor left pending are trained first; so does the next lease after a
failed one, because what the failed call leased stays pending and nothing is
lost. A reclaimed group the ledger names is acked, never returned to train
again. `trained` returns only once the ledger line is on disk, and acks
after it, so a deferred or lost ack can never cause a second training. The
ack of a trained step is retried (CALLER_BACKOFF, each failure logged "ack
deferred") until it lands, for as long as the job lives (`stop` ends the
wait with Unavailable): `trained` returns only once the buffer's clock stands at
the step's weight version, so no version reaches the coordinator, the rollouts
or a put before the buffer has it (a buffer or Redis outage during training,
acking or the weight sync never leaves the clock behind the trainer). Acks are
idempotent: acking acked groups again at the same version is a no-op that
succeeds, so a retry of an ack whose reply was lost is harmless. Any other ack
that fails with a TRANSIENT code is kept and resent with the next ack; any
other failure is raised. `lease` raises FailedPrecondition when the
buffer refuses (no such job) or holds nothing fresh, Unavailable when it
cannot be reached, a stream ends before its last chunk, or a payload cannot
be read from the data plane (what it leased stays pending and is reclaimed
next).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from redis.exceptions import RedisError

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.experience.data_plane import DataPlane, PayloadGone
from dockyard.rpc.errors import FailedPrecondition, Unavailable
from dockyard.rpc.retry import CALLER_BACKOFF, TRANSIENT
from services.trainer.ledger import TrainedLedger

log = structlog.get_logger()


@dataclass
class LeasedGroup:
    """A sampled group as the buffer stored it: metadata, and the packed token arrays (empty: in the metadata)."""

    group: common_pb2.Group
    payload: bytes = b""
    payload_key: str = ""  # sampled by reference: where the payload is in the data plane, until it is read

    @property
    def group_id(self) -> str:
        return self.group.group_id


class _Truncated(Exception):
    """A streamed sample ended before its last chunk."""


async def read_stream(call) -> tuple[list[LeasedGroup], int]:
    """The groups of a SampleGroupsStream or ReclaimGroupsStream call, and its dropped_stale count."""
    groups: list[LeasedGroup] = []
    pieces: list[bytes] = []

    def finish() -> None:
        if groups:
            groups[-1].payload = b"".join(pieces)

    async for chunk in call:
        if chunk.group or chunk.done:
            finish()
            if chunk.done:
                return groups, chunk.dropped_stale
            groups.append(LeasedGroup(common_pb2.Group.FromString(chunk.group), payload_key=chunk.payload_key))
            pieces = []
        pieces.append(chunk.payload)
    raise _Truncated(f"the buffer's stream ended after {len(groups)} group(s), before its last chunk")


@dataclass
class Lease:
    groups: list[LeasedGroup]
    dropped_stale: int  # groups the buffer dropped as too old while answering
    reclaimed: int  # of `groups`, those taken over from a predecessor

    def metrics(self) -> dict[str, float]:
        return {"groups_dropped_stale": float(self.dropped_stale), "groups_reclaimed": float(self.reclaimed)}


class BufferConsumer:
    """Leases and acks one job's groups under the name `consumer`; `buffer` is a BufferService stub."""

    def __init__(
        self,
        buffer: buffer_pb2_grpc.BufferServiceStub,
        consumer: str,
        job_id: str,
        ledger: TrainedLedger,
        ack_timeout: float,
    ) -> None:
        self.buffer = buffer
        self.consumer = consumer
        self.job_id = job_id
        self.ledger = ledger
        self.ack_timeout = ack_timeout
        self.reclaim_due = True
        self.unacked: list[str] = []  # trained (or refused) groups whose ack has not reached the buffer
        self.plane: DataPlane | None = None
        self._plane_asked = False
        self._stopped = asyncio.Event()  # set when the job goes: an ack waiting out an outage gives up
        self.lease_id = ""  # the job's trainer lease (TakeTrainerLease), taken by the first lease()

    async def lease(self, trainer_step: int, wanted: int) -> Lease:
        """Up to `wanted` groups for the step after `trainer_step`: reclaimed ones first, then fresh.

        Acks deferred while the buffer was down are sent first.
        """
        await self.ack([], trainer_step)
        try:
            await self._take_lease()
            if not self._plane_asked:
                self.plane = await DataPlane.discover(self.buffer)
                self._plane_asked = True
            lease = await self._reclaim(trainer_step, wanted) if self.reclaim_due else Lease([], 0, 0)
            if len(lease.groups) < wanted:
                groups, dropped = await read_stream(
                    self.buffer.SampleGroupsStream(
                        buffer_pb2.SampleGroupsStreamRequest(
                            job_id=self.job_id,
                            trainer_step=trainer_step,
                            max_groups=wanted - len(lease.groups),
                            consumer=self.consumer,
                            payload_by_reference=self.plane is not None,
                            lease_id=self.lease_id,
                        )
                    )
                )
                lease.groups += groups
                lease.dropped_stale += dropped
            await self._read_payloads(lease.groups)
        except _Truncated as exc:
            self.reclaim_due = True
            raise Unavailable(f"the buffer is unavailable: {exc}") from None
        except (PayloadGone, RedisError, OSError) as exc:
            self.reclaim_due = True
            raise Unavailable(f"the data plane is unavailable: {type(exc).__name__}: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            # What was leased stays pending and is reclaimed by the next call: nothing is lost.
            self.reclaim_due = True
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise FailedPrecondition(f"the buffer refused to sample: {exc.details()}") from None
            raise Unavailable(f"the buffer is unavailable: {exc.code().name}: {exc.details()}") from None
        if not lease.groups:
            raise FailedPrecondition(
                f"the buffer holds no fresh groups for step {trainer_step + 1} "
                f"({lease.dropped_stale} dropped as stale); put experience first"
            )
        return lease

    async def _take_lease(self) -> None:
        """Become the job's trainer once: every ack carries the lease id the buffer issues."""
        if not self.lease_id:
            reply = await self.buffer.TakeTrainerLease(
                buffer_pb2.TakeTrainerLeaseRequest(job_id=self.job_id, consumer=self.consumer),
                timeout=self.ack_timeout,
            )
            self.lease_id = reply.lease_id
            log.info("trainer lease taken", consumer=self.consumer)

    async def _reclaim(self, trainer_step: int, wanted: int) -> Lease:
        reclaimed, dropped = await read_stream(
            self.buffer.ReclaimGroupsStream(
                buffer_pb2.ReclaimGroupsStreamRequest(
                    job_id=self.job_id,
                    trainer_step=trainer_step,
                    max_groups=wanted,
                    consumer=self.consumer,
                    min_idle_seconds=0.0,
                    payload_by_reference=self.plane is not None,
                    lease_id=self.lease_id,
                )
            )
        )
        done = [g.group_id for g in reclaimed if g.group_id in self.ledger]
        groups = [g for g in reclaimed if g.group_id not in self.ledger]
        if done:
            log.warning("acking reclaimed groups the ledger says were trained", groups=len(done))
            await self.ack(done, trainer_step)
        self.reclaim_due = False
        if groups:
            log.info("reclaimed pending groups", groups=len(groups))
        return Lease(groups, dropped, len(groups))

    async def _read_payloads(self, groups: list[LeasedGroup]) -> None:
        """Fill in the payloads of groups sampled by reference, from the data plane, by one MGET."""
        wanted = [g for g in groups if g.payload_key]
        if wanted:
            assert self.plane is not None  # only a consumer with a data plane samples by reference
            for group, data in zip(wanted, await self.plane.read([g.payload_key for g in wanted]), strict=True):
                group.payload = data

    def stop(self) -> None:
        """The job is going: an ack waiting for the buffer gives up (Unavailable) instead of waiting on."""
        self._stopped.set()

    async def close(self) -> None:
        """Release the data plane's connection."""
        if self.plane is not None:
            await self.plane.close()
            self.plane = None

    async def trained(
        self, step: int, weight_version: int, group_ids: Sequence[str], trajectory_ids: Sequence[str]
    ) -> None:
        """Record the step's groups in the ledger, then ack them at the new `weight_version`."""
        # On disk before the ack: a trainer that dies in between finds these in its ledger
        # when it reclaims them, and acks them instead of training on them again.
        await asyncio.to_thread(self.ledger.record, step, weight_version, group_ids, trajectory_ids)
        await self.ack(group_ids, weight_version, until_landed=True)

    async def ack(self, group_ids: Sequence[str], weight_version: int, *, until_landed: bool = False) -> None:
        """Ack these and any earlier unacked groups. If the buffer is down: with `until_landed`, retried with
        backoff until it lands or the job stops (Unavailable); else they wait for the next call."""
        self.unacked += group_ids
        attempt = 0
        while self.unacked:
            try:
                await self._take_lease()
                await self.buffer.AckGroups(
                    buffer_pb2.AckGroupsRequest(
                        job_id=self.job_id,
                        group_ids=self.unacked,
                        weight_version=weight_version,
                        lease_id=self.lease_id,
                    ),
                    timeout=self.ack_timeout,
                )
                if attempt:
                    log.info("deferred ack landed", groups=len(self.unacked), attempts=attempt + 1)
                self.unacked = []
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in TRANSIENT:
                    raise
                attempt += 1
                # Safe to defer: the ledger already names the trained ones, so a reclaim never retrains them.
                delay = CALLER_BACKOFF.delay(attempt)
                log.warning(
                    "ack deferred: the buffer is unavailable",
                    groups=len(self.unacked),
                    weight_version=weight_version,
                    attempt=attempt,
                    retry_in=delay if until_landed else None,
                    error=exc.details(),
                )
                if not until_landed:
                    return
                await self._wait(delay)

    async def _wait(self, seconds: float) -> None:
        """Sleep before the next attempt; Unavailable if the job stops meanwhile."""
        try:
            await asyncio.wait_for(self._stopped.wait(), seconds)
        except TimeoutError:
            return
        raise Unavailable(
            f"job {self.job_id!r} stopped while the ack of {len(self.unacked)} group(s) waited for the buffer"
        )
