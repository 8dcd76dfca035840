"""The coordinator's fixed peers, the trainer and the buffer: one channel each for the process's life.

    Peers(settings) ─stubs(fleet)─> runner.Stubs (trainer, buffer, the fleet) for every job's runner
                    ─health()─────> [(name, address, SERVING | NOT_SERVING | UNREACHABLE ...)] for GetJob

Guarantees: `health` asks over the coordinator's own channels, never a new connection per call
(clients poll GetJob), and answers within about a second per peer; `close` closes both channels.

Imports: the library's rpc client and the generated stubs, and runner.Stubs.
"""

from __future__ import annotations

import asyncio

from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2_grpc
from dockyard.rpc.client import channel_health, connect
from services.coordinator.fleet import Fleet
from services.coordinator.runner import Stubs
from services.coordinator.settings import CoordinatorSettings

NAMES = ("trainer", "buffer")


class Peers:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self._addresses = {name: getattr(settings, f"{name}_address") for name in NAMES}
        self._channels = {
            name: connect(
                address,
                service=f"dockyard.{name}.v1.{name.capitalize()}Service",
                max_message_mb=settings.max_message_mb,
            )
            for name, address in self._addresses.items()
        }

    def stubs(self, fleet: Fleet) -> Stubs:
        return Stubs(
            trainer=trainer_pb2_grpc.TrainerServiceStub(self._channels["trainer"]),
            buffer=buffer_pb2_grpc.BufferServiceStub(self._channels["buffer"]),
            fleet=fleet,
        )

    async def health(self) -> list[tuple[str, str, str]]:
        """(name, address, health status) of each peer, in NAMES order."""
        statuses = await asyncio.gather(*(channel_health(self._channels[n], timeout=1.0) for n in NAMES))
        return [(n, self._addresses[n], s) for n, s in zip(NAMES, statuses, strict=True)]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
