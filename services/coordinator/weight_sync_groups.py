"""Weight-sync group membership and epochs of every job, as the coordinator hands them out.

    job created ──open──> epoch 0: trainer (rank 0) + the deployed replica "rollout" (rank 1)
    job recovered by a restarted coordinator ──open──> the stored epoch + 1, same members
    a new replica asks ──> joins: epoch + 1, ranks 1..N in join order
    a replica leaves   ──> epoch + 1 without it
    set_replicas(names) ──> epoch + 1 with exactly those replicas (when that changes the membership):
                            the runner names the replicas of each sync before it starts
    a member reports failed_epoch == current ──> epoch + 1 (same members, fresh port)
    every epoch ──> a fresh random secret, handed to members by get() only

Guarantees: every change of membership and every reported failure forms a
new group (epoch + 1, a port no earlier epoch of the job used unless a fixed
port is configured, a new secret), so members never mix two epochs' rendezvous; two members
reporting the same failed epoch move the group on once; the trainer is
always rank 0 and hosts the store. The secret is in the group that get()
returns to a member only (GetWeightSyncGroup, an authenticated RPC); every
other answer carries the group without it.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from dockyard.api.common.v1 import common_pb2
from dockyard.rpc.settings import member_name_pattern

TRAINER = "trainer"
REPLICA = re.compile(member_name_pattern("rollout"))


class MembershipError(ValueError):
    """A member name that is neither the trainer nor a rollout replica."""


def new_secret() -> str:
    return secrets.token_hex(32)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_member(member: str, *, replica_only: bool = False) -> None:
    if member == TRAINER and not replica_only:
        return
    if not REPLICA.match(member):
        allowed = "a rollout replica" if replica_only else "trainer or a rollout replica"
        raise MembershipError(f"member must be {allowed} ('rollout' or 'rollout-<name>'), not {member!r}")


@dataclass
class _Group:
    backend: str
    replicas: list[str] = field(default_factory=lambda: ["rollout"])
    epoch: int = 0
    port: int = 0
    secret: str = field(default_factory=new_secret)


class WeightSyncGroups:
    """Every job's weight-sync group: members, ranks, epoch and store port (GetWeightSyncGroup answers from it)."""

    def __init__(self, address: str, port: int = 0, port_fn: Callable[[str], int] = free_port) -> None:
        self.address = address
        self.fixed_port = port
        self._port_fn = port_fn
        self._groups: dict[str, _Group] = {}

    def _new_port(self) -> int:
        return self.fixed_port or self._port_fn(self.address)

    def open(self, job_id: str, backend: str, epoch: int = 0) -> None:
        """A job's group at `epoch` (a recovered job passes one beyond any it used before)."""
        if job_id not in self._groups:
            self._groups[job_id] = _Group(backend=backend, epoch=epoch, port=self._new_port())

    def drop(self, job_id: str) -> None:
        self._groups.pop(job_id, None)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._groups

    def reform(self, job_id: str) -> common_pb2.WeightSyncGroup:
        """The same members on a new epoch: after a member restarted (its old group is dead)."""
        group = self._groups[job_id]
        self._reform(group)
        return self._proto(group)

    def _reform(self, group: _Group) -> None:
        group.epoch += 1
        group.port = self._new_port()
        group.secret = new_secret()

    def _proto(self, group: _Group) -> common_pb2.WeightSyncGroup:
        return common_pb2.WeightSyncGroup(
            master_address=self.address,
            master_port=group.port,
            world_size=1 + len(group.replicas),
            epoch=group.epoch,
            backend=group.backend,
        )

    def get(self, job_id: str, member: str, failed_epoch: int | None = None) -> tuple[common_pb2.WeightSyncGroup, int]:
        """The group (secret included) and the member's rank; a new replica joins; a failed current epoch re-forms."""
        check_member(member)
        group = self._groups[job_id]
        if member != TRAINER and member not in group.replicas:
            group.replicas.append(member)
            self._reform(group)
        elif failed_epoch is not None and failed_epoch == group.epoch:
            self._reform(group)
        rank = 0 if member == TRAINER else 1 + group.replicas.index(member)
        proto = self._proto(group)
        proto.secret = group.secret
        return proto, rank

    def set_replicas(self, job_id: str, names: list[str]) -> common_pb2.WeightSyncGroup:
        """Make the replicas of the job's group exactly `names` (ranks 1..N in that order)."""
        for name in names:
            check_member(name, replica_only=True)
        group = self._groups[job_id]
        if group.replicas != list(names):
            group.replicas = list(names)
            self._reform(group)
        return self._proto(group)

    def leave(self, job_id: str, member: str) -> common_pb2.WeightSyncGroup:
        check_member(member, replica_only=True)
        group = self._groups[job_id]
        if member in group.replicas:
            group.replicas.remove(member)
            self._reform(group)
        return self._proto(group)
