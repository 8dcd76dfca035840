"""`dockyard-sandbox` / `python -m services.sandbox`: serve SandboxService until SIGTERM."""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.sandbox.settings import SandboxSettings


def main() -> None:
    settings = SandboxSettings()

    async def build():
        from dockyard.sandbox.v1 import sandbox_pb2_grpc
        from services.sandbox.local import LocalBackend
        from services.sandbox.servicer import SandboxServicer

        backend = LocalBackend(
            max_concurrency=settings.max_concurrency,
            max_file_mb=settings.max_file_mb,
            max_processes=settings.max_processes,
            work_root=settings.work_root,
        )
        servicer = SandboxServicer(backend, settings)
        service = Service(
            name="dockyard.sandbox.v1.SandboxService",
            servicer=servicer,
            add_to_server=sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
        )

        async def close() -> None:
            await backend.close()
            servicer.close()

        return [service], close

    run_service("sandbox", settings, build)


if __name__ == "__main__":
    main()
