"""One contiguous arena for a module's parameters, and copies of adjacent tensors merged into one.

    pack(module): every distinct parameter, in named_parameters order (tied weights once), moved into
                  one device buffer at offsets rounded up to ALIGN bytes; each parameter's data becomes
                  a view of it (the Parameter objects, their names and values stay the same)
    Aliases(module).get(): (name, detached alias) of every parameter, the same objects on every call
                  while no parameter moved, so a sync tells an unchanged layout at once (colocated_sender.py)
    addresses(tensors): their data addresses, read without a Python frame per tensor
    coalesce(dsts, srcs): copy pairs whose sources follow on from each other in one storage, and whose
                  destinations do too, merged into one byte copy

Two processes that pack the same architecture get the same layout, so a weight sync between their
arenas (colocated_receiver.py) coalesces into one memcpy of the whole model instead of one copy per tensor:
the refit runs at the speed of a raw copy of the same bytes.

Guarantees:
- `pack` changes no value, name, dtype, shape or requires_grad; it runs before an optimizer or a
  captured graph holds the old storages (the caller's job) and frees them as it goes, so the peak is
  the old parameters plus the arena.
- `coalesce` merges only exact adjacency on both sides (no gap, same storage), so a merged copy
  writes exactly the bytes its pairs would have written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ALIGN = 16  # bytes: every parameter starts at a vectorizable address


def _offsets(params: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for p in params:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += p.numel() * p.element_size()
    return offsets, end


@torch.no_grad()
def pack(module: torch.nn.Module, new_arena: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """Move `module`'s parameters into one uint8 arena on their device (returned); ValueError if they span devices.
    `new_arena(nbytes)` makes the arena on that device (handles.new_shared_file: one a colocated sync shares)."""
    params = [p for _, p in module.named_parameters()]
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"a parameter arena holds one device's parameters, not {sorted(map(str, devices))}")
    offsets, total = _offsets(params)
    device = devices.pop()
    arena = torch.empty(total, dtype=torch.uint8, device=device) if new_arena is None else new_arena(total)
    if arena.device != device or arena.dtype != torch.uint8 or arena.numel() < total:
        raise ValueError(f"the arena must be {total} bytes of uint8 on {device}")
    for p, offset in zip(params, offsets, strict=True):
        view = arena[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view  # the old storage is freed here, before the next one is copied
    return arena


def is_packed(module: torch.nn.Module) -> bool:
    """Whether every parameter of `module` lies in one storage (an arena)."""
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return len(storages) == 1


def addresses(tensors) -> list[int]:
    """Each tensor's data address, with no Python frame per tensor: it runs on every sync."""
    return list(map(torch.Tensor.data_ptr, tensors))


class Aliases:
    """A module's parameters as (name, detached alias), made once and given again while none moved.

    A parameter stepped in place keeps its address; one whose data was replaced has another, which
    makes the aliases again. Per call: one address read per parameter, no new tensor (detaching each
    parameter on every sync cost more than a small model's whole copy). The module's parameters
    themselves (not their data) must stay the same objects: the owner does not swap submodules."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.params: list[torch.Tensor] = []
        self.addresses: list[int] = []
        self.aliases: list[tuple[str, torch.Tensor]] = []

    def get(self) -> list[tuple[str, torch.Tensor]]:
        if not self.params or addresses(self.params) != self.addresses:
            named = list(self.module.named_parameters())
            self.params = [p for _, p in named]
            self.aliases = [(name, p.detach()) for name, p in named]
            self.addresses = addresses(self.params)
        return self.aliases


def _bytes(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, byte offset in it, byte length) of contiguous `t`."""
    return t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(), t.numel() * t.element_size()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


def coalesce(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same copies (contiguous pairs of equal byte size), adjacent ones merged into byte views of their storages.

    A pair that cannot merge with a neighbour comes back as it was."""
    pairs = sorted(zip(dsts, srcs, strict=True), key=lambda pair: pair[1].data_ptr())
    runs: list[list] = []  # [dst, src, dst storage, dst offset, src storage, src offset, nbytes, merged]
    for d, s in pairs:
        (ds, do, n), (ss, so, _) = _bytes(d), _bytes(s)
        last = runs[-1] if runs else None
        if last is not None and last[2] == ds and last[4] == ss and last[3] + last[6] == do and last[5] + last[6] == so:
            last[6] += n
            last[7] = True
        else:
            runs.append([d, s, ds, do, ss, so, n, False])
    out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for d, s, _, do, _, so, n, merged in runs:
        if merged:
            d, s = _storage_bytes(d)[do : do + n], _storage_bytes(s)[so : so + n]
        out[0].append(d)
        out[1].append(s)
    return out
