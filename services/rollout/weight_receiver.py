"""The replica's side of the weight sync: one WeightSynchronizer per job, one sync at a time.

    receive(job_id, engine, cfg, version)
        ──first time for the job: transport_for(cfg) + the coordinator's group source──> WeightSynchronizer
        ──mark_stale(version), sync_weights──> engine.receive_weights(transport, version, group, timeout)
        ──> SyncReport (checksum, bytes, seconds), or WeightSyncFailed
    forget(job_id) ──close the job's synchronizer──> LeaveWeightSyncGroup (best effort)

Guarantees:
- one sync at a time on this replica (a lock held for the whole transfer), and
  every wait inside it bounded by the replica's weight_sync_timeout_seconds;
- a failed sync raises WeightSyncFailed with its cause; the synchronizer has then
  torn the group down, and the next receive forms the coordinator's next epoch;
- a forgotten job's synchronizer is closed and the coordinator told the replica
  left its group; a coordinator that does not answer within 5 s is not waited for;
- a failed receive may have written part of the tensors in place: from then on
  `check` raises WeightsTorn for the job until a receive succeeds, and a generation
  that a failed receive overlapped (in-flight updates) is refused at its end, so no
  token sampled from part-old, part-new weights leaves the replica under a version.

Imports: dockyard.weights (synchronizer, group_source), the coordinator's stubs,
dockyard.rpc.client; never an engine module (engines come in as arguments).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import MasterConfig
from dockyard.rpc.client import connect
from dockyard.weights.group import SyncReport
from dockyard.weights.group_source import coordinator_group_source, transport_for
from dockyard.weights.synchronizer import WeightSynchronizer
from services.rollout.engine import GenerationEngine
from services.rollout.settings import RolloutSettings

LEAVE_TIMEOUT_SECONDS = 5.0


class WeightsTorn(Exception):
    """The job's weights may be part old, part new: its last weight receive failed."""


class WeightReceiver:
    """Each job's WeightSynchronizer, formed at the job's first sync; the coordinator channel they share."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.timeout = timedelta(seconds=settings.weight_sync_timeout_seconds)
        self._syncs: dict[str, WeightSynchronizer] = {}
        self._torn: dict[str, str] = {}  # job -> why its weights may be mixed, until a receive succeeds
        self._failed: dict[str, int] = {}  # job -> receives failed so far
        self._sync_lock = asyncio.Lock()
        self._coordinator_channel = connect(
            settings.coordinator_address,
            service="dockyard.coordinator.v1.CoordinatorService",
            max_message_mb=settings.max_message_mb,
        )
        self.coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(self._coordinator_channel)

    async def receive(self, job_id: str, engine: GenerationEngine, cfg: MasterConfig, version: int) -> SyncReport:
        """Load the weights of `version` into `engine`; WeightSyncFailed (the cause in its message) on failure."""
        timeout = self.timeout
        async with self._sync_lock:
            sync = self._synchronizer(job_id, cfg)
            sync.mark_stale(version)

            async def load(transport, version, group):
                return await engine.receive_weights(transport, version, group, timeout)

            try:
                report = await sync.sync_weights(load, version)
            except BaseException as exc:
                self._failed[job_id] = self._failed.get(job_id, 0) + 1
                self._torn[job_id] = (
                    f"the receive of weight version {version} failed and may have replaced part of the weights "
                    f"({exc}); this replica generates for the job again once a ReceiveWeights succeeds"
                )
                raise
            self._torn.pop(job_id, None)
            return report

    def check(self, job_id: str, since: int | None = None) -> int:
        """The job's count of failed receives, for a later `check(job_id, since=count)` when a generation
        ends; WeightsTorn while the last receive failed, or when one failed since `since`."""
        if (why := self._torn.get(job_id)) is not None:
            raise WeightsTorn(why)
        failed = self._failed.get(job_id, 0)
        if since is not None and failed != since:
            raise WeightsTorn("a weight receive failed while this generation ran: its tokens may be of mixed weights")
        return failed

    def _synchronizer(self, job_id: str, cfg: MasterConfig) -> WeightSynchronizer:
        sync = self._syncs.get(job_id)
        if sync is None:
            sync = self._syncs[job_id] = WeightSynchronizer(
                transport_for(cfg, job_id, self.timeout, self.settings.device),
                coordinator_group_source(self.coordinator, job_id, self.settings.replica_name),
            )
        return sync

    async def forget(self, job_id: str) -> None:
        """Close the job's synchronizer, if it has one, and leave its group (best effort)."""
        self._torn.pop(job_id, None)
        self._failed.pop(job_id, None)
        if (sync := self._syncs.pop(job_id, None)) is not None:
            sync.close()
            await self._leave(job_id)

    async def _leave(self, job_id: str) -> None:
        """Best effort: the coordinator forms the job's group again without this replica."""
        with contextlib.suppress(Exception):
            await self.coordinator.LeaveWeightSyncGroup(
                coordinator_pb2.LeaveWeightSyncGroupRequest(job_id=job_id, member=self.settings.replica_name),
                timeout=LEAVE_TIMEOUT_SECONDS,
            )

    async def close(self) -> None:
        """Close every synchronizer and the coordinator channel (no group is left: the replica is going away)."""
        for sync in self._syncs.values():
            sync.close()
        self._syncs.clear()
        await self._coordinator_channel.close()
