"""Whole-tensor weight sync: the protocol of engines that receive each tensor as one broadcast (SGLang).

SGLang's `update_weights_from_distributed(names, dtypes, shapes, group_name)`
receives every listed tensor as one whole broadcast from rank 0 of a process
group it forms itself (`init_weights_update_group`), so dockyard's packed
byte stream, manifest broadcast and agreement all-reduce (collective.py) do
not fit it. Over the coordinator's weight-sync group (A:P, world W, rank r,
epoch e, backend b, secret) this module speaks instead:

    per epoch  rank 0 hosts the TCPStore at A:P; every rank proves the epoch's secret under
               "dockyard/weights/epoch-e" (collective.prove_membership, as GroupMember does);
               rank 0 forms a group of backend b named N = "dockyard-P-epoch-e" over
               PrefixStore(N, store) with torch's _new_process_group_helper,
               which is what SGLang's init_custom_process_group does after its tcp:// rendezvous
               on the same store, so both sides meet on the same keys
    version v  for bucket i = 0, 1, ...: rank 0 sets ".../whole-tensor/v<v>/bucket/<i>" =
               {"version": v, "index": i, "last": bool, "tensors": [[name, dtype, shape], ...]},
               then broadcasts every tensor of the bucket whole, in that order; after the last
               bucket it waits for ".../whole-tensor/v<v>/loaded/<r>" = "ok" or "failed: <why>"
               from every rank r > 0, then deletes the version's keys (so a version sent
               again is read from its new manifests, never from a key deleted mid-read)

Guarantees (rank 0, `WholeTensorTransport.send`):
- no tensor moves and no group is formed unless every member proved the
  epoch's secret and rank 0 proved it back (a wrong secret is SyncFailed);
- every wait is bounded by the sync timeout: the store (proof, acknowledgements),
  forming the group, each broadcast; a replica that stalls or dies makes the
  send raise SyncFailed within it, never hang;
- the send returns only once every replica acknowledged the version; a replica
  that reports "failed: <why>" makes it raise SyncFailed with that reason,
  also when the failure cut a broadcast short, and at once when the replica
  could not join the process group (rank 0 does not wait out its rendezvous);
- names are checkpoint names (`canonical_name`: Hugging Face names, which
  SGLang's model `load_weights` maps onto its own fused layout), dtypes and
  shapes the sender's own; each tensor moves contiguous, whole, in the order given;
- a bucket holds whole tensors up to `bucket_bytes` (a larger tensor is a
  bucket of its own) and its manifest is written just before its broadcasts,
  so rank 0 holds at most one bucket (and one tensor) of gathered weights and
  a receiver allocates one bucket at a time;
- no digest: the receiving API reports none, so the report's checksum is empty
  on both sides and the acknowledgement is the only confirmation;
- a failed send closes the epoch's group and store; the next send forms the
  group it is given (the coordinator's next epoch).
The replica side is its engine's (services/rollout/sglang_weights.py); it
takes the keys and the manifest format from here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dockyard.weights.collective import TensorSink
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup, host_store, join_store, prove_membership
from dockyard.weights.refit import RefitError, canonical_name
from dockyard.weights.transport import Transport

Entry = tuple[str, str, list[int]]  # name, torch dtype name, shape


def group_name(group: WeightSyncGroup) -> str:
    """Unique among the live groups of one process (torch keeps one registry of names per process, and one
    trainer or rollout service serves several jobs): no two live stores share a port."""
    return f"dockyard-{group.master_port}-epoch-{group.epoch}"


def bucket_key(version: int, index: int) -> str:
    return f"whole-tensor/v{version}/bucket/{index}"


def loaded_key(version: int, rank: int) -> str:
    return f"whole-tensor/v{version}/loaded/{rank}"


def scoped(store: dist.Store, epoch: int) -> dist.Store:
    """The epoch's view of the store, where the proof, the manifests and the acknowledgements live."""
    return dist.PrefixStore(f"dockyard/weights/epoch-{epoch}", store)


def decode_bucket(raw: bytes, version: int, index: int) -> tuple[list[Entry], bool]:
    """(entries, last) of bucket `index` of `version`; SyncFailed naming what is wrong with it."""
    try:
        body = json.loads(raw)
        if (body["version"], body["index"]) != (version, index):
            raise ValueError(f"it is bucket {body['index']} of version {body['version']}")
        entries = [(str(n), str(d), [int(s) for s in shape]) for n, d, shape in body["tensors"]]
        for name, dtype, shape in entries:
            if not isinstance(getattr(torch, dtype, None), torch.dtype) or any(s < 0 for s in shape):
                raise ValueError(f"{name}: bad dtype {dtype!r} or shape {shape}")
        if not entries:
            raise ValueError("it lists no tensors")
        return entries, bool(body["last"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SyncFailed(f"the weight manifest of bucket {index} of version {version} is malformed: {exc}") from None


def join(group: WeightSyncGroup, timeout: timedelta) -> dist.Store:
    """A replica's scoped view of rank 0's store once both sides proved the epoch's secret; SyncFailed otherwise."""
    if not group.secret:
        raise SyncFailed(f"the weight-sync group of epoch {group.epoch} has no secret: take it from the coordinator")
    try:
        store = join_store(group, timeout)
    except Exception as exc:  # noqa: BLE001 - connect errors and timeouts: rank 0 never came
        raise SyncFailed(f"joining the weight-sync store of epoch {group.epoch} failed: {exc}") from exc
    view = scoped(store, group.epoch)
    prove_membership(view, group, timeout)
    return view


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[list, bool]]:
    """(bucket of (checkpoint name, tensor), is it the last), consuming `tensors` one bucket ahead at most."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((canonical_name(name), tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket, True


class WholeTensorSender:
    """Rank 0 of one epoch: the store, the proof and the process group the receivers form with it."""

    def __init__(self, group: WeightSyncGroup, timeout: timedelta, device: str | None = None) -> None:
        if group.rank != 0:
            raise ValueError(f"rank {group.rank} cannot send: rank 0 sends")
        if not group.secret:
            raise SyncFailed(f"the weight-sync group of epoch {group.epoch} has no secret: ask the coordinator")
        self.group, self.timeout = group, timeout
        self.name = group_name(group)
        if group.backend == "nccl":
            chosen = torch.device(device) if device and device.startswith("cuda") else torch.device("cuda")
            self.device = chosen if chosen.index is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.pg: Any = None
        self._root = host_store(group, timeout)
        self.store = scoped(self._root, group.epoch)
        try:
            prove_membership(self.store, group, timeout)
        except SyncFailed:
            self.store = self._root = None  # type: ignore[assignment]  # the store stops listening
            raise

    def _form(self, version: int) -> None:
        """The process group, formed with the receivers (gloo: a rendezvous bounded by the timeout).

        The rendezvous runs on a thread while this one watches the replicas'
        acknowledgements on a store connection of its own: a replica that
        cannot join says why at once, and its reason is read before a timed-out
        rendezvous could leave the shared connection out of step.
        """
        if self.name in c10d._world.pg_names.values():
            raise SyncFailed(f"a process group named {self.name!r} is still open in this trainer")
        formed: dict[str, Any] = {}

        def rendezvous() -> None:
            try:
                formed["pg"], _ = c10d._new_process_group_helper(
                    self.group.world_size,
                    0,
                    [],
                    dist.Backend(self.group.backend),
                    dist.PrefixStore(self.name, self._root),
                    group_name=self.name,
                    timeout=self.timeout,
                )
            except Exception as exc:  # noqa: BLE001 - the rendezvous timed out, or the backend refused
                formed["error"] = exc

        thread = threading.Thread(target=rendezvous, name=f"{self.name}-rendezvous", daemon=True)
        thread.start()
        watch = scoped(
            dist.TCPStore(self.group.master_address, self.group.master_port, is_master=False, timeout=self.timeout),
            self.group.epoch,
        )
        while thread.is_alive():
            thread.join(0.05)
            self._raise_if_failed(version, watch)  # the rendezvous ends at its own timeout, unused
        if "error" in formed:
            self._raise_if_failed(version, watch)
            raise SyncFailed(self._why(f"forming the process group {self.name!r}", formed["error"]))
        pg = formed["pg"]
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.group.world_size)}  # as SGLang registers its own
        self.pg = pg

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> SyncReport:
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # each send may run on another worker thread
        if self.pg is None:
            self._form(version)
        seen: set[str] = set()
        sent: list[str] = []
        total = index = 0
        for bucket, last in buckets(tensors, bucket_bytes):
            self._raise_if_failed(version)
            moving = [(n, t.to(self.device).contiguous()) for n, t in bucket]
            duplicates = [n for n, _ in moving if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
            if duplicates:
                raise RefitError(f"weight layouts differ: the trainer sends {duplicates[:3]} more than once")
            entries = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in moving]
            manifest = {"version": version, "index": index, "last": last, "tensors": entries}
            self.store.set(bucket_key(version, index), json.dumps(manifest))
            sent.append(bucket_key(version, index))
            try:
                works = [self.pg.broadcast(t, 0) for _, t in moving]
                for work in works:
                    self._wait(work)
            except Exception as exc:  # noqa: BLE001 - a receiver gave up, died or stalled
                self._raise_if_failed(version)  # its own reason, where it gave one
                raise SyncFailed(self._why(f"broadcasting bucket {index} of version {version}", exc)) from exc
            total += sum(t.numel() * t.element_size() for _, t in moving)
            index += 1
        if index == 0:
            raise RefitError("the trainer has no weights to send")
        self._await_acknowledgements(version)
        # Dropped only now, when every replica has read them: a replica may ask for the first
        # manifest of a version sent again before this send starts, and a key deleted between
        # its wait and its get would read as empty.
        for key in sent + [loaded_key(version, r) for r in range(1, self.group.world_size)]:
            self.store.delete_key(key)
        return SyncReport("", total, time.perf_counter() - start)

    def _wait(self, work: dist.Work) -> None:
        if self.device.type != "cuda":
            work.wait()  # gloo: bounded by the group's timeout
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():  # NCCL: poll against our own deadline
            if time.monotonic() > deadline:
                raise TimeoutError("no completion")
            time.sleep(50e-6)
        work.wait()

    def _replies(self, version: int, ranks: Iterable[int], store: dist.Store | None = None) -> dict[int, str]:
        """The acknowledgements of `version` given so far, by rank (none where the store cannot tell)."""
        store = store or self.store
        keys = {r: loaded_key(version, r) for r in ranks}
        try:
            return {r: store.get(k).decode(errors="replace") for r, k in keys.items() if store.check([k])}
        except Exception:  # noqa: BLE001 - the store is gone: the caller reports its own cause
            return {}

    def _raise_if_failed(self, version: int, store: dist.Store | None = None) -> None:
        replies = self._replies(version, range(1, self.group.world_size), store)
        failed = {r: why for r, why in replies.items() if why != "ok"}
        if failed:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            raise SyncFailed(
                f"weight-sync group epoch {self.group.epoch}: a replica could not load version {version}: {reasons}"
            )

    def _await_acknowledgements(self, version: int) -> None:
        ranks = range(1, self.group.world_size)
        try:
            self.store.wait([loaded_key(version, r) for r in ranks], self.timeout)
        except Exception as exc:  # noqa: BLE001 - the store's timeout, or the store gone
            silent = sorted(set(ranks) - set(self._replies(version, ranks)))
            raise SyncFailed(self._why(f"waiting for rank(s) {silent} to confirm version {version}", exc)) from exc
        self._raise_if_failed(version)

    def _why(self, what: str, cause: object) -> str:
        return (
            f"weight-sync group epoch {self.group.epoch}, rank 0: {what} failed or timed out after at most "
            f"{self.timeout.total_seconds():g}s (a replica died or stalled): {cause}"
        )

    def close(self) -> None:
        """Destroy the process group (its name is free again) and stop the store."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                if self.device.type == "cuda":
                    pg.abort()  # a communicator stuck on a dead peer
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - a peer already gone: forget the group all the same
                c10d._world.pg_names.pop(pg, None)
        self.store = self._root = None  # type: ignore[assignment]


class WholeTensorTransport(Transport):
    """The trainer's side of the whole-tensor protocol; replicas receive through their engine, not a transport."""

    name = "whole_tensor"
    needs_group = True

    def __init__(self, timeout: timedelta, bucket_bytes: int, device: str | None = None) -> None:
        self.timeout, self.bucket_bytes, self.device = timeout, bucket_bytes, device
        self.sender: WholeTensorSender | None = None

    def send(self, tensors, version, group=None) -> SyncReport:
        if group is None:
            raise ValueError("the whole-tensor transport needs a weight-sync group from the coordinator")
        try:
            if self.sender is None or self.sender.group != group:
                self.reset()
                self.sender = WholeTensorSender(group, self.timeout, self.device)
            return self.sender.send(tensors, version, self.bucket_bytes)
        except (SyncFailed, RefitError):
            self.reset()
            raise
        except Exception as exc:  # noqa: BLE001 - store errors: the peers never came or went away
            self.reset()
            raise SyncFailed(f"whole-tensor weight sync of version {version} failed: {exc}") from exc

    def receive(self, sink: TensorSink, version: int, group: WeightSyncGroup | None = None) -> SyncReport:
        raise SyncFailed("whole-tensor weights are received by the engine itself (SGLang), not through a transport")

    def spec(self) -> dict:
        return {"kind": "whole_tensor", "timeout_s": self.timeout.total_seconds(), "bucket_bytes": self.bucket_bytes}

    def reset(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None
