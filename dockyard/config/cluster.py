"""The `cluster` section: the device a job runs on and how weights reach the rollout.

Guarantees: a service deployed on another device than `cluster.device` refuses the job with a
message saying which setting to change (`device_mismatch`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import Section


class ClusterConfig(Section):
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Device the job's trainer and rollout run on: `dockyard run` deploys them there "
        "(DOCKYARD_TRAINER_DEVICE / DOCKYARD_ROLLOUT_DEVICE unless set), and a service deployed elsewhere "
        "refuses the job at LoadPolicy; nccl needs cuda.",
    )
    weight_sync_transport: Literal["collective", "checkpoint", "colocated"] = Field(
        "collective",
        description="How weights reach rollout replicas: the torch.distributed weight-sync group, safetensors "
        "files in a folder both can read (layouts without a shared collective), or memory handles between "
        "processes on one device (colocated: trainer and rollout on one GPU, CUDA IPC).",
    )
    target_hardware: str | None = Field(
        None,
        max_length=200,
        description="The machines a cuda config is written for (e.g. '1 node, 8x H200'): on a machine without "
        "CUDA, `dockyard preflight` states it and skips the checks that need those machines (GPUs, and the model "
        "folder and task files that live there) instead of failing them.",
    )
    weight_sync_backend: Literal["gloo", "nccl"] = Field("gloo", description="Weight-sync group backend.")
    weight_sync_bucket_mb: int = Field(
        256,
        ge=1,
        le=65536,
        description="Bucket size of the packed transfer (two are in flight); shard size of the folder.",
    )
    weight_sync_folder: str | None = Field(
        None, description="Folder of the checkpoint transport; null = <logger.log_dir>/<job_id>/weights."
    )
    weight_sync_checksum: bool = Field(
        True, description="Fingerprint of the moved bytes on their device, both sides, compared after every sync."
    )

    def device_mismatch(self, service: str, deployed: str) -> str | None:
        """Why a `service` deployed on `deployed` (its DOCKYARD_<SVC>_DEVICE: cpu, cuda or cuda:N) cannot
        take this job, or None when it can: the job runs where cluster.device says, never silently elsewhere."""
        if deployed.split(":")[0] == self.device:
            return None
        return (
            f"the job's cluster.device is {self.device} but this {service} is deployed on {deployed} "
            f"(DOCKYARD_{service.upper()}_DEVICE): set cluster.device={deployed.split(':')[0]}, or deploy the "
            f"{service} on {self.device}"
        )
