"""Entry point of the buffer service: `dockyard-buffer` or `python -m services.buffer`.

Settings come from DOCKYARD_BUFFER_* variables; the servicer and backend are
imported inside `build`, so a bad setting fails before anything heavy loads.
"""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.buffer.settings import BufferSettings


def main() -> None:
    settings = BufferSettings()

    async def build():
        from dockyard.buffer.v1 import buffer_pb2_grpc
        from services.buffer.memory import MemoryBuffer
        from services.buffer.servicer import BufferServicer

        # settings.backend is a Literal, so "memory" is the only value that gets here.
        backend = MemoryBuffer(max_groups=settings.max_groups)
        service = Service(
            name="dockyard.buffer.v1.BufferService",
            servicer=BufferServicer(backend),
            add_to_server=buffer_pb2_grpc.add_BufferServiceServicer_to_server,
        )
        return [service], backend.close

    run_service("buffer", settings, build)


if __name__ == "__main__":
    main()
