"""`dockyard-sandbox` / `python -m services.sandbox`: serve SandboxService until SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.sandbox.settings import SandboxSettings
from services.sandbox.work_folders import reap_dead_work_folders

log = structlog.get_logger()


async def make_backend(settings: SandboxSettings):
    """The configured backend; docker fails fast without its engine or image, local without namespaces."""
    if settings.backend == "docker":
        from docker.errors import DockerException

        from dockyard.launch_checks import docker_problem
        from services.sandbox.docker_backend import DockerBackend

        try:
            return await DockerBackend.open(
                image=settings.image,
                max_concurrency=settings.max_concurrency,
                cpus=settings.docker_cpus,
                pids_limit=settings.docker_pids_limit,
                max_file_mb=settings.max_file_mb,
                max_disk_mb=settings.max_disk_mb,
                tmp_mb=settings.docker_tmp_mb,
                user=settings.docker_user,
                work_root=settings.work_root,
                warm_max=settings.warm_sessions_max,
                warm_runs=settings.warm_runs,
                image_cache_gb=settings.image_cache_gb,
            )
        except DockerException as exc:  # no engine: one line that says what to do, not the client's traceback
            raise SystemExit(f"sandbox: {docker_problem(exc, any_job=True)}") from None
    from services.sandbox.local import LocalBackend

    return await LocalBackend.open(
        allow_unisolated=settings.allow_unisolated,
        max_concurrency=settings.max_concurrency,
        max_file_mb=settings.max_file_mb,
        max_disk_mb=settings.max_disk_mb,
        max_processes=settings.max_processes,
        work_root=settings.work_root,
        user=settings.local_user,
    )


def make_swe_scorer(settings: SandboxSettings, backend):
    """SWE scoring over `backend`; with docker, each instance runs in its repository's environment image."""
    from services.sandbox.swe import SweScorer, TaskSets

    image_for = None
    if settings.backend == "docker":
        import docker

        from services.sandbox.images import ensure_env_image

        client = docker.from_env(timeout=600)
        cache = backend.images  # what is pulled or built here is the image cache's (image_cache.py)

        def make(instance, mirror) -> str | None:
            # Built once per (repo, version, spec) or per requirement set (content-hashed tags), then reused;
            # a row's prebuilt image is pulled once, and fitted once.
            if instance.prebuilt is not None:
                from services.sandbox.swe_prebuilt import ensure_prebuilt

                pull = {"registry": settings.image_registry, "auth_file": settings.image_registry_auth_file}
                return ensure_prebuilt(client, instance.instance_id, instance.prebuilt, **pull, on_made=cache.added)
            if instance.recipe is not None:
                from services.sandbox.swe_images import ensure_swe_env_image

                return ensure_swe_env_image(client, settings.image, instance, mirror, on_build=cache.added)
            if not instance.requirements:
                return None
            return ensure_env_image(client, settings.image, list(instance.requirements), on_build=cache.added)

        async def image_for(instance, mirror):
            image = await asyncio.to_thread(make, instance, mirror)
            if image is not None:  # a use: the least recently used images go first
                await asyncio.to_thread(cache.touch, image)
            return image

    image_trees = None
    if image_for is not None:
        from services.sandbox.swe_image_trees import ImageTrees

        pull = {"registry": settings.image_registry, "auth_file": settings.image_registry_auth_file}
        image_trees = ImageTrees(client, settings.work_root, **pull)
    return SweScorer(
        backend,
        TaskSets(settings.task_root),
        log_cap_bytes=settings.max_output_bytes,
        checkout_root=settings.work_root,
        image_for=image_for,
        image_trees=image_trees,
    )


def make_terminal_tasks(settings: SandboxSettings, backend):
    """Terminal task sets under the task root; with docker, each task runs in its own image (built offline)."""
    from services.sandbox.terminal import TerminalTasks

    images = None
    if settings.backend == "docker":
        import tempfile

        import docker

        from services.sandbox.terminal_images import TerminalImages

        seeds = Path(settings.work_root or tempfile.gettempdir()) / "dockyard-terminal-seeds"
        seeds.mkdir(parents=True, exist_ok=True)
        images = TerminalImages(docker.from_env(timeout=600), settings.image, seeds, cache=backend.images)
    return TerminalTasks(settings.task_root, images)


def main() -> None:
    settings = SandboxSettings()

    async def build():
        from dockyard.api.sandbox.v1 import sandbox_pb2_grpc
        from dockyard.rpc.membership import membership_for
        from services.sandbox.servicer import SandboxServicer

        backend = await make_backend(settings)
        reaped = await asyncio.to_thread(backend.reap_sessions)
        log.info("removed the sessions of a previous run", count=reaped, backend=settings.backend)
        folders = await asyncio.to_thread(reap_dead_work_folders, settings.work_root)
        log.info("removed the work folders of a previous run", count=folders, backend=settings.backend)
        servicer = SandboxServicer(
            backend, settings, swe=make_swe_scorer(settings, backend), terminal=make_terminal_tasks(settings, backend)
        )
        servicer.start()
        service = Service(
            name="dockyard.sandbox.v1.SandboxService",
            servicer=servicer,
            add_to_server=sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
        )

        membership = membership_for(settings, "sandbox", settings.name, servicer.load)
        if membership is not None:
            membership.start()

        async def close() -> None:
            try:
                if membership is not None:
                    await membership.stop()
                await servicer.close_sessions()
                await backend.close()
            finally:  # whatever failed above, the checkout cache under the work root goes
                servicer.close()

        return [service], close

    run_service("sandbox", settings, build)


if __name__ == "__main__":
    main()
