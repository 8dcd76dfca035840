"""WeightSynchronizer: the small state machine around a transport, and recovery after a failed sync.

    optimizer step ──mark_stale(v)──> stale ──sync_weights()──> fresh (version v)
                                        │ failure: transport reset, coordinator told the
                                        │ epoch failed (it forms the next one), still stale,
                                        └ WeightSyncFailed raised ──> the next sync_weights() retries

    replica side: before generating, if is_stale: sync_weights(sink) then engine.prepare_for_generation()

Guarantees: a sync either completes (the version is recorded, no longer
stale) or raises WeightSyncFailed with the cause within the transport's
timeout; after a failure the weight-sync group has been torn down and the
coordinator has moved to a new epoch, so the next sync forms a fresh group
instead of waiting on a dead one. Blocking transport work runs in a worker
thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from dockyard.weights.collective import TensorSink
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.refit import RefitError
from dockyard.weights.transport import Transport

log = structlog.get_logger()

# Called with None for the member's current weight-sync group, or with the epoch that just
# failed so that the coordinator forms the next one.
GroupSource = Callable[[int | None], Awaitable[WeightSyncGroup]]


class WeightSyncFailed(RuntimeError):
    """A sync did not complete; the message says why and what happens next."""


class WeightSynchronizer:
    def __init__(self, transport: Transport, groups: GroupSource | None = None) -> None:
        if transport.needs_group and groups is None:
            raise ValueError(f"the {transport.name} transport needs a weight-sync group source")
        self.transport = transport
        self.groups = groups
        self.version = 0  # version the other side holds after the last completed sync
        self.target = 0  # version to sync next
        self._stale = True  # nothing has been synced yet
        self.failures = 0

    def mark_stale(self, version: int) -> None:
        """The weights changed (an optimizer step made `version`): the next sync moves them."""
        self.target = version
        self._stale = True

    @property
    def is_stale(self) -> bool:
        return self._stale

    async def sync_weights(self, payload, version: int | None = None) -> SyncReport:
        """Move the weights of `version`.

        `payload` is what to send (named tensors), where to receive (a
        TensorSink), or an engine's own loader: an async callable
        (transport, version, weight-sync group) -> SyncReport.
        """
        version = self.target if version is None else version
        group = await self.groups(None) if self.transport.needs_group else None  # type: ignore[misc]
        try:
            if isinstance(payload, TensorSink):
                report = await asyncio.to_thread(self.transport.receive, payload, version, group)
            elif callable(payload):
                report = await payload(self.transport, version, group)
            else:
                report = await asyncio.to_thread(self.transport.send, payload, version, group)
        except (SyncFailed, RefitError, OSError) as exc:
            self.failures += 1
            await asyncio.to_thread(self.transport.reset)
            next_epoch = ""
            if group is not None:
                try:
                    fresh = await self.groups(group.epoch)  # type: ignore[misc]
                    next_epoch = f"; the weight-sync group is formed again as epoch {fresh.epoch} at the next sync"
                except Exception as report_exc:  # noqa: BLE001 - the coordinator may be gone too
                    next_epoch = f"; reporting the failed epoch to the coordinator failed too: {report_exc}"
            log.warning("weight sync failed", version=version, error=str(exc))
            raise WeightSyncFailed(f"weight sync of version {version} failed: {exc}{next_epoch}") from exc
        self.version = version
        if version >= self.target:
            self._stale = False
        return report

    def close(self) -> None:
        self.transport.close()
