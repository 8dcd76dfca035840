"""dockyard-coordinator: load the job store, serve CoordinatorService (settings from DOCKYARD_COORDINATOR_*)."""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.coordinator.settings import CoordinatorSettings


def main() -> None:
    from dockyard.redis_url import RedisConfigError

    try:
        settings = CoordinatorSettings()
    except RedisConfigError as exc:
        raise SystemExit(f"coordinator: {exc}") from None

    async def build():
        from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
        from services.coordinator.job_manager import StoreUnreadable
        from services.coordinator.servicer import CoordinatorServicer

        servicer = CoordinatorServicer(settings)
        # Stored jobs first: a GetJob answered before this would miss them.
        try:
            await servicer.recover()
        except StoreUnreadable as exc:
            raise SystemExit(f"coordinator: {exc}") from None
        service = Service(
            name="dockyard.coordinator.v1.CoordinatorService",
            servicer=servicer,
            add_to_server=coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
        )
        if not settings.dashboard_port:
            return [service], servicer.close
        dashboard = await start_dashboard(settings)

        async def close() -> None:
            dashboard.should_exit = True
            await servicer.close()

        return [service], close

    run_service("coordinator", settings, build)


async def start_dashboard(settings: CoordinatorSettings):
    """The dashboard on settings.dashboard_port: a client of this coordinator's own gRPC address."""
    from pathlib import Path

    from dockyard.rpc.auth import load_auth_settings
    from dockyard.rpc.ports import DEFAULT_PORTS
    from services.coordinator.dashboard import create_app, serve_dashboard

    port = settings.port or DEFAULT_PORTS["coordinator"]
    root = Path(settings.run_root) if settings.run_root else None

    def run_dir(folder: str) -> Path:
        path = Path(folder)
        return root / path if root is not None and not path.is_absolute() else path

    app = create_app(f"127.0.0.1:{port}", load_auth_settings().token, run_dir)
    return await serve_dashboard(app, settings.host, settings.dashboard_port)


if __name__ == "__main__":
    main()
