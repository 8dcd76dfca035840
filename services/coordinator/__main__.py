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
        from services.coordinator.servicer import CoordinatorServicer, StoreUnreadable

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
        return [service], servicer.close

    run_service("coordinator", settings, build)


if __name__ == "__main__":
    main()
