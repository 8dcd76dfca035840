"""The interface every weight transport keeps; the transports themselves are transports.py and colocated.py.

    trainer: Transport.send(tensors, version, group) ──> every replica
    replica: Transport.receive(sink, version, group) ──> the engine's tensors (through refit_plan)

Guarantees every implementation keeps: both calls block until the version has moved or
raise SyncFailed (bounded by the transport's timeout), and `receive_on_loop` keeps `receive`'s
guarantees without ever blocking its event loop on a peer; `spec()` is plain values that
`transports.transport_from_spec` turns back into an equal transport in another process.

Imports: dockyard.weights.collective (TensorSink) and group (SyncReport, WeightSyncGroup) only, so that
every transport module can build on this one without importing another transport.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable

import torch

from dockyard.weights.collective import TensorSink
from dockyard.weights.group import SyncReport, WeightSyncGroup


class Transport(abc.ABC):
    name: str = "transport"
    needs_group: bool = False

    @abc.abstractmethod
    def send(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, group: WeightSyncGroup | None = None
    ) -> SyncReport:
        """Trainer: make `tensors` (weights of `version`) available to every replica (blocking)."""

    @abc.abstractmethod
    def receive(self, sink: TensorSink, version: int, group: WeightSyncGroup | None = None) -> SyncReport:
        """Replica: load the weights of `version` into `sink` (blocking)."""

    async def receive_on_loop(self, sink: TensorSink, version: int, group: WeightSyncGroup | None = None) -> SyncReport:
        """`receive` for a caller on an event loop: in a worker thread, unless the transport can load the
        version on the loop without blocking it (colocated.py's repeats, which the thread's hops would slow)."""
        return await asyncio.to_thread(self.receive, sink, version, group)

    def reset(self) -> None:
        """Forget any state a failure left behind."""

    def close(self) -> None:
        self.reset()

    @abc.abstractmethod
    def spec(self) -> dict:
        """Plain values that rebuild an equal transport elsewhere (an engine's worker process)."""
