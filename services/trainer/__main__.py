"""dockyard-trainer: serve TrainerService (settings from DOCKYARD_TRAINER_*)."""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = TrainerSettings()

    async def build():
        import torch

        from dockyard.trainer.v1 import trainer_pb2_grpc
        from services.trainer.servicer import TrainerServicer

        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        servicer = TrainerServicer(settings)
        service = Service(
            name="dockyard.trainer.v1.TrainerService",
            servicer=servicer,
            add_to_server=trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
        )
        return [service], servicer.close

    run_service("trainer", settings, build)


if __name__ == "__main__":
    main()
