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
The transport takes one side per epoch: rank 0 the sender (colocated_sender.py), every other rank
a receiver (colocated_receiver.py); both take the keys, pieces, copies and waits of the protocol
from colocated_peer.py, which keeps them in step.

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
- A sync that fails forgets the epoch (rank 0 first tells the receivers why): the next sync forms
  the one it is given.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from dockyard.weights.colocated_peer import POLL_S, sync_key
from dockyard.weights.colocated_receiver import ColocatedReceiver
from dockyard.weights.colocated_sender import ColocatedSender
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.refit import RefitError
from dockyard.weights.transport import Transport


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
                self.peer.store.set(sync_key(version, "aborted"), f"failed: {exc}")
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
