"""The weight-sync store listens on the configured address only, and only members that hold the
epoch's secret form the group: a member with another secret, or a stranger on the store, can
neither complete a sync nor read the weights."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.weights.collective import receive_weights, send_weights
from dockyard.weights.group import GroupMember, SyncFailed, WeightSyncGroup
from dockyard.weights.group_source import coordinator_group_source
from tests.conftest import free_port
from tests.unit.weights.test_collective import run_pair

TIMEOUT = timedelta(seconds=10)


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("layer.w", torch.arange(1, 65, dtype=torch.float32).view(8, 8))]


def _member_with(secrets: tuple[str, str]):
    def member(rank: int, port: int, out) -> None:
        group = WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=4, secret=secrets[rank])
        targets = {"layer.w": torch.zeros(8, 8)}
        try:
            member = GroupMember(group, TIMEOUT)
            if rank == 0:
                send_weights(member, _weights(), 1 << 20)
            else:
                receive_weights(member, targets)
            out.put((rank, "ok", "", targets["layer.w"].abs().sum().item()))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.put((rank, type(exc).__name__, str(exc), targets["layer.w"].abs().sum().item()))

    return member


def _right_secret(rank, port, out) -> None:
    _member_with(("the epoch's secret", "the epoch's secret"))(rank, port, out)


def _wrong_secret(rank, port, out) -> None:
    _member_with(("the epoch's secret", "a guess"))(rank, port, out)


def test_members_with_the_epochs_secret_sync() -> None:
    results = run_pair(_right_secret)
    assert results[0][0] == results[1][0] == "ok", results
    assert results[1][2] == _weights()[0][1].sum().item()


def test_a_member_without_the_secret_forms_no_group_and_receives_nothing() -> None:
    results = run_pair(_wrong_secret)
    assert results[0][0] == "SyncFailed" and "rank(s) [1] could not prove" in results[0][1], results
    assert results[1][0] == "SyncFailed" and "rank 0 rejected" in results[1][1], results
    assert results[1][2] == 0.0  # not one weight arrived


def test_a_stranger_on_the_store_cannot_complete_the_sync() -> None:
    port = free_port()
    group = WeightSyncGroup("127.0.0.1", port, 2, 0, epoch=7, secret="the epoch's secret")
    outcome: list[BaseException | GroupMember] = []

    def host() -> None:
        try:
            outcome.append(GroupMember(group, TIMEOUT))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    thread = threading.Thread(target=host)
    thread.start()
    stranger = dist.PrefixStore(
        "dockyard/weights/epoch-7", dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    )
    challenge = stranger.get("challenge")  # it can read the store, but not prove anything
    forged = hmac.new(b"a guess", b"7|member|1|" + challenge, hashlib.sha256).hexdigest()
    stranger.set("proof/1", forged)
    assert stranger.get("verdict") == b"rejected"
    thread.join(TIMEOUT.total_seconds() * 2)
    assert len(outcome) == 1 and isinstance(outcome[0], SyncFailed), outcome
    assert "could not prove" in str(outcome[0])


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_the_store_listens_on_the_configured_address_only() -> None:
    port = free_port()
    member = GroupMember(WeightSyncGroup("127.0.0.1", port, 1, 0, epoch=0, secret="s"), TIMEOUT)
    try:
        assert _connects("127.0.0.1", port)
        # 127.0.0.2 is this host too (all of 127/8 is loopback), but not the configured address.
        assert not _connects("127.0.0.2", port)
    finally:
        member.close()


def test_a_group_without_a_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="no secret"):
        GroupMember(WeightSyncGroup("127.0.0.1", free_port(), 1, 0, epoch=2, secret=""), TIMEOUT)


def test_the_coordinator_source_hands_the_secret_to_the_member() -> None:
    group = common_pb2.WeightSyncGroup(
        master_address="10.0.0.1", master_port=29500, world_size=2, epoch=3, backend="gloo", secret="s3"
    )

    async def get(request, timeout=None):
        return coordinator_pb2.GetWeightSyncGroupResponse(group=group, rank=1)

    source = coordinator_group_source(SimpleNamespace(GetWeightSyncGroup=get), "job", "rollout")
    got = asyncio.run(source(None))
    assert (got.epoch, got.rank, got.secret) == (3, 1, "s3")
    assert "s3" not in repr(got)
