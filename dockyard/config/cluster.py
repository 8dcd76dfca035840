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
        description=(
            "`cpu` or `cuda`: where the job's trainer and rollout run. `dockyard run` deploys its "
            "local trainer and rollout there (`DOCKYARD_TRAINER_DEVICE` / `DOCKYARD_ROLLOUT_DEVICE`, "
            "unless the environment sets them, e.g. `cuda:1`); a trainer or rollout deployed on "
            "another kind of device refuses the job at `LoadPolicy` (FAILED_PRECONDITION naming "
            "both), so a job never runs silently elsewhere."
        ),
    )
    weight_sync_transport: Literal["collective", "checkpoint", "colocated"] = Field(
        "collective",
        description=(
            "How weights reach rollout replicas: `collective` (the torch.distributed weight-sync "
            "group negotiated through the coordinator), `checkpoint` (safetensors shards in "
            "`weight_sync_folder`, for layouts without a shared collective) or `colocated` (trainer "
            "and rollout on one device, one GPU: the rollout copies the weights device to device "
            "through CUDA IPC handles, or shared memory on CPU, exchanged over the weight-sync "
            "group's store; `weight_sync_backend` is not used; see "
            "[deploy.md](deploy.md#one-gpu-trainer-and-rollout-colocated))."
        ),
    )
    target_hardware: str | None = Field(
        None,
        max_length=200,
        description=(
            "The machines a cuda config is written for, in words (e.g. `1 node, 8x H200`); on a "
            "machine without CUDA, `dockyard preflight` prints it and skips the checks of what lives "
            "there (see [Preflight](#preflight))."
        ),
    )
    weight_sync_backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="Weight-sync group backend: `gloo` (CPU) or `nccl` (needs `cluster.device=cuda`)."
    )
    weight_sync_bucket_mb: int = Field(
        256,
        ge=1,
        le=65536,
        description=(
            "Size of one bucket of the packed transfer, in MiB (two are in flight: one packs while "
            "the other moves); tensors of at least a quarter of it are broadcast from and into their "
            "own storage instead, in pieces of at most one bucket; shard size of the checkpoint "
            "transport; the colocated transport's two staging buckets (for tensors it cannot share as "
            "they are)."
        ),
    )
    weight_sync_folder: str | None = Field(
        None,
        description=(
            "Folder of the checkpoint transport, readable by the trainer and every replica; null = "
            "`<logger.log_dir>/<job_id>/weights`. The last two versions are kept."
        ),
    )
    weight_sync_checksum: bool = Field(
        True,
        description=(
            "Both sides fingerprint the bytes moved on the device that holds them (wrapping int64 "
            "sums per transfer, plain and position-weighted; a single flipped bit changes it) and the "
            "coordinator compares them after every sync. No host copy of the weights (the host "
            "SHA-256 it replaces took 23.9 s per 7B-shaped sync on two H200s against 59.5 ms without "
            "it); `bench/weight_sync.py --checksum-cost` prints its cost relative to the transfer."
        ),
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
