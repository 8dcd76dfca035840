"""Weights over a torch.distributed weight-sync group: direct and packed transfers with a timeout on every wait.

    trainer (rank 0, hosts the TCPStore)                       rollout ranks 1..N
      manifest (names, shapes, dtypes) ──broadcast──>          refit_plan -> all agree (all-reduce MIN)
      small tensors: pack bucket i+1 ║ broadcast bucket i ──>  unpack bucket i-1 ║ receive bucket i
      large tensors: their own bytes ──broadcast──>            straight into the engine's tensor
                     (or via a bucket buffer where layout or dtype differ)

The weight-sync group is a standalone ProcessGroupGloo/NCCL built on its own
TCPStore, so it never touches the default process group that FSDP uses.
The group, its store and the proof of the epoch's secret are group.py's (`GroupMember`).

Guarantees:
- Every rank derives the same list of broadcasts from the manifest, the
  bucket size and the direct threshold the sender broadcasts with it, so the
  ranks cannot disagree on what moves next. Tensors below the threshold travel
  as one byte stream (64-byte aligned offsets) cut into buckets of exactly
  `bucket_bytes`; larger ones follow, each in pieces of at most a bucket, from
  and into their own storage where they are contiguous on the group's device
  (and, on the receiver, of the sent dtype). Everything else goes through one
  of two bucket buffers, so at most two buckets of memory are used beyond the
  model, whatever the tensor sizes, dtypes and strides (a whole-tensor loader
  also holds at most two tensors being assembled).
- Before any byte moves, every rank maps the sender's manifest onto its
  engine through `refit_plan`, and all ranks agree on the outcome, so a layout
  mismatch is a clear error on every rank instead of a hang.
- Every blocking wait has the group's timeout: a peer that dies or stalls
  makes the sync raise SyncFailed within the timeout, never hang. On CUDA the
  transfers are ordered by streams (the CPU does not wait per transfer), and
  the CPU waits, against the timeout, only where it must: the manifest, the
  agreement, and the last collective, which completes after all others (the
  receiver then synchronizes its stream: the weights are whole on return, and
  it synchronizes the device before the first broadcast writes into them). A group that failed
  is closed (communicator aborted) and must be formed again (a new epoch).
- The sender returns only after every receiver confirmed it loaded the last
  transfer (a final all-reduce), so a receiver that dies after the last byte left
  still fails the sync.
- Both sides can report a fingerprint of the bytes moved, in transfer order (fingerprint.py:
  computed on the group's device, stream-ordered, one host copy per sync); equal fingerprints
  mean the receiver holds the bytes the sender sent, and any single flipped bit shows.

Why over 400 lines: the sender (`send_weights`) and the receiver (`receive_weights`)
must issue the same broadcasts in the same order from the same transfer plan; keeping the
plan, the manifest and both sides together is what keeps them in step.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import GroupMember, SyncFailed, SyncReport
from dockyard.weights.refit import RefitError, TensorSpec, canonical_name, refit_plan

ALIGN = 64
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


def copy_flat(t: torch.Tensor, a: int, b: int, flat: torch.Tensor, into_flat: bool) -> None:
    """Copy between elements [a, b) of `t` in row-major order and the 1-D `flat` (casting), never copying all of `t`.

    A contiguous or 1-D `t` is sliced as a view; otherwise the range is split
    into whole rows along dim 0 (one strided copy) and partial rows at either
    end (recursion), so a non-contiguous tensor larger than a bucket moves
    through a bucket-sized buffer.
    """
    if a >= b:
        return
    if t.dim() <= 1 or t.is_contiguous():
        part = t.view(-1)[a:b]
        if into_flat:
            flat.copy_(part)
        else:
            part.copy_(flat)
        return
    row = t[0].numel()
    first, pos = a // row, 0
    if a % row:  # a partial first row
        end = min(b, (first + 1) * row)
        copy_flat(t[first], a - first * row, end - first * row, flat[: end - a], into_flat)
        pos, first = end - a, first + 1
    last = b // row
    if last > first:  # whole rows: one strided copy
        n = (last - first) * row
        block = flat[pos : pos + n].view(last - first, *t.shape[1:])
        if into_flat:
            block.copy_(t[first:last])
        else:
            t[first:last].copy_(block)
        pos += n
    if pos < b - a:  # a partial last row
        copy_flat(t[last], 0, b - a - pos, flat[pos:], into_flat)


def _send_manifest(member: GroupMember, specs: list[TensorSpec], bucket_bytes: int, direct_bytes: int) -> None:
    body = json.dumps([s.to_json() for s in specs]).encode()
    header = torch.tensor([len(body), bucket_bytes, direct_bytes], dtype=torch.int64, device=member.device)
    member.broadcast(header, "manifest header")
    member.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8).to(member.device), "manifest")


def _receive_manifest(member: GroupMember) -> tuple[list[TensorSpec], int, int]:
    header = torch.zeros(3, dtype=torch.int64, device=member.device)
    member.broadcast(header, "manifest header")
    length, bucket_bytes, direct_bytes = (int(v) for v in header.tolist())
    body = torch.empty(length, dtype=torch.uint8, device=member.device)
    member.broadcast(body, "manifest")
    specs = [TensorSpec.from_json(item) for item in json.loads(bytes(body.cpu().numpy()))]
    return specs, bucket_bytes, direct_bytes


def _agree(member: GroupMember, error: Exception | None) -> None:
    if not member.all_ok(error is None):
        if error is not None:
            raise error
        raise RefitError(
            "weight layouts differ between the trainer and a rollout replica (tensor names or shapes); "
            "the replica's log names them"
        )


@dataclass(frozen=True)
class Transfer:
    """One broadcast: bytes [lo, hi) of tensor `index` (direct), or of the packed stream when `index` is -1."""

    index: int
    lo: int
    hi: int


@dataclass(frozen=True)
class TransferPlan:
    """What moves, in which order; every rank derives the same plan from the manifest alone."""

    transfers: list[Transfer]
    packed: list[int]  # manifest indices of the packed tensors, in stream order
    packed_offsets: list[int]  # their byte offsets in the packed stream


def default_direct_bytes(bucket_bytes: int) -> int:
    """Tensors of at least this size are broadcast from (and into) their own storage; smaller ones are packed.

    A quarter of a bucket. On two H200s (7B-shaped bf16, 256 MiB buckets; bench/README.md) direct
    transfers from 64 MiB and packing everything were within run-to-run spread of each other,
    while thresholds of 16 and 4 MiB were slower: each extra collective costs more than the
    copies that packing adds.
    """
    return max(ALIGN, bucket_bytes // 4)


def transfer_plan(specs: list[TensorSpec], bucket_bytes: int, direct_bytes: int) -> TransferPlan:
    """Packed buckets of the small tensors first, then each large tensor in manifest order, cut into buckets.

    `direct_bytes` <= 0 packs every tensor. Every transfer is at most
    `bucket_bytes` long and starts at a multiple of it (so at an element
    boundary), which is what bounds the scratch memory of either side.
    """
    direct = [i for i, s in enumerate(specs) if direct_bytes > 0 and s.nbytes >= direct_bytes]
    chosen = set(direct)
    packed = [i for i in range(len(specs)) if i not in chosen]
    offsets, total = _layout([specs[i] for i in packed])
    transfers = [Transfer(-1, lo, min(total, lo + bucket_bytes)) for lo in range(0, total, bucket_bytes)]
    for i in direct:
        n = specs[i].nbytes
        transfers.extend(Transfer(i, lo, min(n, lo + bucket_bytes)) for lo in range(0, n, bucket_bytes))
    return TransferPlan(transfers, packed, offsets)


def _packed_views(
    buf: torch.Tensor, specs: list[TensorSpec], plan: TransferPlan, lo: int, hi: int
) -> Iterable[tuple[int, int, int, torch.Tensor]]:
    """(manifest index, first element, end element, view of `buf`) of each packed piece in stream bytes [lo, hi)."""
    packed_specs = [specs[i] for i in plan.packed]
    for j, a, b, s, e in _pieces(packed_specs, plan.packed_offsets, lo, hi):
        yield plan.packed[j], a, b, buf[s:e].view(packed_specs[j].torch_dtype)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _bucket_bytes(bucket_bytes: int) -> int:
    return max(ALIGN, bucket_bytes // ALIGN * ALIGN)


class _Outbox:
    """The sender's bytes of each transfer: a tensor's own storage, or one of two bucket buffers it fills."""

    def __init__(self, member: GroupMember, items: list[tuple[str, torch.Tensor]], specs, plan: TransferPlan) -> None:
        self.member, self.items, self.specs, self.plan = member, items, specs, plan
        self.longest = max((t.hi - t.lo for t in plan.transfers), default=1)
        self.buffers: list[torch.Tensor] = []  # the two bucket buffers, made on first use (none if all go direct)
        self.in_buffer: list[tuple[dist.Work, int]] = []  # the last broadcast out of each buffer, oldest first

    def source(self, transfer: Transfer, k: int) -> tuple[torch.Tensor, int | None]:
        """The bytes transfer `k` broadcasts, and the bucket slot they are in (None: the tensor's own)."""
        t = self.items[transfer.index][1] if transfer.index >= 0 else None
        if t is not None and t.is_contiguous() and t.device == self.member.device:
            return _byte_view(t)[transfer.lo : transfer.hi], None  # no copy: the tensor's own bytes
        slot = self._free_slot(k)
        src = self.buffers[slot][: transfer.hi - transfer.lo]
        if t is not None:  # a large tensor that is not contiguous here: gathered piece by piece
            size = t.element_size()
            copy_flat(t, transfer.lo // size, transfer.hi // size, src.view(t.dtype), into_flat=True)
        else:
            for i, a, b, view in _packed_views(src, self.specs, self.plan, transfer.lo, transfer.hi):
                copy_flat(self.items[i][1], a, b, view, into_flat=True)
        return src, slot

    def _free_slot(self, k: int) -> int:
        if len(self.buffers) < 2:
            self.buffers.append(torch.empty(self.longest, dtype=torch.uint8, device=self.member.device))
            return len(self.buffers) - 1
        work, slot = self.in_buffer.pop(0)  # this buffer's previous broadcast must have left first
        self.member.order(work, f"transfer {k}: buffer reuse")
        return slot

    def sent(self, work: dist.Work, slot: int | None) -> None:
        if slot is not None:
            self.in_buffer.append((work, slot))


@torch.no_grad()
def send_weights(
    member: GroupMember,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    checksum: bool = True,
    direct_bytes: int | None = None,
) -> SyncReport:
    """Rank 0: broadcast `tensors` (in this order, by canonical name) to every other rank.

    Tensors of at least `direct_bytes` (default `default_direct_bytes`) that are
    contiguous on the group's device leave from their own storage; the rest
    are copied into one of two bucket buffers first.
    """
    if member.rank != 0:
        raise ValueError(f"rank {member.rank} cannot send: rank 0 sends")
    start = time.perf_counter()
    bucket_bytes = _bucket_bytes(bucket_bytes)
    direct_bytes = default_direct_bytes(bucket_bytes) if direct_bytes is None else max(0, direct_bytes)
    items = [(canonical_name(n), t.detach()) for n, t in tensors]
    specs = [TensorSpec.of(n, t) for n, t in items]
    _send_manifest(member, specs, bucket_bytes, direct_bytes)
    _agree(member, None)
    outbox = _Outbox(member, items, specs, transfer_plan(specs, bucket_bytes, direct_bytes))
    digest = _send_transfers(member, outbox, checksum)
    # Sent is not received: only when every replica confirms is the sync done.
    if not member.all_ok(True):
        raise SyncFailed("a rollout replica failed to load the weights it received (see its log)")
    payload = sum(spec.nbytes for spec in specs)
    return SyncReport(digest.hexdigest() if checksum else "", payload, time.perf_counter() - start)


def _send_transfers(member: GroupMember, outbox: _Outbox, checksum: bool) -> Fingerprint:
    """Broadcast every transfer of the plan in order, and wait for all; the fingerprint of the bytes sent."""
    digest = Fingerprint()
    pending: list[dist.Work] = []
    for k, transfer in enumerate(outbox.plan.transfers):
        src, slot = outbox.source(transfer, k)
        work = member.broadcast_async(src)
        pending.append(work)
        outbox.sent(work, slot)
        if checksum:
            digest.update(src)  # queued on this stream after the packing, before the buffer's reuse
    _wait_all(member, pending)
    return digest


def _wait_all(member: GroupMember, pending: list[dist.Work]) -> None:
    for k, work in enumerate(pending):  # on NCCL the last completes after all; gloo may run them out of order
        member.wait(work, f"transfer {k}")


class TensorSink:
    """Where received weights go: live tensors to copy into, or a loader of whole tensors.

    `landed` (live targets only; a transport may not call it): called with the names of the targets a transfer
    completed, once their bytes are ordered before later work on the device's current stream, while later
    transfers may still be under way, so an engine can derive from each weight (FP8 requantization) beside the
    transfer instead of after it. Each target is named at most once per receive.
    """

    def __init__(
        self,
        targets: dict[str, torch.Tensor] | None = None,
        load: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
        device: torch.device | None = None,
        landed: Callable[[list[str]], None] | None = None,
    ) -> None:
        if (targets is None) == (load is None):
            raise ValueError("a TensorSink takes live targets or a load function, not both")
        if landed is not None and targets is None:
            raise ValueError("a TensorSink's landed callback is for live targets; a loader gets whole tensors")
        self.targets = targets
        self.load = load
        self.device = device
        self.landed = landed

    def layout(self) -> dict[str, TensorSpec] | None:
        if self.targets is None:
            return None
        return {n: TensorSpec.of(n, t) for n, t in self.targets.items()}


class _Landing:
    """Where one receive's transfers land, and how each is finished: hashed, copied into place, loaded."""

    def __init__(
        self, member: GroupMember, sink: TensorSink, specs: list[TensorSpec], names: list[str], plan: TransferPlan
    ) -> None:
        self.member, self.sink, self.specs, self.names, self.plan = member, sink, specs, names, plan
        self.longest = max((t.hi - t.lo for t in plan.transfers), default=1)
        self.buffers: list[torch.Tensor] = []
        self.partial: dict[int, torch.Tensor] = {}  # whole-tensor loaders: tensors being assembled

    def _buffer(self, slot: int) -> torch.Tensor:
        while len(self.buffers) <= slot:
            self.buffers.append(torch.empty(self.longest, dtype=torch.uint8, device=self.member.device))
        return self.buffers[slot]

    def _assembled(self, i: int) -> torch.Tensor:
        spec = self.specs[i]
        return self.partial.setdefault(i, torch.empty(spec.numel, dtype=spec.torch_dtype, device=self.member.device))

    def destination(self, transfer: Transfer, slot: int) -> tuple[torch.Tensor, bool]:
        """Where transfer's bytes land, and whether they must be copied out of a bucket buffer afterwards."""
        n = transfer.hi - transfer.lo
        if transfer.index < 0:
            return self._buffer(slot)[:n], True
        spec = self.specs[transfer.index]
        if self.sink.targets is None:
            return _byte_view(self._assembled(transfer.index))[transfer.lo : transfer.hi], False
        t = self.sink.targets[self.names[transfer.index]]
        if t.dtype == spec.torch_dtype and t.is_contiguous() and t.device == self.member.device:
            return _byte_view(t)[transfer.lo : transfer.hi], False  # no copy: straight into the live tensor
        return self._buffer(slot)[:n], True

    def finish(self, transfer: Transfer, view: torch.Tensor, copy_out: bool) -> list[tuple[str, torch.Tensor]]:
        """Transfer's bytes (arrived) copied into place; the tensors it completed (a loader's whole tensors, or
        the live targets themselves)."""
        if transfer.index < 0:
            return self._unpack(transfer, view)
        spec = self.specs[transfer.index]
        name = self.names[transfer.index]
        if copy_out:  # a dtype, device or layout mismatch: cast and copy from the bucket buffer
            size = spec.torch_dtype.itemsize
            target = self.sink.targets[name]  # type: ignore[index]
            copy_flat(target, transfer.lo // size, transfer.hi // size, view.view(spec.torch_dtype), False)
        if transfer.hi < spec.nbytes:
            return []
        if self.sink.load is not None:
            return [(name, self.partial.pop(transfer.index).view(spec.shape))]
        return [(name, self.sink.targets[name])]  # type: ignore[index]

    def _unpack(self, transfer: Transfer, view: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The packed tensors of a bucket into their targets (or assembled, for a loader)."""
        whole: list[tuple[str, torch.Tensor]] = []
        for i, a, b, piece in _packed_views(view, self.specs, self.plan, transfer.lo, transfer.hi):
            spec = self.specs[i]
            if self.sink.targets is not None:
                target = self.sink.targets[self.names[i]]
                copy_flat(target, a, b, piece, into_flat=False)
                if b == spec.numel:
                    whole.append((self.names[i], target))
            elif a == 0 and b == spec.numel:
                whole.append((self.names[i], piece.clone().view(spec.shape)))
            else:
                self._assembled(i)[a:b].copy_(piece)
                if b == spec.numel:
                    whole.append((self.names[i], self.partial.pop(i).view(spec.shape)))
        return whole


@torch.no_grad()
def receive_weights(
    member: GroupMember, sink: TensorSink | Iterable[tuple[str, torch.Tensor]], checksum: bool = True
) -> SyncReport:
    """Ranks > 0: load rank 0's weights into `sink` (live tensors are overwritten in place, cast as needed).

    A large tensor lands directly in its live target when dtype, device and
    contiguity match; otherwise it goes through a bucket buffer and is cast
    and copied into place from there.
    """
    if member.rank == 0:
        raise ValueError("rank 0 cannot receive: rank 0 sends")
    if not isinstance(sink, TensorSink):
        sink = TensorSink(targets=dict(sink))
    start = time.perf_counter()
    if member.device.type == "cuda":
        # Kernels still reading the weights (any stream) finish before a broadcast writes into them.
        torch.cuda.synchronize(member.device)
    specs, bucket_bytes, direct_bytes = _receive_manifest(member)
    names = _agreed_names(member, specs, sink)
    landing = _Landing(member, sink, specs, names, transfer_plan(specs, bucket_bytes, direct_bytes))
    digest = _receive_transfers(member, landing, checksum)
    if member.device.type == "cuda":
        # The copies out of the buffers ran on this stream; the weights are whole before anyone reads them.
        torch.cuda.current_stream(member.device).synchronize()
    member.all_ok(True)  # confirm receipt to the sender
    payload = sum(spec.nbytes for spec in specs)
    return SyncReport(digest.hexdigest() if checksum else "", payload, time.perf_counter() - start)


def _agreed_names(member: GroupMember, specs: list[TensorSpec], sink: TensorSink) -> list[str]:
    """The sink's name of each manifest tensor, once every rank agreed its own plan holds (else RefitError)."""
    error: Exception | None = None
    names: list[str] = []
    try:
        names = refit_plan(specs, sink.layout())
    except RefitError as exc:
        error = exc
    _agree(member, error)
    return names


def _receive_transfers(member: GroupMember, landing: _Landing, checksum: bool) -> Fingerprint:
    """Receive every transfer of the plan, finishing each while the next one is under way."""
    digest = Fingerprint()

    def finish(transfer: Transfer, dst: tuple[torch.Tensor, bool], work: dist.Work, k: int) -> None:
        """Transfer `k` has arrived (ordered on CUDA, waited on gloo): hash it, copy it into place, load it."""
        view, copy_out = dst
        sink = landing.sink
        if checksum or copy_out or sink.load is not None or sink.landed is not None:
            member.order(work, f"transfer {k}")
        if checksum:
            digest.update(view)
        whole = landing.finish(transfer, view, copy_out)
        if whole and sink.load is not None:
            sink.load(whole)
        elif whole and sink.landed is not None:
            sink.landed([name for name, _ in whole])

    pending: list[dist.Work] = []
    previous: tuple[Transfer, tuple[torch.Tensor, bool], dist.Work, int] | None = None
    uses = 0  # transfers through a bucket buffer so far: they alternate between the two
    for k, transfer in enumerate(landing.plan.transfers):
        # The copy out of this buffer's previous transfer (two buffer uses ago) was ordered before this receive.
        dst = landing.destination(transfer, uses % 2)
        uses += dst[1]
        work = member.broadcast_async(dst[0])
        pending.append(work)
        if previous is not None:
            finish(*previous)
        previous = (transfer, dst, work, k)
    _wait_all(member, pending)
    if previous is not None:
        finish(*previous)
    return digest
