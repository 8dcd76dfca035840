"""Weights over a torch.distributed side group, formed from a coordinator rendezvous.

    trainer (rank 0, hosts the TCPStore) ──broadcast, bucket by bucket──> rollout ranks 1..N

The side group is a standalone ProcessGroupGloo/NCCL built on its own
TCPStore, so it never touches the default process group that FSDP uses.

Guarantees:
- Before any bucket moves, every rank checks that it holds the same tensor
  names, shapes and dtypes in the same order (a digest broadcast from rank 0),
  and all ranks agree on the outcome (all-reduce), so a layout mismatch is a
  clear error on every rank instead of a hang.
- At most one bucket (≤ bucket_bytes, or one tensor if a tensor is larger) is
  materialised at a time beyond the model itself.
- Every collective has the group's timeout: a dead peer is an error, not a hang.
- Both sides can report a SHA-256 over the bytes in broadcast order; equal
  digests mean the receiver holds exactly the sender's weights.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    master_address: str
    master_port: int
    world_size: int
    rank: int
    epoch: int
    backend: str = "gloo"


@dataclass(frozen=True)
class SyncReport:
    checksum: str
    num_bytes: int
    seconds: float


class SideGroup:
    """One member's handle on the side group of one epoch."""

    def __init__(self, rendezvous: Rendezvous, timeout: timedelta = timedelta(seconds=120)) -> None:
        self.rendezvous = rendezvous
        is_master = rendezvous.rank == 0
        # rank 0 hosts the store; everyone else connects to it.
        self._store = dist.TCPStore(
            rendezvous.master_address,
            rendezvous.master_port,
            rendezvous.world_size,
            is_master=is_master,
            timeout=timeout,
            wait_for_workers=False,
        )
        store = dist.PrefixStore(f"dockyard/weights/epoch-{rendezvous.epoch}", self._store)
        if rendezvous.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rendezvous.rank, rendezvous.world_size, timeout)
            self.device = torch.device("cpu")
        elif rendezvous.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rendezvous.rank, rendezvous.world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unknown side-group backend {rendezvous.backend!r}: use gloo or nccl")

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def _all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([flag], opts).wait()
        return bool(flag.item())

    def close(self) -> None:
        """Release the communicator (NCCL leaks it otherwise) and, on rank 0, the store."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except RuntimeError:
                pass  # a peer already gone: nothing left to release cleanly
        self.pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _manifest_digest(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    lines = "\n".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in tensors)
    return hashlib.sha256(lines.encode()).digest()


def _buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors whose total size stays within bucket_bytes."""
    bucket: list[torch.Tensor] = []
    size = 0
    for _, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _check_layout(group: SideGroup, tensors: list[tuple[str, torch.Tensor]]) -> None:
    mine = torch.frombuffer(bytearray(_manifest_digest(tensors)), dtype=torch.uint8).to(group.device)
    theirs = mine.clone()
    group._broadcast(theirs)
    if not group._all_ok(bool(torch.equal(mine, theirs))):
        raise ValueError(
            "weight layouts differ between the trainer and a rollout replica "
            "(tensor names, shapes or dtypes); both must load the same architecture"
        )


def _bytes_of(flat: torch.Tensor) -> memoryview:
    return memoryview(flat.detach().cpu().contiguous().view(torch.uint8).numpy())


def send_weights(
    group: SideGroup, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, checksum: bool = True
) -> SyncReport:
    """Rank 0: broadcast `tensors` (name order is the contract) to every other rank."""
    return _run(group, list(tensors), bucket_bytes, checksum, sending=True)


def receive_weights(
    group: SideGroup, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, checksum: bool = True
) -> SyncReport:
    """Ranks > 0: overwrite `tensors` in place with rank 0's values."""
    return _run(group, list(tensors), bucket_bytes, checksum, sending=False)


@torch.no_grad()
def _run(
    group: SideGroup, tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, checksum: bool, sending: bool
) -> SyncReport:
    if sending != (group.rank == 0):
        raise ValueError(f"rank {group.rank} cannot {'send' if sending else 'receive'}: rank 0 sends")
    start = time.perf_counter()
    _check_layout(group, tensors)
    digest = hashlib.sha256()
    total = 0
    for bucket in _buckets(tensors, bucket_bytes):
        if sending:
            flat = torch.cat([t.detach().reshape(-1) for t in bucket]).to(group.device)
        else:
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=group.device)
        group._broadcast(flat)
        if not sending:
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        if checksum:
            digest.update(_bytes_of(flat))
        total += flat.numel() * flat.element_size()
        del flat
    return SyncReport(
        checksum=digest.hexdigest() if checksum else "", num_bytes=total, seconds=time.perf_counter() - start
    )
