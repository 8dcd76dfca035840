"""The weight-sync group of one epoch: what the coordinator hands out, the store, the proof of the
epoch's secret, and one member's collectives, each wait bounded by the group's timeout.

The weight-sync group is a standalone ProcessGroupGloo/NCCL built on its own TCPStore, so it never
touches the default process group that FSDP uses. Before the process group is formed, every member
proves it holds the epoch's secret (the coordinator hands it out with the group):

    rank 0: store bound to master_address ── challenge (random) ──> ranks 1..N
    rank r: proof/r = HMAC(secret, member|epoch|r|challenge) ──> rank 0 checks every proof
    rank 0: verdict = HMAC(secret, host|epoch|challenge), or "rejected" ──> rank r checks it
    all proofs good: the process group is formed on the same store

Guarantees:
- The store listens on `master_address` only (not every interface); only
  where that name is no address of this host (a name that forwards here, such
  as a Kubernetes Service) does it listen on every interface, with a warning.
- An NCCL group is not formed when two ranks report the same GPU (devices.py): every
  rank fails with SyncFailed naming the fix (the colocated transport) instead.
- No tensor moves and no process group is formed unless every rank proved
  knowledge of the epoch's secret to rank 0 and rank 0 proved it back: a
  member with another secret, or a stranger on the store, makes forming the
  group raise SyncFailed on every rank that takes part. The store itself has
  no access control (a client that reaches it can read and disturb its keys),
  so the bind address is what keeps strangers off it; a stranger that writes the
  proof's keys anyway (challenge, proofs, verdict, seen marks) can make forming
  the group fail, with SyncFailed on every honest rank within the bounded waits
  (a rank that passed the proof while its peer gave up fails forming the process
  group), but never makes an honest rank accept it (tests/unit/weights/test_store_tampering.py).
- Every wait of a member's collectives has the group's timeout: a peer that dies or stalls makes it
  raise SyncFailed within the timeout, never hang; a group that failed is closed (communicator
  aborted) and must be formed again (a new epoch).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

REJECTED = b"rejected"

log = structlog.get_logger()


class SyncFailed(RuntimeError):
    """A collective failed or timed out: the group is unusable and must be formed again."""


@dataclass(frozen=True)
class WeightSyncGroup:
    master_address: str
    master_port: int
    world_size: int
    rank: int
    epoch: int
    backend: str = "gloo"
    # The epoch's shared secret that every member proves it holds; never logged.
    secret: str = field(kw_only=True, repr=False)


@dataclass(frozen=True)
class SyncReport:
    checksum: str
    num_bytes: int
    seconds: float


class GroupMember:
    """One member's handle on the weight-sync group of one epoch."""

    def __init__(
        self, group: WeightSyncGroup, timeout: timedelta = timedelta(seconds=120), device: str | None = None
    ) -> None:
        """`device`: the GPU of an NCCL member ("cuda:1"); default the calling thread's current one."""
        if not group.secret:
            raise ValueError(
                f"the weight-sync group of epoch {group.epoch} has no secret: take it from the coordinator"
            )
        self.group = group
        self.timeout = timeout
        # rank 0 hosts the store; everyone else connects to it (bounded by the timeout).
        self._store = host_store(group, timeout) if group.rank == 0 else join_store(group, timeout)
        store = dist.PrefixStore(f"dockyard/weights/epoch-{group.epoch}", self._store)
        try:
            prove_membership(store, group, timeout)
        except SyncFailed:
            self._store = None  # type: ignore[assignment]  # rank 0: the store stops listening
            raise
        try:
            self.pg = self._form(store, device)
        except (SyncFailed, ValueError):
            self._store = None  # type: ignore[assignment]
            raise
        except Exception as exc:  # noqa: BLE001 - the store's timeout or a backend error: no group
            self._store = None  # type: ignore[assignment]
            # A peer that gave up on the proof (a stranger's verdict on the store, say) never comes.
            raise SyncFailed(
                f"weight-sync group epoch {group.epoch}, rank {group.rank}: forming the process group failed or "
                f"timed out after at most {timeout.total_seconds():g}s (a peer gave up, died or stalled): {exc}"
            ) from exc

    def _form(self, store: dist.Store, device: str | None):
        """The process group on the proven store; sets self.device."""
        group, timeout = self.group, self.timeout
        if group.backend == "gloo":
            self.device = torch.device("cpu")
            return dist.ProcessGroupGloo(store, group.rank, group.world_size, timeout)
        if group.backend == "nccl":
            chosen = torch.device(device) if device and device.startswith("cuda") else torch.device("cuda")
            self.device = chosen if chosen.index is not None else torch.device("cuda", torch.cuda.current_device())
            _distinct_gpus(store, group, self.device, timeout)
            options = dist.ProcessGroupNCCL.Options()
            # Our own waits time out first and abort the communicator; the
            # watchdog's later timeout is only a backstop.
            options._timeout = timeout * 2 + timedelta(seconds=30)
            return dist.ProcessGroupNCCL(store, group.rank, group.world_size, options)
        raise ValueError(f"unknown weight-sync group backend {group.backend!r}: use gloo or nccl")

    @property
    def rank(self) -> int:
        return self.group.rank

    def _fail(self, what: str, cause: object) -> SyncFailed:
        return SyncFailed(
            f"weight-sync group epoch {self.group.epoch}, rank {self.rank}: {what} failed or timed out "
            f"after at most {self.timeout.total_seconds():g}s (a peer died or stalled): {cause}"
        )

    def wait(self, work: dist.Work, what: str) -> None:
        """Block the CPU until `work` is done, or raise SyncFailed once the timeout has passed."""
        try:
            if self.device.type != "cuda":
                work.wait()  # gloo: bounded by the group's timeout
                return
            # NCCL's own timed wait sleeps in coarse steps; poll finely against our deadline instead.
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("no completion")
                time.sleep(50e-6)
            work.wait()
        except SyncFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error means the same: the group is gone
            raise self._fail(what, exc) from exc

    def order(self, work: dist.Work, what: str) -> None:
        """Make later work on this device wait for `work`: the CPU runs on (CUDA streams), or waits (gloo)."""
        if self.device.type == "cuda":
            work.wait()  # the current stream waits for the collective; the CPU does not
        else:
            self.wait(work, what)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        try:
            return self.pg.broadcast(tensor, 0)
        except Exception as exc:  # noqa: BLE001
            raise SyncFailed(f"weight-sync group epoch {self.group.epoch}, rank {self.rank}: broadcast: {exc}") from exc

    def broadcast(self, tensor: torch.Tensor, what: str = "broadcast") -> None:
        self.wait(self.broadcast_async(tensor), what)

    def all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        try:
            work = self.pg.allreduce([flag], opts)
        except Exception as exc:  # noqa: BLE001
            raise SyncFailed(f"weight-sync group epoch {self.group.epoch}: all-reduce: {exc}") from exc
        self.wait(work, "agreement all-reduce")
        return bool(flag.item())

    def close(self) -> None:
        """Release the communicator (aborting one stuck on a dead peer) and, on rank 0, the store."""
        if self.pg is not None:
            for name in ("abort", "shutdown"):
                try:
                    getattr(self.pg, name)()
                    break
                except (AttributeError, RuntimeError):
                    continue  # not offered by this backend, or a peer already gone
        self.pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _distinct_gpus(store: dist.Store, group: WeightSyncGroup, device: torch.device, timeout: timedelta) -> None:
    """SyncFailed on every rank, naming the fix, when two ranks share a GPU (NCCL would fail obscurely)."""
    from dockyard.weights import devices

    try:
        devices.distinct_gpus(devices.exchange(store, group.rank, group.world_size, device, timeout))
    except devices.DeviceMismatch as exc:
        raise SyncFailed(f"weight-sync group epoch {group.epoch}, rank {group.rank}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the store's timeout: a peer never came
        raise SyncFailed(f"weight-sync group epoch {group.epoch}: exchanging devices failed: {exc}") from exc


def host_store(group: WeightSyncGroup, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, listening on `master_address` (TCPStore alone would listen on every interface)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        group.master_address, group.master_port, type=socket.SOCK_STREAM
    )[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port is reused by every epoch
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            log.warning(
                "the weight-sync store address is no address of this host: listening on every interface",
                master_address=group.master_address,
                port=group.master_port,
            )
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", group.master_port))
        # The store owns (and closes) its own descriptor of the bound socket.
        return dist.TCPStore(
            group.master_address,
            sock.getsockname()[1],
            group.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.dup().detach(),
        )


def join_store(group: WeightSyncGroup, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(group.master_address, group.master_port, group.world_size, is_master=False, timeout=timeout)


def _mac(group: WeightSyncGroup, *parts: object) -> bytes:
    message = "|".join(str(p) for p in (group.epoch, *parts)).encode()
    return hmac.new(group.secret.encode(), message, hashlib.sha256).hexdigest().encode()


def prove_membership(store: dist.Store, group: WeightSyncGroup, timeout: timedelta) -> None:
    """Every rank shows rank 0 it holds the epoch's secret, and rank 0 shows it back; SyncFailed otherwise."""
    where = f"weight-sync group epoch {group.epoch}, rank {group.rank}"
    try:
        if group.rank == 0:
            _check_members(store, group, timeout, where)
            return
        challenge = store.get("challenge")
        store.set(f"proof/{group.rank}", _mac(group, "member", group.rank, challenge.decode()))
        verdict = store.get("verdict")
        store.set(f"seen/{group.rank}", b"1")
    except SyncFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - a store error or timeout: the peers never proved anything
        raise SyncFailed(f"{where}: proving membership failed or timed out: {exc}") from exc
    if verdict == REJECTED:
        raise SyncFailed(f"{where}: rank 0 rejected a member that could not prove it belongs to the epoch")
    if not hmac.compare_digest(verdict, _mac(group, "host", challenge.decode())):
        raise SyncFailed(f"{where}: the store's host could not prove it belongs to the epoch (wrong secret)")


def _check_members(store: dist.Store, group: WeightSyncGroup, timeout: timedelta, where: str) -> None:
    challenge = secrets.token_hex(32)
    store.set("challenge", challenge)
    ranks = range(1, group.world_size)
    strangers = [
        r for r in ranks if not hmac.compare_digest(store.get(f"proof/{r}"), _mac(group, "member", r, challenge))
    ]
    if not strangers:
        store.set("verdict", _mac(group, "host", challenge))
        return
    store.set("verdict", REJECTED)
    with contextlib.suppress(Exception):  # keep the store up until the ranks have read why (bounded)
        store.wait([f"seen/{r}" for r in ranks], timeout)
    raise SyncFailed(
        f"{where}: rank(s) {strangers} could not prove they belong to the epoch (wrong secret): the group is not formed"
    )
