"""Weights over a torch.distributed side group: packed, double-buffered buckets with a timeout on every wait.

    trainer (rank 0, hosts the TCPStore)                       rollout ranks 1..N
      manifest (names, shapes, dtypes) ──broadcast──>          refit_plan -> all agree (all-reduce MIN)
      pack bucket i+1 into buffer B  ║ broadcast buffer A ──>  unpack bucket i-1 ║ receive bucket i
                 (two buffers of bucket_bytes; packing overlaps the transfer on both sides)

The side group is a standalone ProcessGroupGloo/NCCL built on its own
TCPStore, so it never touches the default process group that FSDP uses.

Guarantees:
- The weights travel as one byte stream (each tensor at a 64-byte aligned
  offset) cut into buckets of exactly `bucket_bytes` (the last one shorter),
  so a tensor larger than a bucket spans several and at most two buckets of
  memory are used beyond the model, whatever the tensor sizes and dtypes.
- Before any bucket moves, every rank maps the sender's manifest onto its
  engine through `refit_plan`, and all ranks agree on the outcome, so a layout
  mismatch is a clear error on every rank instead of a hang.
- Every blocking wait has the group's timeout: a peer that dies or stalls
  makes the sync raise SyncFailed within the timeout, never hang. On CUDA the
  buckets are ordered by streams (the CPU does not wait per bucket), and the
  CPU waits, against the timeout, only where it must: the manifest, the
  agreement, and the last collective, which completes after all others. A group that failed
  is closed (communicator aborted) and must be formed again (a new epoch).
- The sender returns only after every receiver confirmed it loaded the last
  bucket (a final all-reduce), so a receiver that dies after the last byte left
  still fails the sync.
- Both sides can report a SHA-256 over the stream's bytes; equal digests mean
  the receiver holds exactly the bytes the sender sent.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dockyard.weights.refit import RefitError, TensorSpec, canonical_name, refit_plan

ALIGN = 64


class SyncFailed(RuntimeError):
    """A collective failed or timed out: the group is unusable and must be formed again."""


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

    def __init__(
        self, rendezvous: Rendezvous, timeout: timedelta = timedelta(seconds=120), device: str | None = None
    ) -> None:
        """`device`: the GPU of an NCCL member ("cuda:1"); default the calling thread's current one."""
        self.rendezvous = rendezvous
        self.timeout = timeout
        is_master = rendezvous.rank == 0
        # rank 0 hosts the store; everyone else connects to it (bounded by the timeout).
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
            # Our own waits time out first and abort the communicator; the
            # watchdog's later timeout is only a backstop.
            options._timeout = timeout * 2 + timedelta(seconds=30)
            self.pg = dist.ProcessGroupNCCL(store, rendezvous.rank, rendezvous.world_size, options)
            # Explicit: worker threads start on GPU 0 whatever the service's device.
            chosen = torch.device(device) if device and device.startswith("cuda") else torch.device("cuda")
            self.device = chosen if chosen.index is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unknown side-group backend {rendezvous.backend!r}: use gloo or nccl")

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    def _fail(self, what: str, cause: object) -> SyncFailed:
        return SyncFailed(
            f"side group epoch {self.rendezvous.epoch}, rank {self.rank}: {what} failed or timed out "
            f"after at most {self.timeout.total_seconds():g}s (a peer died or stalled): {cause}"
        )

    def _wait(self, work: dist.Work, what: str) -> None:
        """Block the CPU until `work` is done, or raise SyncFailed once the timeout has passed."""
        try:
            if self.device.type != "cuda":
                work.wait()  # gloo: bounded by the group's timeout
                return
            # NCCL's own timed wait sleeps in coarse steps; poll finely against our deadline instead.
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("no completion")
                time.sleep(50e-6)
            work.wait()
        except SyncFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error means the same: the group is gone
            raise self._fail(what, exc) from exc

    def _order(self, work: dist.Work, what: str) -> None:
        """Make later work on this device wait for `work`: the CPU runs on (CUDA streams), or waits (gloo)."""
        if self.device.type == "cuda":
            work.wait()  # the current stream waits for the collective; the CPU does not
        else:
            self._wait(work, what)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        try:
            return self.pg.broadcast(tensor, 0)
        except Exception as exc:  # noqa: BLE001
            raise SyncFailed(f"side group epoch {self.rendezvous.epoch}, rank {self.rank}: broadcast: {exc}") from exc

    def _broadcast(self, tensor: torch.Tensor, what: str = "broadcast") -> None:
        self._wait(self.broadcast_async(tensor), what)

    def _all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        try:
            work = self.pg.allreduce([flag], opts)
        except Exception as exc:  # noqa: BLE001
            raise SyncFailed(f"side group epoch {self.rendezvous.epoch}: all-reduce: {exc}") from exc
        self._wait(work, "agreement all-reduce")
        return bool(flag.item())

    def close(self) -> None:
        """Release the communicator (aborting one stuck on a dead peer) and, on rank 0, the store."""
        if self.pg is not None:
            for name in ("abort", "shutdown"):
                try:
                    getattr(self.pg, name)()
                    break
                except (AttributeError, RuntimeError):
                    continue  # not offered by this backend, or a peer already gone
        self.pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


# -- the stream layout -------------------------------------------------------


def _layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the stream (64-byte aligned) and the stream's length."""
    offsets, end = [], 0
    for spec in specs:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += spec.nbytes
    return offsets, end


def _pieces(specs: list[TensorSpec], offsets: list[int], lo: int, hi: int) -> Iterable[tuple[int, int, int, int, int]]:
    """(tensor index, first element, end element, buffer start byte, buffer end byte) within stream bytes [lo, hi)."""
    # Offsets ascend: start at the last tensor beginning at or before lo, stop past hi.
    first = max(0, bisect.bisect_right(offsets, lo) - 1)
    for i in range(first, len(specs)):
        spec, off = specs[i], offsets[i]
        if off >= hi:
            break
        start, stop = max(lo, off), min(hi, off + spec.nbytes)
        if start >= stop:
            continue
        size = spec.torch_dtype.itemsize
        yield i, (start - off) // size, (stop - off) // size, start - lo, stop - lo


def _buffer_views(
    buf: torch.Tensor, specs: list[TensorSpec], offsets: list[int], lo: int, hi: int
) -> Iterable[tuple[int, int, int, torch.Tensor]]:
    for i, a, b, s, e in _pieces(specs, offsets, lo, hi):
        yield i, a, b, buf[s:e].view(specs[i].torch_dtype)


def _hash_update(digest, buf: torch.Tensor) -> None:
    digest.update(memoryview(buf.detach().cpu().contiguous().numpy()))


def _send_manifest(group: SideGroup, specs: list[TensorSpec], bucket_bytes: int) -> None:
    body = json.dumps([s.to_json() for s in specs]).encode()
    header = torch.tensor([len(body), bucket_bytes], dtype=torch.int64, device=group.device)
    group._broadcast(header, "manifest header")
    group._broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8).to(group.device), "manifest")


def _receive_manifest(group: SideGroup) -> tuple[list[TensorSpec], int]:
    header = torch.zeros(2, dtype=torch.int64, device=group.device)
    group._broadcast(header, "manifest header")
    length, bucket_bytes = (int(v) for v in header.tolist())
    body = torch.empty(length, dtype=torch.uint8, device=group.device)
    group._broadcast(body, "manifest")
    return [TensorSpec.from_json(item) for item in json.loads(bytes(body.cpu().numpy()))], bucket_bytes


def _agree(group: SideGroup, error: Exception | None) -> None:
    if not group._all_ok(error is None):
        if error is not None:
            raise error
        raise RefitError(
            "weight layouts differ between the trainer and a rollout replica (tensor names or shapes); "
            "the replica's log names them"
        )


@torch.no_grad()
def send_weights(
    group: SideGroup, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, checksum: bool = True
) -> SyncReport:
    """Rank 0: broadcast `tensors` (in this order, by canonical name) to every other rank."""
    if group.rank != 0:
        raise ValueError(f"rank {group.rank} cannot send: rank 0 sends")
    start = time.perf_counter()
    bucket_bytes = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    items = [(canonical_name(n), t.detach()) for n, t in tensors]
    specs = [TensorSpec.of(n, t) for n, t in items]
    flats = [t.reshape(-1) for _, t in items]
    _send_manifest(group, specs, bucket_bytes)
    _agree(group, None)
    offsets, total = _layout(specs)
    buffers = [torch.empty(min(bucket_bytes, max(total, 1)), dtype=torch.uint8, device=group.device) for _ in (0, 1)]
    digest = hashlib.sha256()
    pending: list[tuple[dist.Work, torch.Tensor]] = []
    for k, lo in enumerate(range(0, total, bucket_bytes)):
        hi = min(total, lo + bucket_bytes)
        buf = buffers[k % 2][: hi - lo]
        if len(pending) == 2:  # this buffer's previous bucket must have left first
            work, _ = pending.pop(0)
            if checksum:
                group._wait(work, f"bucket {k - 2}")  # hashing reads on the CPU: never block on a dead peer
            else:
                group._order(work, f"bucket {k - 2}")
        for i, a, b, view in _buffer_views(buf, specs, offsets, lo, hi):
            view.copy_(flats[i][a:b], non_blocking=True)
        pending.append((group.broadcast_async(buf), buf))
        if checksum:
            _hash_update(digest, buf)
    for work, _ in pending:
        group._wait(work, "last buckets")
    # Sent is not received: only when every replica confirms is the sync done.
    if not group._all_ok(True):
        raise SyncFailed("a rollout replica failed to load the weights it received (see its log)")
    payload = sum(spec.nbytes for spec in specs)
    return SyncReport(digest.hexdigest() if checksum else "", payload, time.perf_counter() - start)


class TensorSink:
    """Where received weights go: live tensors to copy into, or a loader of whole tensors."""

    def __init__(
        self,
        targets: dict[str, torch.Tensor] | None = None,
        load: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if (targets is None) == (load is None):
            raise ValueError("a TensorSink takes live targets or a load function, not both")
        self.targets = targets
        self.load = load
        self.device = device

    def layout(self) -> dict[str, TensorSpec] | None:
        if self.targets is None:
            return None
        return {n: TensorSpec.of(n, t) for n, t in self.targets.items()}


@torch.no_grad()
def receive_weights(
    group: SideGroup, sink: TensorSink | Iterable[tuple[str, torch.Tensor]], checksum: bool = True
) -> SyncReport:
    """Ranks > 0: load rank 0's weights into `sink` (live tensors are overwritten in place, cast as needed)."""
    if group.rank == 0:
        raise ValueError("rank 0 cannot receive: rank 0 sends")
    if not isinstance(sink, TensorSink):
        sink = TensorSink(targets=dict(sink))
    start = time.perf_counter()
    specs, bucket_bytes = _receive_manifest(group)
    error: Exception | None = None
    names: list[str] = []
    try:
        names = refit_plan(specs, sink.layout())
    except RefitError as exc:
        error = exc
    _agree(group, error)
    offsets, total = _layout(specs)
    buffers = [torch.empty(min(bucket_bytes, max(total, 1)), dtype=torch.uint8, device=group.device) for _ in (0, 1)]
    digest = hashlib.sha256()
    partial: dict[int, torch.Tensor] = {}  # whole-tensor loaders: tensors that span buckets, being assembled

    def unpack(lo: int, hi: int, buf: torch.Tensor) -> None:
        if checksum:
            _hash_update(digest, buf)
        whole = []
        for i, a, b, view in _buffer_views(buf, specs, offsets, lo, hi):
            if sink.targets is not None:
                sink.targets[names[i]].view(-1)[a:b].copy_(view)
                continue
            if a == 0 and b == specs[i].numel:
                whole.append((names[i], view.clone().view(specs[i].shape)))
                continue
            dest = partial.setdefault(i, torch.empty(specs[i].numel, dtype=specs[i].torch_dtype, device=buf.device))
            dest[a:b].copy_(view)
            if b == specs[i].numel:
                whole.append((names[i], partial.pop(i).view(specs[i].shape)))
        if whole and sink.load is not None:
            sink.load(whole)

    previous: tuple[dist.Work, int, int, torch.Tensor] | None = None
    for k, lo in enumerate(range(0, total, bucket_bytes)):
        hi = min(total, lo + bucket_bytes)
        buf = buffers[k % 2][: hi - lo]
        # Unpacking of bucket k-2 (this buffer) was ordered before this receive.
        work = group.broadcast_async(buf)
        if previous is not None:
            pwork, plo, phi, pbuf = previous
            if checksum:
                group._wait(pwork, f"bucket {k - 1}")
            else:
                group._order(pwork, f"bucket {k - 1}")
            unpack(plo, phi, pbuf)
        previous = (work, lo, hi, buf)
    if previous is not None:
        pwork, plo, phi, pbuf = previous
        group._wait(pwork, "last bucket")
        unpack(plo, phi, pbuf)
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    group._all_ok(True)  # confirm receipt to the sender
    payload = sum(spec.nbytes for spec in specs)
    return SyncReport(digest.hexdigest() if checksum else "", payload, time.perf_counter() - start)
