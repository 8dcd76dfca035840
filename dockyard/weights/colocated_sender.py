"""Rank 0 of the colocated weight sync: hosts the epoch's store, shares its tensors' memory, stages the rest.

Guarantees:
- A contiguous tensor on the device is shared as it is (its storage's handle, once): on a GPU any,
  on CPU one that lies in a file mapped shared (handles.new_shared_file). The rest is staged, into
  at most two buckets (on CPU, files of their own, unlinked once every receiver mapped them, so no
  helper process keeps them). A bucket is reused only after every receiver acknowledged the message
  that used it, and every shared tensor stays alive until every receiver confirmed the version (the
  send returns only then).
- Every message is signed with the epoch's secret (HMAC-SHA256) before it enters the store.
- A manifest naming a tensor twice fails before anything is sent; a receiver whose refit plan
  refused the manifest makes the send raise RefitError with its reason.
- Handles are kept across versions for storages that stay the same: a steady-state sync opens no
  new handle; those the next version no longer uses are released (cast copies live one version).
- With the checksum off, a version of the same names, layouts and storages as the last one, all
  shared as they are and replayable by every receiver, is asked and answered in the mailbox only.
- A receiver that dies, stalls or fails makes the send raise SyncFailed within the timeout, with
  its reason where it gave one.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from dockyard.weights.collective import copy_flat
from dockyard.weights.colocated_peer import (
    BUCKETS,
    Given,
    Peer,
    Piece,
    hash_into,
    loaded_keys,
    sync_key,
    tensor_signature,
)
from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup, host_store, prove_membership
from dockyard.weights.handles import byte_tensor, new_shared_file, remove_file, share, shared_file_of, sign
from dockyard.weights.mailbox import Mailbox
from dockyard.weights.refit import RefitError, TensorSpec, canonical_name, refit_plan

DIRECT_PER_MESSAGE = 4 << 30  # bytes of shared tensors one message lists (messages pipeline the receiver)


class ColocatedSender(Peer):
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
        self._root = host_store(group, timeout)
        self.store = dist.PrefixStore(f"dockyard/weights/epoch-{group.epoch}", self._root)
        try:
            prove_membership(self.store, group, timeout)
            self._devices(device)
        except SyncFailed:
            self.store = self._root = None  # type: ignore[assignment]  # the store stops listening
            raise
        self.buckets: list[torch.Tensor] = []
        self.files: list[str] = []  # the CPU buckets' files not yet unlinked
        self.ids: dict[int, int] = {}  # storage -> handle id, for the storages shared as they are
        self.shared: dict[int, torch.Tensor] = {}  # handle id -> the storage's bytes (kept alive while shared)
        self.next_id = len(BUCKETS)
        self.sent: set[int] = set()  # handle ids the receivers have mapped
        self.keys: list[str] = []  # this epoch's keys of the last full version, deleted once no one reads them
        self.last_signature: list | None = None  # of the last version every receiver can replay
        self.last_given: Given | None = None  # its tensors, for the cheap check (the same objects again)
        self.last_version = -1
        self.last_nbytes = 0
        self.mailbox: Mailbox | None = None  # created with the first full version, mapped by every receiver
        self.mailbox_mapped = False

    def _direct(self, t: torch.Tensor) -> bool:
        if t.numel() == 0 or not t.is_contiguous() or t.device != self.device:
            return False
        return t.is_cuda or shared_file_of(t) is not None

    def _handle_of(self, t: torch.Tensor) -> int:
        # The storage object itself, not its data pointer.
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
        signature = None if self.checksum else [tensor_signature(n, t) for n, t in tensors]
        if signature is not None and signature == self.last_signature:
            self.last_given = Given(tensors)  # new objects of the same layout: the next check is the cheap one
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
        loaded = loaded_keys(version, ranks)
        try:
            mapped = self._send_messages(version, ranks, items, specs, messages, announce, digest)
            self._poll(loaded, loaded, f"confirming version {version}")
        except SyncFailed as exc:
            self._refused(version, ranks, exc)
            raise
        self._refused(version, ranks, None)
        replayable = self._check_loaded(version, ranks)
        self.sent = mapped
        self._unlink_buckets()  # every receiver has mapped the buckets it uses
        if announce and messages:  # every receiver has mapped it: the file can go
            self.mailbox.unlink()  # type: ignore[union-attr]
            self.mailbox_mapped = True
        repeatable = signature is not None and replayable and self.mailbox_mapped
        if repeatable and all(slot is None for _, slot in messages):
            self.last_signature, self.last_given = signature, Given(tensors)
            self.last_version = version
            self.last_nbytes = sum(s.nbytes for s in specs)
        checksum = digest.hexdigest() if digest is not None else ""
        return SyncReport(checksum, sum(s.nbytes for s in specs), time.perf_counter() - start)

    def _announce(
        self, version: int, ranks: range, specs: list[TensorSpec], messages: list[tuple[list[Piece], int | None]]
    ) -> bool:
        """The version's manifest in the store, -version in the mailbox; whether its first message names the mailbox."""
        # Buckets stay mapped for the epoch: a CPU bucket's file is gone once every receiver mapped it.
        live = sorted({p.handle for pieces, _ in messages for p in pieces} | set(BUCKETS[: len(self.buckets)]))
        self._release(set(live))
        manifest = {"version": version, "tensors": [s.to_json() for s in specs], "messages": len(messages)}
        manifest["live"] = live
        announce = self.mailbox is None or not self.mailbox_mapped
        if self.mailbox is None:
            self.mailbox = Mailbox.create(self.group.world_size)
        self._set(sync_key(version, "manifest"), json.dumps(manifest).encode())
        self.mailbox.ask(-version)  # receivers that watch the mailbox: this version is in the store
        plans = [sync_key(version, "plan", r) for r in ranks]
        self.keys = [sync_key(version, "manifest"), *loaded_keys(version, ranks), *plans]
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
        loaded = loaded_keys(version, ranks)
        for k, (pieces, slot) in enumerate(messages):
            if slot is not None:
                if slot in slot_user:  # reused only once every receiver is done with it
                    acks = [sync_key(version, "ack", slot_user[slot], r) for r in ranks]
                    self._poll(acks, loaded, f"message {slot_user[slot]} of version {version}")
                slot_user[slot] = k
                self._stage(items, pieces, slot)
                self.keys += [sync_key(version, "ack", k, r) for r in ranks]
            new = {p.handle: self._handle(p.handle) for p in pieces if p.handle not in mapped}
            body = {"new": new, "pieces": [(p.index, p.handle, p.offset, p.a, p.b) for p in pieces]}
            if k == 0 and announce:
                body["mailbox"] = self.mailbox.path  # type: ignore[union-attr]
            self._set(sync_key(version, "message", k), pickle.dumps(body))
            mapped.update(new)
            self.keys.append(sync_key(version, "message", k))
            for p in pieces if digest is not None else ():
                hash_into(digest, self._view(p, specs[p.index].torch_dtype))
        return mapped

    def _repeat(self, version: int, ranks: range, start: float) -> SyncReport:
        """Every receiver replays the last version's copies: asked and answered in the mailbox."""
        box = self.mailbox
        assert box is not None

        def answered() -> bool:
            got = box.answers()
            for r, value in zip(ranks, got, strict=True):
                if value == -version:
                    key = sync_key(version, "loaded", r)
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
                if self.store.check([k := sync_key(version, "plan", r)])
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
        answers = [self.store.get(sync_key(version, "loaded", r)).decode(errors="replace") for r in ranks]
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
            if self.device.type == "cpu":  # a file each receiver maps (unlinked once all have)
                self.buckets.append(new_shared_file(self.bucket_bytes))
                self.files.append(shared_file_of(self.buckets[-1]))
            else:
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
        self.sent &= live  # a storage the version does not use is dropped by the receivers too

    def _unlink_buckets(self) -> None:
        while self.files:
            remove_file(self.files.pop())

    def close(self) -> None:
        self._unlink_buckets()
        self.ids.clear()
        self.shared.clear()
        self.buckets.clear()
        if self.mailbox is not None:
            self.mailbox.close()
        self.store = self._root = None  # type: ignore[assignment]  # the store stops listening
