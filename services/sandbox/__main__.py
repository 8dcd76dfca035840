"""`dockyard-sandbox` / `python -m services.sandbox`: serve SandboxService until SIGTERM."""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.sandbox.settings import SandboxSettings


async def make_backend(settings: SandboxSettings):
    """The configured backend; the docker one fails fast when the engine or the image is missing."""
    if settings.backend == "docker":
        from services.sandbox.docker_backend import DockerBackend

        return await DockerBackend.open(
            image=settings.image,
            max_concurrency=settings.max_concurrency,
            cpus=settings.docker_cpus,
            pids_limit=settings.docker_pids_limit,
            max_file_mb=settings.max_file_mb,
            tmp_mb=settings.docker_tmp_mb,
            user=settings.docker_user,
            work_root=settings.work_root,
        )
    from services.sandbox.local import LocalBackend

    return LocalBackend(
        max_concurrency=settings.max_concurrency,
        max_file_mb=settings.max_file_mb,
        max_processes=settings.max_processes,
        work_root=settings.work_root,
    )


def main() -> None:
    settings = SandboxSettings()

    async def build():
        from dockyard.sandbox.v1 import sandbox_pb2_grpc
        from services.sandbox.servicer import SandboxServicer

        backend = await make_backend(settings)
        service = Service(
            name="dockyard.sandbox.v1.SandboxService",
            servicer=SandboxServicer(backend, settings),
            add_to_server=sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
        )
        return [service], backend.close

    run_service("sandbox", settings, build)


if __name__ == "__main__":
    main()
