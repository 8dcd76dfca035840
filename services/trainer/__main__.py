"""dockyard-trainer: serve TrainerService (settings from DOCKYARD_TRAINER_*).

Under torchrun (WORLD_SIZE > 1) every rank joins the default process group
(nccl on cuda, gloo on cpu); rank 0 serves gRPC and drives the others, which
follow its commands until it stops.
"""

from __future__ import annotations

import os

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = TrainerSettings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch
        import torch.distributed as dist

        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        if settings.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if settings.device == "cuda" else "gloo")
        if dist.get_rank() != 0:
            from services.trainer.ranks import follow

            try:
                follow(settings.device)
            finally:
                dist.destroy_process_group()
            return

    async def build():
        import torch

        from dockyard.api.trainer.v1 import trainer_pb2_grpc
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
