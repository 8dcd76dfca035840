"""Memory handles a process can map, and messages only the epoch's members can have written.

    rank 0: share(bytes of a storage) ──> ("cuda", CUDA IPC handle) | ("cpu", shared-memory file), picklable
            sign(secret, key, pickled message) ──> HMAC-SHA256(secret, key + message) + message
    rank r: verify(secret, key, raw) ──> the message, or SyncFailed; open_handle(handle, its own GPU index)

Guarantees: a CUDA handle is torch's own (`torch.multiprocessing.reductions.reduce_tensor`, the
allocator's IPC handle, reference counted so the sender frees nothing a receiver still maps) with
the device index left out: the receiver names the GPU by its own index, as its CUDA_VISIBLE_DEVICES
numbers it. A CPU handle is a shared-memory file (torch's file_system strategy: any local process
can open it, no file descriptor passing between unrelated processes). `verify` fails unless the
message was signed for that very key with the epoch's secret, so nothing a stranger wrote into the
store (or a message moved to another key) is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from torch.multiprocessing import reductions

from dockyard.weights.group import SyncFailed

_MAC_LEN = 64


def sign(secret: str, key: str, payload: bytes) -> bytes:
    return hmac.new(secret.encode(), key.encode() + payload, hashlib.sha256).hexdigest().encode() + payload


def verify(secret: str, key: str, raw: bytes) -> bytes:
    mac, payload = raw[:_MAC_LEN], raw[_MAC_LEN:]
    expected = hmac.new(secret.encode(), key.encode() + payload, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, expected):
        raise SyncFailed(f"{key}: the message is not signed with the epoch's secret (corrupt, or not from rank 0)")
    return payload


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a 1-D uint8 tensor (what a handle shares)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


def share(t: torch.Tensor) -> tuple[str, object]:
    """A picklable handle of byte tensor `t`: CUDA IPC (device index left to the receiver) or shared memory."""
    if t.is_cuda:
        rebuild, args = reductions.reduce_tensor(t)
        if rebuild is not reductions.rebuild_cuda_tensor:
            raise SyncFailed(f"a CUDA tensor could not be shared through IPC ({rebuild.__name__})")
        args = list(args)
        args[6] = None  # the storage's device index: the receiver's own index of the same GPU
        return "cuda", tuple(args)
    from multiprocessing.reduction import ForkingPickler

    return "cpu", bytes(ForkingPickler.dumps(t))  # shared-memory file (file_system strategy)


def open_handle(handle: tuple[str, object], cuda_index: int | None) -> torch.Tensor:
    kind, body = handle
    if kind == "cuda":
        args = list(body)  # type: ignore[arg-type]
        args[6] = cuda_index
        return reductions.rebuild_cuda_tensor(*args)
    return pickle.loads(body)  # type: ignore[arg-type]
