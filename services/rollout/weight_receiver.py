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
  left its group; a coordinator that does not answer within 5 s is not waited for.

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


class WeightReceiver:
    """Each job's WeightSynchronizer, formed at the job's first sync; the coordinator channel they share."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.timeout = timedelta(seconds=settings.weight_sync_timeout_seconds)
        self._syncs: dict[str, WeightSynchronizer] = {}
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

            return await sync.sync_weights(load, version)

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
