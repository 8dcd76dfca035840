"""Rank 0's weight push of one job: its synchronizer, and the bridge from the gathering thread to the loop.

    PushWeights ─> WeightPush.sender(version) ─> ranks "weights": every rank gathers named_weights()
        rank 0's worker thread: send(weights) ─run_coroutine_threadsafe─> sync_weights on the event
        loop ─> the job's transport (transport_for: weight-sync group, whole tensors to SGLang replicas,
        or checkpoint folder) ─> rollout replicas

Guarantees: one WeightSynchronizer per job, made on the job's first push and
closed with the job; every push marks its version stale first, so the sync
moves it; `send` blocks the worker thread until the sync on the loop has
ended, so the gathers feed the transport as it sends and a failed sync
(WeightSyncFailed) reaches the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.config import MasterConfig
from dockyard.weights.group import SyncReport
from dockyard.weights.group_source import coordinator_group_source, transport_for
from dockyard.weights.synchronizer import WeightSynchronizer
from services.trainer.policy import Weights


class WeightPush:
    def __init__(
        self,
        config: MasterConfig,
        job_id: str,
        device: str,
        coordinator: coordinator_pb2_grpc.CoordinatorServiceStub,
        timeout: timedelta,
    ) -> None:
        self._config, self._job_id, self._device = config, job_id, device
        self._coordinator, self._timeout = coordinator, timeout
        self.sync: WeightSynchronizer | None = None

    def sender(self, version: int, loop: asyncio.AbstractEventLoop) -> Callable[[Weights], SyncReport]:
        """What rank 0's "weights" command hands the gathered weights of `version` to."""
        if self.sync is None:
            self.sync = WeightSynchronizer(
                transport_for(self._config, self._job_id, self._timeout, self._device),
                coordinator_group_source(self._coordinator, self._job_id, "trainer"),
            )
        sync = self.sync
        sync.mark_stale(version)

        def send(weights: Weights) -> SyncReport:
            return asyncio.run_coroutine_threadsafe(sync.sync_weights(weights, version), loop).result()

        return send

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
