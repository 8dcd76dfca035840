"""Rank r > 0 of the colocated weight sync: joins the epoch's store, maps rank 0's handles, copies into its engine.

Guarantees:
- On CUDA it copies device to device through CUDA IPC handles, out of the trainer's memory or a
  staging bucket: the weights never cross the host.
- It unpickles only a message whose signature with the epoch's secret holds: a stranger on the
  store cannot make it run code, and a corrupted message fails the sync.
- It answers refit_plan on the manifest before it copies a byte, casts on load, and (checksum on)
  fingerprints what landed in its tensors, piece by piece in message order.
- A message that used a bucket is acknowledged only once its copies are done, and "loaded" only
  once the weights are whole; handles the next version no longer uses are released.
- A repeat copies into the same tensors or fails when the engine's tensors changed; taken on an
  event loop (receive_repeat) it never blocks the loop, and a failure or a cancellation there is
  reported to rank 0 as `receive` reports it, once the copies it queued are done.
- A sender that dies or fails makes the receive raise SyncFailed within the timeout.
"""

from __future__ import annotations

import json
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dockyard.weights import devices
from dockyard.weights.arena import coalesce
from dockyard.weights.collective import TensorSink, copy_flat
from dockyard.weights.colocated_peer import (
    BUCKETS,
    Peer,
    Piece,
    Replay,
    copy_all,
    extend,
    hash_into,
    sink_targets,
    sync_key,
)
from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup, join_store, prove_membership
from dockyard.weights.handles import open_handle, verify
from dockyard.weights.mailbox import Mailbox
from dockyard.weights.refit import RefitError, TensorSpec, refit_plan

ABORT_EVERY_S = 2e-3  # a receiver waiting on the mailbox looks for rank 0's abort in the store this often


class ColocatedReceiver(Peer):
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
        self._poll([key], [sync_key(version, "aborted")], what)
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
            self.store.set(sync_key(version, "loaded", self.group.rank), "ok+replay" if replayable else "ok")
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
            self.store.set(sync_key(version, "loaded", rank), f"failed: {str(exc) or type(exc).__name__}")
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
        manifest = json.loads(self._get(sync_key(version, "manifest"), version, f"the manifest of version {version}"))
        if manifest["version"] != version:
            raise SyncFailed(f"{self._where()}: the manifest is of version {manifest['version']}, not {version}")
        self.replay = None
        try:
            specs = [TensorSpec.from_json(item) for item in manifest["tensors"]]
            names = refit_plan(specs, sink.layout())
        except RefitError as exc:
            self.store.set(sync_key(version, "plan", rank), f"failed: {exc}")
            raise
        self.store.set(sync_key(version, "plan", rank), "ok")
        live = set(manifest["live"])
        self.handles = {h: t for h, t in self.handles.items() if h in live}
        copies: tuple[list, list] | None = ([], []) if digest is None else None
        for k in range(int(manifest["messages"])):
            body = pickle.loads(
                self._get(sync_key(version, "message", k), version, f"message {k} of version {version}")
            )
            if "mailbox" in body:
                if self.mailbox is not None:
                    self.mailbox.close()
                self.mailbox = Mailbox.open(body["mailbox"], self.group.world_size)
            for hid, handle in body["new"].items():
                self.handles[hid] = open_handle(handle, self.cuda_index)
            pieces = [Piece(*p) for p in body["pieces"]]
            staged = any(p.handle in BUCKETS for p in pieces)
            fast = self._load(pieces, specs, names, sink, digest, wait=staged or digest is not None)
            copies = None if copies is None or staged or len(fast[0]) < len(pieces) else extend(copies, fast)
            if staged:  # rank 0 reuses a bucket only after this
                self.store.set(sync_key(version, "ack", k, rank), "ok")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the weights are whole before "loaded"
        nbytes = sum(s.nbytes for s in specs)
        if copies is not None and sink.targets is not None:  # every piece a whole-tensor copy: replayable
            self.replay = (version, sink_targets(sink), Replay(*copies, self.device), nbytes)
        return nbytes, False

    def _asked(self, version: int):
        """(a poll, its outcome): the poll is done once rank 0 asked for `version`, outcome[0] then tells
        a repeat (v in the mailbox) from a full send (-v: a manifest); SyncFailed when rank 0 gave up."""
        box = self.mailbox
        assert box is not None
        aborted = sync_key(version, "aborted")
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
        return sink_targets(sink) if sink.targets is not None else None

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
            copy_all(*coalesce(*fast))
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
            hash_into(digest, landed)
        return fast

    def close(self) -> None:
        self.replay = None
        self.handles.clear()
        if self.mailbox is not None:
            self.mailbox.close()
        self.store = self._root = None  # type: ignore[assignment]
