"""What both sides of the colocated weight sync share: its keys, pieces, copies and waits.

The sender (colocated_sender.py) and the receiver (colocated_receiver.py) take the names of the
protocol (colocated.py) from here, so both read the same keys and pieces.

Guarantees:
- A piece means the same bytes on both sides: elements [a, b) of a manifest tensor, at a byte
  offset of a handle; every key of a version is "colocated/v<v>/..." in the epoch's store.
- Every wait is bounded by the timeout and sees a peer's reported failure: SyncFailed names the
  epoch, the rank and what was awaited; a store that fails (rank 0 gone) raises SyncFailed too.
  A wait on an event loop yields to the loop's other tasks between its polls, never blocking it.
- Every member is on rank 0's device before a version moves, or the sync fails naming why.
- What decides a repeat changes with any tensor's storage, offset, shape, dtype or stride
  (tensor_signature; the same objects at the same addresses: Given), and a replay writes to the
  tensors it recorded (sink_targets tells the receiver whether they are still the engine's).
- Fingerprints are taken on the tensor's device, with no host copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dockyard.weights import devices
from dockyard.weights.arena import addresses, coalesce
from dockyard.weights.collective import TensorSink
from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import SyncFailed, WeightSyncGroup

BUCKETS = (0, 1)  # handle ids of the two staging buckets; shared tensors' handles count from 2
POLL_S = 100e-6
SPIN_S = 5e-3  # polls back to back this long before sleeping POLL_S between them
FAILURE_EVERY = 4  # a peer's failure key is checked every this many polls


@dataclass(frozen=True)
class Piece:
    """Elements [a, b) of manifest tensor `index`, at byte `offset` of handle `handle`."""

    index: int
    handle: int
    offset: int
    a: int
    b: int


def sync_key(version: int, *parts: object) -> str:
    return "/".join(("colocated", f"v{version}", *(str(p) for p in parts)))


def loaded_keys(version: int, ranks: range) -> list[str]:
    return [sync_key(version, "loaded", r) for r in ranks]


def tensor_signature(name: str, t: torch.Tensor) -> tuple:
    """What decides a tensor's piece: a version whose signatures all equal the last one's sends the same pieces.

    The address stands for storage, offset and device: rank 0 keeps every shared storage alive,
    so no other one can take its address. Kept to a few attributes: it runs per tensor per sync."""
    return name, t.data_ptr(), t.shape, t.dtype, t.stride()


def sink_targets(sink: TensorSink) -> tuple[list[str], list[int]]:
    """The engine's names and addresses, what a replay writes to (its copies keep those tensors alive)."""
    assert sink.targets is not None
    return list(sink.targets), addresses(sink.targets.values())


class Given:
    """The (name, tensor) pairs of a replayable version, to tell cheaply that a later send gives the same.

    The same tensor objects at the same addresses are the same pieces: a weight is stepped in
    place, and nothing reshapes it in place (resize_, as_strided_) between syncs. Anything else
    (new objects, a moved tensor) falls back to the full signature."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.names, self.tensors = zip(*tensors, strict=True) if tensors else ((), ())
        self.addresses = addresses(self.tensors)

    def same(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        if len(tensors) != len(self.tensors) or not tensors:
            return False
        names, given = zip(*tensors, strict=True)
        return (
            names == self.names and all(map(operator.is_, given, self.tensors)) and addresses(given) == self.addresses
        )


def extend(copies: tuple[list, list], more: tuple[list, list]) -> tuple[list, list]:
    copies[0].extend(more[0])
    copies[1].extend(more[1])
    return copies


SMALL_COPY = 1 << 20  # bytes: a tensor below this joins the multi-tensor copy kernel
# A graph pays off only where it replaces many launches: its memcpy nodes ran slower than eager
# device copies on an H200 (0.97 against 0.63 ms for one copy of 1.26 GB).
GRAPH_COPIES = 16


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, same dtype and size: large ones as plain memcpys (full bandwidth,
    which the multi-tensor kernel does not reach), the many small ones in a few multi-tensor launches."""
    small: tuple[list, list] = ([], [])
    for d, s in zip(dsts, srcs, strict=True):
        if d.nbytes < SMALL_COPY:
            small[0].append(d)
            small[1].append(s)
        else:
            d.copy_(s)
    if small[0]:
        torch._foreach_copy_(*small)


class Replay:
    """The whole-tensor copies of a version, run again for a repeat: on CUDA one graph launch.

    Copies adjacent on both sides are merged first (both sides in arenas of one layout: one
    memcpy). Of more than GRAPH_COPIES copies, the first run captures a CUDA graph (large tensors
    as memcpy nodes, the small ones as one multi-tensor kernel) and launches it; later runs launch
    the same graph, so a repeat costs one launch instead of hundreds. The pointers it holds stay
    valid because a replay happens only while both sides keep the same tensors (the signature and
    target checks). Fewer copies, a CPU, or a capture that fails: the copies run eagerly.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], device: torch.device) -> None:
        self.dsts, self.srcs = coalesce(dsts, srcs)
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager = device.type != "cuda" or len(self.dsts) <= GRAPH_COPIES

    def _copy(self) -> None:
        copy_all(self.dsts, self.srcs)

    def run(self) -> None:
        if self.eager:
            return self._copy()
        if self.graph is None:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.device)
            try:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                # thread_local: the engine's other threads may use the device meanwhile (not these tensors)
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    self._copy()
            except Exception:  # noqa: BLE001 - a driver or allocator that refuses capture: copy eagerly
                self.eager = True
                torch.cuda.current_stream(self.device).wait_stream(stream)
                return self._copy()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph = graph
        self.graph.replay()


def hash_into(digest: Fingerprint, t: torch.Tensor) -> None:
    digest.update(t.detach().contiguous())  # on the tensor's device, queued: no host copy (fingerprint.py)


class Peer:
    """What both sides share: the epoch's scoped store, the secret, polling against a deadline."""

    store: dist.Store
    group: WeightSyncGroup
    timeout: timedelta

    def _where(self) -> str:
        return f"colocated weight sync, epoch {self.group.epoch}, rank {self.group.rank}"

    def _poll(self, keys: list[str], failures: list[str], what: str) -> None:
        """Until every key of `keys` exists; SyncFailed when a key of `failures` says "failed" or the timeout passes.

        A failure key that is also the one awaited key ends the wait itself; the others are
        checked every FAILURE_EVERY polls."""
        watched = failures if len(keys) > 1 else [k for k in failures if k not in keys]
        polls = 0

        def arrived() -> bool:
            nonlocal polls
            if self.store.check(keys):
                return True
            polls += 1
            for key in watched if polls % FAILURE_EVERY == 0 else ():
                if self.store.check([key]) and not (why := self.store.get(key).decode(errors="replace")).startswith(
                    "ok"
                ):
                    if self.store.check(keys):  # what it said before it gave up decides (a refit plan)
                        return True
                    raise SyncFailed(f"{self._where()}: {what}: a peer gave up: {why}")
            return False

        self._spin(arrived, what, lambda: f"; missing {[k for k in keys if not self.store.check([k])][:3]}")

    def _pauses(self, what: str, missing=lambda: "", spin_s: float = SPIN_S) -> Iterator[float]:
        """The pause before each next poll, for as long as the timeout allows; then SyncFailed.

        The first `spin_s` polls back to back (0): a sync's answers come within a millisecond, and
        a sleep between checks would add its latency to every sync. Then every POLL_S."""
        now = time.monotonic()
        deadline, spin_until = now + self.timeout.total_seconds(), now + spin_s
        while True:
            yield POLL_S if now > spin_until else 0.0
            now = time.monotonic()
            if now > deadline:
                raise SyncFailed(
                    f"{self._where()}: {what}: no answer within {self.timeout.total_seconds():g}s "
                    f"(a peer died or stalled){missing()}"
                )

    @contextlib.contextmanager
    def _store_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except SyncFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is gone: its host (rank 0) died or closed it
            raise SyncFailed(f"{self._where()}: {what}: the weight-sync store failed: {exc}") from exc

    def _spin(self, done, what: str, missing=lambda: "") -> None:
        """Until `done()` (which raises SyncFailed for a failure it sees); SyncFailed when the timeout passes."""
        with self._store_errors(what):
            for pause in self._pauses(what, missing):
                if done():
                    return
                if pause:
                    time.sleep(pause)

    async def _spin_on_loop(self, done, what: str, spin_s: float = SPIN_S) -> None:
        """`_spin` for a caller on an event loop: each poll yields to the loop's other tasks instead of sleeping."""
        with self._store_errors(what):
            for pause in self._pauses(what, spin_s=spin_s):
                if done():
                    return
                await asyncio.sleep(pause)

    def _devices(self, device: torch.device) -> list[dict]:
        try:
            idents = devices.exchange(self.store, self.group.rank, self.group.world_size, device, self.timeout)
            devices.one_device(idents)
        except devices.DeviceMismatch as exc:
            raise SyncFailed(f"{self._where()}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the store's timeout: a peer never came
            raise SyncFailed(f"{self._where()}: exchanging devices failed or timed out: {exc}") from exc
        return idents
