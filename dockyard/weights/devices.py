"""Where a weight-sync member's weights live, told to its peers through the epoch's store before anything moves.

    rank r: "device/<r>" = {"kind": "cuda", "uuid": "GPU-...", "host": ...} or {"kind": "cpu", "host": ...}
    every rank reads every other rank's identity (bounded by the timeout) and checks the group can work:
      NCCL (collective transport)  no two ranks on one GPU (NCCL refuses it: "Duplicate GPU detected")
      colocated transport          every rank on rank 0's device (CUDA IPC / shared memory need one)

Guarantees: a group that cannot work fails on every rank that takes part,
before NCCL is touched or a handle is shared, with SyncFailed naming the
ranks, the device and the setting that fixes it. `host` is the machine's boot
id (one per running kernel), so two containers of one host count as one host.
"""

from __future__ import annotations

import contextlib
import json
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

FIX_NCCL = (
    "NCCL cannot form a group of two ranks on one device: set cluster.weight_sync_transport=colocated "
    "(weights shared through CUDA IPC, docs/deploy.md, one GPU), or put trainer and rollout on different GPUs"
)


class DeviceMismatch(RuntimeError):
    """The members' devices do not suit the transport; the message says which and what to set."""


def host_id() -> str:
    """This machine's boot id (shared by every container of the host), else its host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def identity(device: torch.device) -> dict:
    """Where tensors on `device` live, comparable across processes."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"kind": "cuda", "uuid": str(torch.cuda.get_device_properties(index).uuid), "host": host_id()}
    return {"kind": "cpu", "host": host_id()}


def describe(ident: dict) -> str:
    return f"GPU {ident['uuid']}" if ident["kind"] == "cuda" else f"the CPU of host {ident['host'][:8]}"


def local_cuda_index(uuid: str) -> int | None:
    """The index under which this process sees the GPU `uuid` (CUDA_VISIBLE_DEVICES may differ per process)."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def exchange(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: timedelta) -> list[dict]:
    """Publish this rank's identity and read every rank's (index = rank); store errors and timeouts propagate."""
    store.set(f"device/{rank}", json.dumps(identity(device)))
    keys = [f"device/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    idents = [json.loads(store.get(k)) for k in keys]
    store.set(f"device/seen/{rank}", "1")
    if rank == 0:  # rank 0 hosts the store: it stays up until every rank has read (each then fails on its own)
        with contextlib.suppress(Exception):
            store.wait([f"device/seen/{r}" for r in range(1, world_size)], timeout)
    return idents


def distinct_gpus(idents: list[dict]) -> None:
    """DeviceMismatch if two ranks of an NCCL group share a GPU."""
    seen: dict[str, int] = {}
    for rank, ident in enumerate(idents):
        if ident["kind"] != "cuda":
            continue
        if ident["uuid"] in seen:
            raise DeviceMismatch(f"ranks {seen[ident['uuid']]} and {rank} are both on {describe(ident)}: {FIX_NCCL}")
        seen[ident["uuid"]] = rank


def one_device(idents: list[dict]) -> None:
    """DeviceMismatch unless every rank is on rank 0's device (the colocated transport's requirement)."""

    def where(i: dict) -> tuple:
        return i["kind"], i.get("uuid"), i["host"]

    home = idents[0]
    away = [r for r, i in enumerate(idents) if where(i) != where(home)]
    if away:
        others = "; ".join(f"rank {r} on {describe(idents[r])}" for r in away)
        raise DeviceMismatch(
            f"the colocated transport shares weights within one device, but the trainer (rank 0) is on "
            f"{describe(home)} and {others}: put them on one device, or set "
            f"cluster.weight_sync_transport=collective"
        )
