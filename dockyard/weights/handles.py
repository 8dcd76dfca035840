"""Memory handles a process can map, and messages only the epoch's members can have written.

    rank 0: share(bytes of a storage) ──> ("cuda", CUDA IPC handle) | ("file", (path, bytes)), picklable
            new_shared_file(nbytes) ──> a CPU byte tensor mapped from a new file in shared memory;
            remove_file(its path) once every receiver mapped it
            sign(secret, key, pickled message) ──> HMAC-SHA256(secret, key + message) + message
    rank r: verify(secret, key, raw) ──> the message, or SyncFailed; open_handle(handle, its own GPU index)

Guarantees: a CUDA handle is torch's own (`torch.multiprocessing.reductions.reduce_tensor`, the
allocator's IPC handle, reference counted so the sender frees nothing a receiver still maps) with
the device index left out: the receiver names the GPU by its own index, as its CUDA_VISIBLE_DEVICES
numbers it. A CPU handle names a file mapped shared (`/dev/shm` where there is one): any local
process, or a container that shares the host's /dev/shm, maps the same bytes, with no helper
daemon and no file descriptor passed between unrelated processes. A receiver maps only a file that
exists and is large enough (it never creates one); the file's creator unlinks it once every
receiver has mapped it (the mappings stay valid), so a creator killed before then leaves it behind.
`verify` fails unless the message was signed for that very key with the epoch's secret, so nothing
a stranger wrote into the store (or a message moved to another key) is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import tempfile

import torch
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


def create_shared_file(nbytes: int) -> str:
    """The path of a new file of `nbytes` zeros in shared memory (/dev/shm where there is one)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="dockyard-weights-", dir=folder)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def new_shared_file(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes` mapped shared from a new file (`shared_file_of` names it)."""
    storage = torch.UntypedStorage.from_file(create_shared_file(nbytes), shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def shared_file_of(t: torch.Tensor) -> str | None:
    """The file a CPU tensor's storage is mapped shared from, or None (then it cannot be shared as it is)."""
    storage = t.untyped_storage()
    return storage.filename if not t.is_cuda and storage.is_shared() else None


def remove_file(path: str) -> None:
    """Unlink a shared file (its mappings stay valid); one already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def share(t: torch.Tensor) -> tuple[str, object]:
    """A picklable handle of byte tensor `t`: CUDA IPC (device index left to the receiver) or its shared file."""
    if t.is_cuda:
        rebuild, args = reductions.reduce_tensor(t)
        if rebuild is not reductions.rebuild_cuda_tensor:
            raise SyncFailed(f"a CUDA tensor could not be shared through IPC ({rebuild.__name__})")
        args = list(args)
        args[6] = None  # the storage's device index: the receiver's own index of the same GPU
        return "cuda", tuple(args)
    path = shared_file_of(t)
    if path is None:
        raise SyncFailed("a CPU tensor is shared only from a file mapped shared (handles.new_shared_file)")
    return "file", (path, t.untyped_storage().nbytes())


def open_handle(handle: tuple[str, object], cuda_index: int | None) -> torch.Tensor:
    kind, body = handle
    if kind == "cuda":
        args = list(body)  # type: ignore[arg-type]
        args[6] = cuda_index
        return reductions.rebuild_cuda_tensor(*args)
    path, nbytes = body  # type: ignore[misc]
    try:
        fd = os.open(path, os.O_RDWR)  # never O_CREAT: a missing file is a failed sync, not zeros
    except OSError as exc:
        raise SyncFailed(f"cannot open the shared file {path}: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_size < nbytes:
            raise SyncFailed(f"the shared file {path} holds fewer than the {nbytes} bytes announced")
        return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)  # the tensor keeps the map alive
    finally:
        os.close(fd)
