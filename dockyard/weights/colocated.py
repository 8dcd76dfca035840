"""Colocated weight sync: trainer and rollout on one device share memory handles, the bytes never leave it.

Over the coordinator's weight-sync group (A:P, world W, rank r, epoch e, secret) no process group is
formed (NCCL refuses two ranks on one GPU); the epoch's store carries small signed messages instead:

    per epoch   rank 0 hosts the store at A:P; every rank proves the epoch's secret (collective.prove_membership)
                and publishes its device (devices.exchange): all must be on rank 0's device
    version v   rank 0: "colocated/v<v>/manifest" = {tensors: [[name, shape, dtype]...], messages: M, live: ids}
                rank r: refit_plan onto its engine ──> "colocated/v<v>/plan/<r>" = "ok" | "failed: <why>"
                for k in 0..M-1 (rank 0 does not wait for the plans: a receiver copies nothing before its own):
                  rank 0: the contiguous tensors shared as they are (their storage's handle, once), then
                          the strided or off-device pieces staged into two buckets (each shared once);
                          "colocated/v<v>/message/<k>" = {new handles, pieces, the mailbox's path (once)}
                  rank r: maps new handles (CUDA IPC: torch.multiprocessing.reductions; CPU: shared memory),
                          copies every piece into its target (copies adjacent on both sides merged:
                          arena.coalesce); a message that used a bucket, once the copies are done
                          ──> "colocated/v<v>/ack/<k>/<r>"
                rank r: every copy done ──> "colocated/v<v>/loaded/<r>" = "ok" | "ok+replay" | "failed: <why>"
    repeat v    (checksum off) the same names, layouts and storages as version u (known at once when the
                caller gives u's tensor objects again at the same addresses: arena.Aliases), every tensor
                shared as it is, and every receiver answered "ok+replay" for u: nothing goes through the store; rank 0
                writes v into the mailbox (mailbox.py, shared memory; a version sent in full writes -v
                there once its manifest is in the store); rank r, which watches the mailbox once it has
                mapped it, replays u's copies into the same tensors (eagerly, or on CUDA one launch of a
                graph of many, captured at the first repeat; or fails, when they changed, which it checks
                while the device copies)
                ──> its mailbox word = v | -v (the reason in "colocated/v<v>/loaded/<r>")
                a receiver on an event loop (receive_on_loop) takes a repeat on the loop itself, both of
                its waits (the ask, the copies) polled between the loop's other tasks: no worker thread

Guarantees:
- Weights never cross the host: on CUDA a receiver copies device to device out of
  the trainer's own memory (or a staging bucket) through CUDA IPC handles.
- Staging memory is bounded: at most two buckets; a bucket is reused only after every
  receiver acknowledged the message that used it, and every shared tensor stays alive on
  rank 0 until every receiver confirmed the version (the send returns only then).
- Same semantics as the other transports: one manifest per version, `refit_plan` on every
  receiver before any byte is loaded (a mismatch fails both sides with the names), casts on
  load, and a fingerprint (fingerprint.py, on the device) of the bytes of every piece in
  message order on both sides (the receiver fingerprints what landed in its tensors), equal
  when the receiver holds exactly the sender's bytes.
- Messages carry pickled handles, so each is signed with the epoch's secret (HMAC-SHA256)
  and a receiver unpickles only a message whose signature holds: a stranger on the store
  cannot make a member run code, and a corrupted message fails the sync.
- A repeat taken on an event loop never blocks the loop on a peer or on the copies (it polls),
  and a failure or a cancellation there is reported to rank 0 as `receive` reports it, once the
  copies it queued are done.
- Every wait is bounded by the timeout and sees a peer's reported failure at once: a receiver
  that dies, stalls or fails makes the send raise SyncFailed (with its reason where it gave
  one), a sender that dies or fails makes the receive raise SyncFailed.
- Handles are kept across versions for storages that stay the same (the trainer's parameters):
  a steady-state sync opens no new handle. Handles of a version are released by both sides once
  the next version no longer uses them (a trainer that sends cast copies keeps one version of
  them alive until the next sync).

Why over 400 lines: the sender and the receiver must read the same keys, messages and
pieces in the same order; keeping both sides and the transport that picks one together is what
keeps them in step (the handles and signatures live in handles.py, the device check in devices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from dockyard.weights import devices
from dockyard.weights.arena import addresses, coalesce
from dockyard.weights.collective import TensorSink, copy_flat
from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup, host_store, join_store, prove_membership
from dockyard.weights.handles import byte_tensor, open_handle, share, sign, verify
from dockyard.weights.mailbox import Mailbox
from dockyard.weights.refit import RefitError, TensorSpec, canonical_name, refit_plan
from dockyard.weights.transport import Transport

BUCKETS = (0, 1)  # handle ids of the two staging buckets; shared tensors' handles count from 2
DIRECT_PER_MESSAGE = 4 << 30  # bytes of shared tensors one message lists (messages pipeline the receiver)
POLL_S = 100e-6
ABORT_EVERY_S = 2e-3  # a receiver waiting on the mailbox looks for rank 0's abort in the store this often
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


def _key(version: int, *parts: object) -> str:
    return "/".join(("colocated", f"v{version}", *(str(p) for p in parts)))


def _loaded_keys(version: int, ranks: range) -> list[str]:
    return [_key(version, "loaded", r) for r in ranks]


def _signature(name: str, t: torch.Tensor) -> tuple:
    """What decides a tensor's piece: a version whose signatures all equal the last one's sends the same pieces.

    The address stands for storage, offset and device: rank 0 keeps every shared storage alive,
    so no other one can take its address. Kept to a few attributes: it runs per tensor per sync."""
    return name, t.data_ptr(), t.shape, t.dtype, t.stride()


def _targets(sink: TensorSink) -> tuple[list[str], list[int]]:
    """The engine's names and addresses, what a replay writes to (its copies keep those tensors alive)."""
    assert sink.targets is not None
    return list(sink.targets), addresses(sink.targets.values())


class _Given:
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


def _extend(copies: tuple[list, list], more: tuple[list, list]) -> tuple[list, list]:
    copies[0].extend(more[0])
    copies[1].extend(more[1])
    return copies


SMALL_COPY = 1 << 20  # bytes: a tensor below this joins the multi-tensor copy kernel
# A graph pays off only where it replaces many launches: its memcpy nodes ran slower than eager
# device copies on an H200 (0.97 against 0.63 ms for one copy of 1.26 GB).
GRAPH_COPIES = 16


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
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
        _copy_all(self.dsts, self.srcs)

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


def _hash(digest: Fingerprint, t: torch.Tensor) -> None:
    digest.update(t.detach().contiguous())  # on the tensor's device, queued: no host copy (fingerprint.py)


class _Peer:
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


class ColocatedSender(_Peer):
    """Rank 0 of one epoch: hosts the store, keeps the staging buckets and the handles it shared."""

    def __init__(
        self, group: WeightSyncGroup, timeout: timedelta, device: torch.device, bucket_bytes: int, checksum: bool
    ) -> None:
        if group.rank != 0:
            raise ValueError(f"rank {group.rank} cannot send: rank 0 sends")
        if not group.secret:
            raise SyncFailed(f"the weight-sync group of epoch {group.epoch} has no secret: ask the coordinator")
        self.group, self.timeout, self.device, self.checksum = group, timeout, device, checksum
        self.bucket_bytes = max(64, bucket_bytes // 64 * 64)
        if device.type == "cpu":
            torch_mp.set_sharing_strategy("file_system")  # shared-memory files any local process can open
        self._root = host_store(group, timeout)
        self.store = dist.PrefixStore(f"dockyard/weights/epoch-{group.epoch}", self._root)
        try:
            prove_membership(self.store, group, timeout)
            self._devices(device)
        except SyncFailed:
            self.store = self._root = None  # type: ignore[assignment]  # the store stops listening
            raise
        self.buckets: list[torch.Tensor] = []
        self.ids: dict[int, int] = {}  # storage -> handle id, for the storages shared as they are
        self.shared: dict[int, torch.Tensor] = {}  # handle id -> the storage's bytes (kept alive while shared)
        self.next_id = len(BUCKETS)
        self.sent: set[int] = set()  # handle ids the receivers have mapped
        self.keys: list[str] = []  # this epoch's keys of the last full version, deleted once no one reads them
        self.last_signature: list | None = None  # of the last version every receiver can replay
        self.last_given: _Given | None = None  # its tensors, for the cheap check (the same objects again)
        self.last_version = -1
        self.last_nbytes = 0
        self.mailbox: Mailbox | None = None  # created with the first full version, mapped by every receiver
        self.mailbox_mapped = False

    def _direct(self, t: torch.Tensor) -> bool:
        if t.numel() == 0 or not t.is_contiguous() or t.device != self.device:
            return False
        return t.is_cuda or t.is_shared()

    def _handle_of(self, t: torch.Tensor) -> int:
        # The storage itself (not its data pointer: sharing a CPU storage may move its bytes into a file).
        ptr = t.untyped_storage()._cdata
        if ptr not in self.ids:
            self.ids[ptr], self.shared[self.next_id] = self.next_id, byte_tensor(t)
            self.next_id += 1
        return self.ids[ptr]

    def _plan(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[list[Piece], int | None]]:
        """Messages: (pieces, bucket slot or None); shared tensors first, then the staged pieces bucket by bucket."""
        messages: list[tuple[list[Piece], int | None]] = []
        direct: list[Piece] = []
        size = 0
        for i, (_, t) in enumerate(items):
            if not self._direct(t):
                continue
            if direct and size + t.nbytes > DIRECT_PER_MESSAGE:
                messages.append((direct, None))
                direct, size = [], 0
            direct.append(Piece(i, self._handle_of(t), t.storage_offset() * t.element_size(), 0, t.numel()))
            size += t.nbytes
        if direct:
            messages.append((direct, None))
        staged: list[Piece] = []
        used = slot = 0
        for i, (_, t) in enumerate(items):
            if self._direct(t) or t.numel() == 0:
                continue
            item = t.element_size()
            a = 0
            while a < t.numel():
                used = -(-used // 64) * 64
                room = (self.bucket_bytes - used) // item
                if room <= 0:
                    messages.append((staged, slot))
                    staged, used, slot = [], 0, 1 - slot
                    continue
                b = min(t.numel(), a + room)
                staged.append(Piece(i, BUCKETS[slot], used, a, b))
                used += (b - a) * item
                a = b
        if staged:
            messages.append((staged, slot))
        return messages

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        start = time.perf_counter()
        tensors = list(tensors)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # each send may run on another worker thread
            torch.cuda.synchronize(self.device)  # the optimizer's writes are done before anyone reads
        ranks = range(1, self.group.world_size)
        # The same names, layouts and storages as the last version, all shared as they are: the
        # receivers replay their copies, asked through the mailbox (no manifest, no store round trip).
        if self.last_given is not None and self.last_given.same(tensors):
            return self._repeat(version, ranks, start)
        signature = None if self.checksum else [_signature(n, t) for n, t in tensors]
        if signature is not None and signature == self.last_signature:
            self.last_given = _Given(tensors)  # new objects of the same layout: the next check is the cheap one
            return self._repeat(version, ranks, start)
        return self._send_full(tensors, version, ranks, signature, start)

    def _send_full(
        self, tensors: list[tuple[str, torch.Tensor]], version: int, ranks: range, signature: list | None, start: float
    ) -> SyncReport:
        """A version through the store: its manifest, every message, then every receiver's "loaded"."""
        self.last_signature = self.last_given = None
        self._forget_keys()
        items = [(canonical_name(n), t.detach()) for n, t in tensors]
        specs = [TensorSpec.of(n, t) for n, t in items]
        refit_plan(specs, None)  # the same name twice is a RefitError
        messages = self._plan(items)
        announce = self._announce(version, ranks, specs, messages)
        # No wait for the receivers' refit plans here: each one checks its own before it copies a
        # byte, and a refusal reaches this side as a failed acknowledgement (then _refused names it).
        digest = Fingerprint() if self.checksum else None
        loaded = _loaded_keys(version, ranks)
        try:
            mapped = self._send_messages(version, ranks, items, specs, messages, announce, digest)
            self._poll(loaded, loaded, f"confirming version {version}")
        except SyncFailed as exc:
            self._refused(version, ranks, exc)
            raise
        self._refused(version, ranks, None)
        replayable = self._check_loaded(version, ranks)
        self.sent = mapped
        if announce and messages:  # every receiver has mapped it: the file can go
            self.mailbox.unlink()  # type: ignore[union-attr]
            self.mailbox_mapped = True
        repeatable = signature is not None and replayable and self.mailbox_mapped
        if repeatable and all(slot is None for _, slot in messages):
            self.last_signature, self.last_given = signature, _Given(tensors)
            self.last_version = version
            self.last_nbytes = sum(s.nbytes for s in specs)
        checksum = digest.hexdigest() if digest is not None else ""
        return SyncReport(checksum, sum(s.nbytes for s in specs), time.perf_counter() - start)

    def _announce(
        self, version: int, ranks: range, specs: list[TensorSpec], messages: list[tuple[list[Piece], int | None]]
    ) -> bool:
        """The version's manifest in the store, -version in the mailbox; whether its first message names the mailbox."""
        live = sorted({p.handle for pieces, _ in messages for p in pieces})
        self._release(set(live))
        manifest = {"version": version, "tensors": [s.to_json() for s in specs], "messages": len(messages)}
        manifest["live"] = live
        announce = self.mailbox is None or not self.mailbox_mapped
        if self.mailbox is None:
            self.mailbox = Mailbox.create(self.group.world_size)
        self._set(_key(version, "manifest"), json.dumps(manifest).encode())
        self.mailbox.ask(-version)  # receivers that watch the mailbox: this version is in the store
        plans = [_key(version, "plan", r) for r in ranks]
        self.keys = [_key(version, "manifest"), *_loaded_keys(version, ranks), *plans]
        return announce

    def _send_messages(
        self,
        version: int,
        ranks: range,
        items: list[tuple[str, torch.Tensor]],
        specs: list[TensorSpec],
        messages: list[tuple[list[Piece], int | None]],
        announce: bool,
        digest: Fingerprint | None,
    ) -> set[int]:
        """Every message in the store, a bucket staged only once its last user was acknowledged; the handles
        the receivers hold afterwards."""
        mapped = set(self.sent)  # handles the receivers hold once this version is through
        slot_user: dict[int, int] = {}  # bucket slot -> the message that used it last
        loaded = _loaded_keys(version, ranks)
        for k, (pieces, slot) in enumerate(messages):
            if slot is not None:
                if slot in slot_user:  # reused only once every receiver is done with it
                    acks = [_key(version, "ack", slot_user[slot], r) for r in ranks]
                    self._poll(acks, loaded, f"message {slot_user[slot]} of version {version}")
                slot_user[slot] = k
                self._stage(items, pieces, slot)
                self.keys += [_key(version, "ack", k, r) for r in ranks]
            new = {p.handle: self._handle(p.handle) for p in pieces if p.handle not in mapped}
            body = {"new": new, "pieces": [(p.index, p.handle, p.offset, p.a, p.b) for p in pieces]}
            if k == 0 and announce:
                body["mailbox"] = self.mailbox.path  # type: ignore[union-attr]
            self._set(_key(version, "message", k), pickle.dumps(body))
            mapped.update(new)
            self.keys.append(_key(version, "message", k))
            for p in pieces if digest is not None else ():
                _hash(digest, self._view(p, specs[p.index].torch_dtype))
        return mapped

    def _repeat(self, version: int, ranks: range, start: float) -> SyncReport:
        """Every receiver replays the last version's copies: asked and answered in the mailbox."""
        box = self.mailbox
        assert box is not None

        def answered() -> bool:
            got = box.answers()
            for r, value in zip(ranks, got, strict=True):
                if value == -version:
                    key = _key(version, "loaded", r)
                    why = self.store.get(key).decode(errors="replace") if self.store.check([key]) else "no reason"
                    raise SyncFailed(f"{self._where()}: rank {r} could not load version {version}: {why}")
            return all(value == version for value in got)

        box.ask(version)
        self._spin(answered, f"confirming version {version}")
        self.last_version = version
        self._forget_keys()  # off the path of every later repeat
        return SyncReport("", self.last_nbytes, time.perf_counter() - start)

    def _forget_keys(self) -> None:
        for key in self.keys:
            self.store.delete_key(key)
        self.keys = []

    def _refused(self, version: int, ranks: range, cause: SyncFailed | None) -> None:
        """RefitError with the reason of the first receiver whose refit plan refused the manifest, if one did."""
        try:
            answers = [
                self.store.get(k).decode(errors="replace")
                for r in ranks
                if self.store.check([k := _key(version, "plan", r)])
            ]
        except Exception:  # noqa: BLE001 - the store is gone: the caller's own cause stands
            return
        refused = [why for why in answers if why != "ok"]
        if refused:
            raise RefitError(
                f"a rollout replica cannot load the weights: {refused[0].removeprefix('failed: ')}"
            ) from cause

    def _check_loaded(self, version: int, ranks: range) -> bool:
        """SyncFailed unless every rank loaded `version`; whether every rank can replay it."""
        answers = [self.store.get(_key(version, "loaded", r)).decode(errors="replace") for r in ranks]
        for r, why in zip(ranks, answers, strict=True):
            if not why.startswith("ok"):
                raise SyncFailed(f"{self._where()}: rank {r} could not load version {version}: {why}")
        return all(why == "ok+replay" for why in answers)

    def _set(self, key: str, payload: bytes) -> None:
        self.store.set(key, sign(self.group.secret, key, payload))

    def _handle(self, hid: int) -> tuple[str, object]:
        return share(self.buckets[hid] if hid in BUCKETS else self.shared[hid])

    def _view(self, p: Piece, dtype: torch.dtype) -> torch.Tensor:
        """The bytes piece `p` reads on this side, as `dtype`."""
        base = self.buckets[p.handle] if p.handle in BUCKETS else self.shared[p.handle]
        return base[p.offset : p.offset + (p.b - p.a) * dtype.itemsize].view(dtype)

    def _stage(self, items: list[tuple[str, torch.Tensor]], pieces: list[Piece], slot: int) -> None:
        while len(self.buckets) <= slot:
            self.buckets.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
        for p in pieces:
            t = items[p.index][1]
            copy_flat(t, p.a, p.b, self._view(p, t.dtype), into_flat=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the bucket is whole before a receiver reads

    def _release(self, live: set[int]) -> None:
        """Forget storages the new version no longer uses (the receivers drop them too, from the manifest)."""
        self.ids = {ptr: i for ptr, i in self.ids.items() if i in live}
        self.shared = {i: t for i, t in self.shared.items() if i in live}
        self.sent &= live  # a bucket the version does not use is dropped by the receivers too

    def close(self) -> None:
        self.ids.clear()
        self.shared.clear()
        self.buckets.clear()
        if self.mailbox is not None:
            self.mailbox.close()
        self.store = self._root = None  # type: ignore[assignment]  # the store stops listening


class ColocatedReceiver(_Peer):
    """Rank r > 0 of one epoch: the store it joined, and the handles it mapped."""

    def __init__(self, group: WeightSyncGroup, timeout: timedelta, device: torch.device, checksum: bool) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 cannot receive: rank 0 sends")
        if not group.secret:
            raise SyncFailed(f"the weight-sync group of epoch {group.epoch} has no secret: ask the coordinator")
        self.group, self.timeout, self.device, self.checksum = group, timeout, device, checksum
        try:
            self._root = join_store(group, timeout)
        except Exception as exc:  # noqa: BLE001 - connect errors and timeouts: rank 0 never came
            raise SyncFailed(f"joining the weight-sync store of epoch {group.epoch} failed: {exc}") from exc
        self.store = dist.PrefixStore(f"dockyard/weights/epoch-{group.epoch}", self._root)
        prove_membership(self.store, group, timeout)
        home = self._devices(device)[0]
        self.cuda_index = devices.local_cuda_index(home["uuid"]) if home["kind"] == "cuda" else None
        self.handles: dict[int, torch.Tensor] = {}
        # (version, its targets, its copies (destinations, sources), its bytes) when a repeat can replay it
        self.replay: tuple | None = None
        self.mailbox: Mailbox | None = None

    def _get(self, key: str, version: int, what: str) -> bytes:
        self._poll([key], [_key(version, "aborted")], what)
        return verify(self.group.secret, key, self.store.get(key))

    def receive(self, sink: TensorSink, version: int) -> SyncReport:
        start = time.perf_counter()
        self._quiesce()
        digest = Fingerprint() if self.checksum else None
        try:
            nbytes, repeated = self._receive(sink, version, digest)
        except Exception as exc:
            failure = self._failed(version, exc)
            if failure is exc:
                raise
            raise failure from exc
        if repeated:
            self.mailbox.answer(self.group.rank, version)
        else:
            replayable = self.replay is not None and self.replay[0] == version
            self.store.set(_key(version, "loaded", self.group.rank), "ok+replay" if replayable else "ok")
        checksum = digest.hexdigest() if digest is not None else ""
        return SyncReport(checksum, nbytes, time.perf_counter() - start)

    @property
    def can_repeat(self) -> bool:
        """Whether the next version may come as a repeat (asked in the mailbox): `receive_repeat` can take it."""
        return self.replay is not None and self.mailbox is not None

    async def receive_repeat(self, sink: TensorSink, version: int) -> SyncReport | None:
        """A repeat of `version`, on the caller's event loop with no worker thread; None when rank 0 sends it in full.

        What `receive` does for a repeat, with its two waits (rank 0's ask, the device copies) polled
        between the loop's other tasks instead of blocking a thread: a small model's refit is shorter
        than the two thread hops it would otherwise cost. A failure or a cancellation is reported to
        rank 0 as `receive` reports it; the copies already queued finish before it propagates."""
        start = time.perf_counter()
        rank = self.group.rank
        copied: torch.cuda.Event | None = None
        try:
            self._quiesce()  # while rank 0 is still on its way to the ask
            decided, repeat = self._asked(version)
            await self._spin_on_loop(decided, f"version {version}")
            if not repeat[0]:
                return None
            targets = self._launch_replay(sink)
            if self.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(self.device))
                # Polled back to back for as long as it takes: the copies are bound by the bytes, not by a peer.
                await self._spin_on_loop(copied.query, f"copying version {version}", spin_s=float("inf"))
            nbytes = self._finish_replay(version, targets)
        except BaseException as exc:
            if copied is not None:
                copied.synchronize()  # the engine's hold ends after the copies, never during them
            failure = self._failed(version, exc) if isinstance(exc, Exception) else exc
            if failure is exc:
                raise
            raise failure from exc
        self.mailbox.answer(rank, version)  # type: ignore[union-attr]
        return SyncReport("", nbytes, time.perf_counter() - start)

    def _quiesce(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.synchronize(self.device)  # kernels still reading the weights finish before they change

    def _failed(self, version: int, exc: BaseException) -> BaseException:
        """Tell rank 0 that this rank could not load `version` (store, then mailbox); the error to raise.

        A cancellation is reported too (rank 0 stops waiting at once) and raised as it is."""
        rank = self.group.rank
        try:  # rank 0 stops waiting for this rank at once, with the reason
            self.store.set(_key(version, "loaded", rank), f"failed: {str(exc) or type(exc).__name__}")
        except Exception:  # noqa: BLE001 - the store is gone with rank 0
            pass
        if self.mailbox is not None:  # after the reason: rank 0 reads it when it sees this
            self.mailbox.answer(rank, -version)
        if isinstance(exc, SyncFailed | RefitError) or not isinstance(exc, Exception):
            return exc
        return SyncFailed(f"{self._where()}: loading version {version} failed: {exc}")

    def _receive(self, sink: TensorSink, version: int, digest) -> tuple[int, bool]:
        """The bytes of `version`, and whether it was a repeat (answered in the mailbox, not the store)."""
        rank = self.group.rank
        if self.replay is not None and self.mailbox is not None and self._asked_to_repeat(version):
            return self._replay(sink, version), True
        manifest = json.loads(self._get(_key(version, "manifest"), version, f"the manifest of version {version}"))
        if manifest["version"] != version:
            raise SyncFailed(f"{self._where()}: the manifest is of version {manifest['version']}, not {version}")
        self.replay = None
        try:
            specs = [TensorSpec.from_json(item) for item in manifest["tensors"]]
            names = refit_plan(specs, sink.layout())
        except RefitError as exc:
            self.store.set(_key(version, "plan", rank), f"failed: {exc}")
            raise
        self.store.set(_key(version, "plan", rank), "ok")
        live = set(manifest["live"])
        self.handles = {h: t for h, t in self.handles.items() if h in live}
        copies: tuple[list, list] | None = ([], []) if digest is None else None
        for k in range(int(manifest["messages"])):
            body = pickle.loads(self._get(_key(version, "message", k), version, f"message {k} of version {version}"))
            if "mailbox" in body:
                if self.mailbox is not None:
                    self.mailbox.close()
                self.mailbox = Mailbox.open(body["mailbox"], self.group.world_size)
            for hid, handle in body["new"].items():
                self.handles[hid] = open_handle(handle, self.cuda_index)
            pieces = [Piece(*p) for p in body["pieces"]]
            staged = any(p.handle in BUCKETS for p in pieces)
            fast = self._load(pieces, specs, names, sink, digest, wait=staged or digest is not None)
            copies = None if copies is None or staged or len(fast[0]) < len(pieces) else _extend(copies, fast)
            if staged:  # rank 0 reuses a bucket only after this
                self.store.set(_key(version, "ack", k, rank), "ok")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the weights are whole before "loaded"
        nbytes = sum(s.nbytes for s in specs)
        if copies is not None and sink.targets is not None:  # every piece a whole-tensor copy: replayable
            self.replay = (version, _targets(sink), Replay(*copies, self.device), nbytes)
        return nbytes, False

    def _asked(self, version: int):
        """(a poll, its outcome): the poll is done once rank 0 asked for `version`, outcome[0] then tells
        a repeat (v in the mailbox) from a full send (-v: a manifest); SyncFailed when rank 0 gave up."""
        box = self.mailbox
        assert box is not None
        aborted = _key(version, "aborted")
        found: list[bool] = []
        next_check = time.monotonic() + ABORT_EVERY_S

        def decided() -> bool:
            nonlocal next_check
            if (asked := box.asked()) in (version, -version):
                found.append(asked == version)
                return True
            if (now := time.monotonic()) >= next_check:  # a store round trip: not on every poll
                next_check = now + ABORT_EVERY_S
                if self.store.check([aborted]):
                    why = self.store.get(aborted).decode(errors="replace")
                    raise SyncFailed(f"{self._where()}: version {version}: rank 0 gave up: {why}")
            return False

        return decided, found

    def _asked_to_repeat(self, version: int) -> bool:
        """Whether rank 0 asks a repeat for `version` (v in the mailbox), not a full send (-v: a manifest)."""
        decided, found = self._asked(version)
        self._spin(decided, f"version {version}")
        return found[0]

    def _replay(self, sink: TensorSink, version: int) -> int:
        """The last version's copies again (same storages on rank 0), into the same tensors on this side."""
        targets = self._launch_replay(sink)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._finish_replay(version, targets)

    def _launch_replay(self, sink: TensorSink) -> tuple | None:
        """Queue the replay's copies; the engine's tensors now (`_finish_replay` compares them)."""
        assert self.replay is not None
        self.replay[2].run()
        return _targets(sink) if sink.targets is not None else None

    def _finish_replay(self, version: int, targets: tuple | None) -> int:
        """Once the copies are done: SyncFailed unless they went into the engine's tensors; the version's bytes.

        When the engine's tensors changed, the copies went to the tensors the replay holds (kept
        alive by it, so no memory is overwritten that was freed) and the sync fails, leaving the
        engine's weights as unknown as any failed load does until the next version, which comes whole."""
        assert self.replay is not None
        previous, known, copies, nbytes = self.replay
        if targets != known:
            self.replay = None
            raise SyncFailed(f"{self._where()}: the engine's tensors changed since version {previous}: no replay")
        self.replay = (version, targets, copies, nbytes)
        return nbytes

    def _load(
        self, pieces: list[Piece], specs: list[TensorSpec], names: list[str], sink: TensorSink, digest, wait: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copy every piece into its target (cast as needed); with `wait`, wait for the copies and hash what landed.

        Returns the whole-tensor copies it made as one list of destinations and one of sources."""
        whole: list[tuple[str, torch.Tensor]] = []
        fast: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for p in pieces:
            spec = specs[p.index]
            src = self.handles[p.handle][p.offset : p.offset + (p.b - p.a) * spec.torch_dtype.itemsize]
            src = src.view(spec.torch_dtype)
            if sink.targets is None:  # a loader of whole tensors: it copies them before returning
                if (p.a, p.b) != (0, spec.numel):
                    raise SyncFailed(
                        f"{spec.name}: a loader sink takes whole tensors; "
                        f"raise cluster.weight_sync_bucket_mb above its {spec.numel * spec.torch_dtype.itemsize} bytes"
                    )
                whole.append((names[p.index], src.view(spec.shape)))
                continue
            target = sink.targets[names[p.index]]
            if (p.a, p.b) == (0, spec.numel) and target.dtype == src.dtype and target.is_contiguous():
                fast[0].append(target.view(-1))
                fast[1].append(src)
            else:
                copy_flat(target, p.a, p.b, src, into_flat=False)
        if fast[0]:
            _copy_all(*coalesce(*fast))
        if whole:
            assert sink.load is not None
            sink.load(whole)
        if not wait:
            return fast
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # done reading before the sender reuses anything
        for p in pieces if digest is not None else ():
            spec = specs[p.index]
            if sink.targets is not None and sink.targets[names[p.index]].dtype == spec.torch_dtype:
                landed = sink.targets[names[p.index]].reshape(-1)[p.a : p.b]
            else:  # cast on load (or loaded by the engine): the bytes it loaded from
                landed = self.handles[p.handle][p.offset : p.offset + (p.b - p.a) * spec.torch_dtype.itemsize]
            _hash(digest, landed)
        return fast

    def close(self) -> None:
        self.replay = None
        self.handles.clear()
        if self.mailbox is not None:
            self.mailbox.close()
        self.store = self._root = None  # type: ignore[assignment]


class ColocatedTransport(Transport):
    """Trainer (rank 0) and replicas on one device, over the epoch's store; formed again when the epoch moves."""

    name = "colocated"
    needs_group = True

    def __init__(self, timeout: timedelta, bucket_bytes: int, checksum: bool = True, device: str | None = None) -> None:
        self.timeout, self.bucket_bytes, self.checksum, self.device = timeout, bucket_bytes, checksum, device
        self.peer: ColocatedSender | ColocatedReceiver | None = None

    def _device(self) -> torch.device:
        chosen = torch.device(self.device or "cpu")
        if chosen.type == "cuda" and chosen.index is None:
            chosen = torch.device("cuda", torch.cuda.current_device())
        return chosen

    def _peer(self, group: WeightSyncGroup | None, sending: bool):
        if group is None:
            raise ValueError("the colocated transport needs a weight-sync group from the coordinator")
        if self.peer is not None and self.peer.group == group:
            return self.peer
        self.reset()
        if sending:
            self.peer = ColocatedSender(group, self.timeout, self._device(), self.bucket_bytes, self.checksum)
        else:
            self.peer = ColocatedReceiver(group, self.timeout, self._device(), self.checksum)
        return self.peer

    def send(self, tensors, version, group=None) -> SyncReport:
        return self._guard(version, lambda: self._peer(group, True).send(tensors, version))

    def receive(self, sink, version, group=None) -> SyncReport:
        return self._guard(version, lambda: self._peer(group, False).receive(sink, version))

    async def receive_on_loop(self, sink, version, group=None) -> SyncReport:
        """A repeat on the caller's loop (ColocatedReceiver.receive_repeat); anything else in a worker thread."""
        peer = self.peer
        if isinstance(peer, ColocatedReceiver) and peer.group == group and peer.can_repeat:
            try:
                report = await peer.receive_repeat(sink, version)
            except BaseException as exc:
                failure = self._failure(version, exc)
                if failure is exc:
                    raise
                raise failure from exc
            if report is not None:
                return report
        return await super().receive_on_loop(sink, version, group)

    def _guard(self, version: int, move) -> SyncReport:
        try:
            return move()
        except Exception as exc:
            failure = self._failure(version, exc)
            if failure is exc:
                raise
            raise failure from exc

    def _failure(self, version: int, exc: BaseException) -> BaseException:
        """Forget the epoch (telling the receivers why, on rank 0); the error to raise for `exc`."""
        self._abort(version, exc)
        if isinstance(exc, SyncFailed | RefitError) or not isinstance(exc, Exception):
            return exc
        return SyncFailed(f"colocated weight sync of version {version} failed: {exc}")  # store errors: peers gone

    def _abort(self, version: int, exc: BaseException) -> None:
        """Tell the receivers why (rank 0), then forget the epoch: the next sync forms the one it is given."""
        if isinstance(self.peer, ColocatedSender) and self.peer.store is not None:
            try:
                self.peer.store.set(_key(version, "aborted"), f"failed: {exc}")
                time.sleep(min(1.0, 10 * POLL_S * self.peer.group.world_size))  # the receivers read it first
            except Exception:  # noqa: BLE001 - the store is already gone
                pass
        self.reset()

    def spec(self) -> dict:
        return {
            "kind": "colocated",
            "timeout_s": self.timeout.total_seconds(),
            "bucket_bytes": self.bucket_bytes,
            "checksum": self.checksum,
        }

    def reset(self) -> None:
        if self.peer is not None:
            self.peer.close()
        self.peer = None
