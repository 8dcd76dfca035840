"""Weights from an engine's driver worker to its other tensor-parallel workers, each loading its own shard.

    trainer ──transport (weight-sync group rank of the replica)──> driver worker (tensor-parallel rank 0)
        driver, per batch of whole tensors: {"op": "load", names, tensors} ──engine's TP group──> workers 1..N-1
                                            then loads them itself
        driver, once the transport returned: {"op": "done", trainer's checksum, relay fingerprint, counts}
              or, when the transport failed:  {"op": "abort", error}
    every worker: model.load_weights(whole tensors) ─> its shard of each tensor (vLLM's weight loaders cut them)

One replica stays one member of the weight-sync group whatever its tensor-parallel size, so the
coordinator, the trainer and the version protocol are unchanged. `broadcast` is the engine's
collective over its tensor-parallel group with the signature of vLLM's
`GroupCoordinator.broadcast_tensor_dict`: the source passes a dict (tensors and plain values),
every other rank passes None and gets that dict back.

Guarantees:
- Every worker loads every tensor the transport delivered, whole, in the driver's order (each
  worker's weight loaders keep the shard of its rank).
- The checksum a worker reports is the transport's checksum of what the trainer sent (the
  coordinator compares it with the trainer's), and a follower reports it only when its own
  fingerprint of the tensors it received equals the driver's of the tensors it relayed, and its
  tensor and byte counts equal the driver's (fingerprint.py; skipped with the checksum off):
  else SyncFailed.
- A follower that fails to load keeps draining the relay until the driver's last message, so the
  group stays in step, then raises; a driver whose transport failed sends "abort", so no follower
  waits for tensors that will not come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dockyard.weights.fingerprint import Fingerprint
from dockyard.weights.group import SyncFailed, SyncReport

Broadcast = Callable[[dict[str, Any] | None], dict[str, Any]]
Load = Callable[[list[tuple[str, torch.Tensor]]], None]


def reply(report: SyncReport, tensors: int) -> dict[str, Any]:
    """What a worker answers the engine: the transport's report and how many tensors it loaded."""
    return {"checksum": report.checksum, "num_bytes": report.num_bytes, "seconds": report.seconds, "tensors": tensors}


class DriverRelay:
    """The driver's side: a TensorSink loader that relays each batch before loading it here."""

    def __init__(self, broadcast: Broadcast, load: Load, checksum: bool) -> None:
        self._broadcast, self._load, self._checksum = broadcast, load, checksum
        self._digest = Fingerprint()
        self.tensors = 0
        self.relayed_bytes = 0

    def load(self, items: list[tuple[str, torch.Tensor]]) -> None:
        tensors = [t.contiguous() for _, t in items]  # a collective moves contiguous storage
        message: dict[str, Any] = {"op": "load", "names": [n for n, _ in items]}
        message.update({f"t{i}": t for i, t in enumerate(tensors)})
        self._broadcast(message)  # first, so the followers load while this worker does
        for t in tensors:
            if self._checksum:
                self._digest.update(t)
            self.relayed_bytes += t.nbytes
        self.tensors += len(tensors)
        self._load(list(zip((n for n, _ in items), tensors, strict=True)))

    def done(self, report: SyncReport) -> dict[str, Any]:
        """Tell the followers the transport finished; this worker's reply."""
        self._broadcast(
            {
                "op": "done",
                "checksum": report.checksum,
                "num_bytes": report.num_bytes,
                "seconds": report.seconds,
                "relayed": self._digest.hexdigest() if self._checksum else "",
                "relayed_bytes": self.relayed_bytes,
                "tensors": self.tensors,
            }
        )
        return reply(report, self.tensors)

    def abort(self, error: BaseException) -> None:
        """Tell the followers the transport failed (they raise SyncFailed naming `error`)."""
        self._broadcast({"op": "abort", "error": f"{type(error).__name__}: {error}"})


def follow(broadcast: Broadcast, load: Load, checksum: bool, rank: int) -> dict[str, Any]:
    """A follower's side: load every relayed batch until the driver's "done" (its reply) or "abort" (SyncFailed)."""
    digest, tensors, received = Fingerprint(), 0, 0
    failure: BaseException | None = None
    while True:
        message = broadcast(None)
        op = message.get("op")
        if op == "load":
            names = message["names"]
            batch = [(name, message[f"t{i}"]) for i, name in enumerate(names)]
            for _, t in batch:
                if checksum:
                    digest.update(t)
                received += t.nbytes
            tensors += len(batch)
            if failure is None:
                try:
                    load(batch)
                except Exception as exc:  # noqa: BLE001 - drained to the end, then raised
                    failure = exc
        elif op == "abort":
            raise SyncFailed(f"tensor-parallel worker {rank}: the driver worker failed to receive: {message['error']}")
        elif op == "done":
            if failure is not None:
                raise SyncFailed(f"tensor-parallel worker {rank} failed to load its shard: {failure}") from failure
            _check(message, digest.hexdigest() if checksum else "", tensors, received, rank)
            report = SyncReport(message["checksum"], int(message["num_bytes"]), float(message["seconds"]))
            return reply(report, tensors)
        else:
            raise SyncFailed(f"tensor-parallel worker {rank}: unknown relay message {op!r}")


def _check(done: dict[str, Any], relayed: str, tensors: int, received: int, rank: int) -> None:
    if (tensors, received) != (done["tensors"], done["relayed_bytes"]):
        raise SyncFailed(
            f"tensor-parallel worker {rank} received {tensors} tensors ({received} bytes), "
            f"the driver relayed {done['tensors']} ({done['relayed_bytes']} bytes)"
        )
    if relayed != done["relayed"]:
        raise SyncFailed(f"tensor-parallel worker {rank} holds other bytes than the driver relayed (fingerprint)")


def agreed_report(replies: list[dict[str, Any]]) -> SyncReport:
    """The driver's report once every worker loaded the same checksum and tensor count; else SyncFailed naming
    each worker that failed (a reply {"error": ...}) or differs from the driver."""
    failed = [f"worker {rank}: {answer['error']}" for rank, answer in enumerate(replies) if "error" in answer]
    if failed or not replies:
        raise SyncFailed("; ".join(failed) or "no worker answered")
    first = replies[0]
    for rank, answer in enumerate(replies[1:], start=1):
        if (answer["checksum"], answer["tensors"]) != (first["checksum"], first["tensors"]):
            raise SyncFailed(
                f"worker {rank} loaded {answer['tensors']} tensors with checksum {answer['checksum'][:12]}, "
                f"the driver {first['tensors']} with {first['checksum'][:12]}"
            )
    return SyncReport(first["checksum"], int(first["num_bytes"]), float(first["seconds"]))
