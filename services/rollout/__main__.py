"""Entry point of the rollout service: `dockyard-rollout` or `python -m services.rollout`.

Settings come from DOCKYARD_ROLLOUT_* variables; torch and transformers are
imported inside `build`, so a bad setting fails before anything heavy loads.
"""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.rollout.settings import RolloutSettings


def main() -> None:
    settings = RolloutSettings()

    async def build():
        import torch

        from dockyard.api.rollout.v1 import rollout_pb2_grpc
        from dockyard.rpc.membership import membership_for
        from services.rollout.servicer import RolloutServicer

        if settings.num_threads is not None:
            torch.set_num_threads(settings.num_threads)
        servicer = RolloutServicer(settings)
        service = Service(
            name="dockyard.rollout.v1.RolloutService",
            servicer=servicer,
            add_to_server=rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
            on_drain=servicer.drain,
        )
        membership = membership_for(
            settings,
            "rollout",
            settings.replica_name,
            lambda: (servicer.in_flight, servicer.in_flight, 0),
            pressure=servicer.kv_pressure,
        )
        if membership is not None:
            membership.start()

        async def close() -> None:
            if membership is not None:
                await membership.stop()
            await servicer.close()

        return [service], close

    run_service("rollout", settings, build)


if __name__ == "__main__":
    main()
