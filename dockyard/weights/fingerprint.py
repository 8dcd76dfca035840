"""Fingerprints of the bytes a weight sync moves, computed on the device that holds them.

    bytes of one transfer (any tensor's storage, any length)
        ├─ main part: 512-byte rows, viewed as int64 [rows, 64]
        │     row sums r ─> Σ r, Σ (i+1)·r_i          (int64, wrapping)
        │     column sums c ─> Σ (j+1)·c_j
        └─ tail (< 512 bytes), each byte widened ─> Σ t, Σ (k+1)·t_k
    5 int64 per transfer, kept on the device in transfer order
        ─hexdigest()─> one copy to the host ─> SHA-256 of them, 64 hex characters

Guarantees:
- The fingerprint is a function of the byte sequence alone: equal bytes give
  equal fingerprints whatever the dtype, device or alignment of the tensors
  that hold them, so the sender and the receiver of a sync can compare theirs.
- A single flipped bit anywhere changes it: the flip changes one int64 word
  (or one tail byte) by ±2^k with k < 64, which changes the wrapping sum.
- Rows moved to other places, or words moved within their rows, change the
  position-weighted sums (barring a difference that is a multiple of 2^64):
  it guards against transport faults, not against an adversary.
- Cost: two reads of the bytes where they are (memory bandwidth on a GPU) and
  no host copy or CPU wait until `hexdigest`, which waits once per sync.
"""

from __future__ import annotations

import hashlib

import torch

ROW_WORDS = 64  # int64 words per row: 512 bytes
ROW_BYTES = ROW_WORDS * 8


class Fingerprint:
    """Accumulates the fingerprints of a sequence of byte buffers, in order."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    @torch.no_grad()
    def update(self, data: torch.Tensor) -> None:
        """Add the bytes of `data` (contiguous; any dtype and device); kernels are queued, nothing waits."""
        raw = data.reshape(-1).view(torch.uint8)
        n_main = raw.numel() // ROW_BYTES * ROW_BYTES
        main, tail = raw[:n_main], raw[n_main:]
        if main.numel() and main.storage_offset() % 8:
            main = main.clone()  # int64 views need 8-byte alignment; the bytes, not their address, count
        words = main.view(torch.int64).view(-1, ROW_WORDS)
        rows = words.sum(1)
        index = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=raw.device)
        lanes = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=raw.device)
        t = tail.to(torch.int64)
        t_index = torch.arange(1, t.numel() + 1, dtype=torch.int64, device=raw.device)
        self._parts.append(
            torch.stack([rows.sum(), (rows * index).sum(), (words.sum(0) * lanes).sum(), t.sum(), (t * t_index).sum()])
        )

    def hexdigest(self) -> str:
        """SHA-256 of every buffer's fingerprint, in order (one copy to the host)."""
        digest = hashlib.sha256()
        if self._parts:
            device = self._parts[0].device
            values = torch.stack([p.to(device) for p in self._parts]).cpu()
            digest.update(values.numpy().tobytes())
        return digest.hexdigest()


def fingerprint(*tensors: torch.Tensor) -> str:
    """The fingerprint of the bytes of `tensors`, in order."""
    f = Fingerprint()
    for t in tensors:
        f.update(t)
    return f.hexdigest()
