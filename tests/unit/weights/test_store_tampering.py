"""A stranger that writes the proof's keys on the weight-sync store is harmless.

The TCPStore has no access control: any local process can read and write its keys before the proof.
Whatever a stranger writes (a challenge, a member's proof, a verdict, the seen marks), before or
during the proof, no honest member accepts it and none hangs: each honest rank either forms the group
(the stranger's write was overwritten before anyone read it) with the weights intact, or raises
SyncFailed, and both ranks end the same way within the bounded waits.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dockyard.weights.collective import receive_weights, send_weights
from dockyard.weights.group import REJECTED, GroupMember, SyncFailed, WeightSyncGroup
from tests.conftest import free_port

TIMEOUT = timedelta(seconds=3)
EPOCH = 5
SECRET = "the epoch's secret"
WEIGHTS = torch.arange(1, 17, dtype=torch.float32).view(4, 4)

TAMPERING = {
    # key -> value the stranger writes once rank 0 has posted its challenge, before rank 1 starts
    "challenge": b"0" * 64,
    "proof/1": b"f" * 64,
    "verdict-rejected": REJECTED,
    "verdict-forged": b"a" * 64,
    "seen/1": b"1",
}


def _member(rank: int, port: int, results: dict, started: dict) -> None:
    group = WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=EPOCH, secret=SECRET)
    target = {"w": torch.zeros(4, 4)}
    started[rank] = time.monotonic()
    try:
        member = GroupMember(group, TIMEOUT)
        try:
            if rank == 0:
                send_weights(member, [("w", WEIGHTS)], 1 << 20)
            else:
                receive_weights(member, target)
        finally:
            member.close()
        results[rank] = ("ok", torch.equal(target["w"], WEIGHTS) if rank == 1 else True)
    except BaseException as exc:  # noqa: BLE001 - inspected by the test
        results[rank] = (exc, False)
    results[f"{rank}-seconds"] = time.monotonic() - started[rank]


@pytest.mark.parametrize("tampered", list(TAMPERING))
def test_a_stranger_writing_the_proofs_keys_is_refused_or_overwritten_never_accepted(tampered: str) -> None:
    port = free_port()
    results: dict = {}
    started: dict = {}
    host = threading.Thread(target=_member, args=(0, port, results, started))
    host.start()
    stranger = dist.PrefixStore(
        f"dockyard/weights/epoch-{EPOCH}", dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    )
    stranger.get("challenge")  # rank 0 has posted its challenge and waits for proofs
    stranger.set(tampered.split("-")[0], TAMPERING[tampered])
    joiner = threading.Thread(target=_member, args=(1, port, results, started))
    joiner.start()
    # Every wait is bounded by the group's timeout: proving, then forming the process group.
    for thread in (host, joiner):
        thread.join(6 * TIMEOUT.total_seconds())
        assert not thread.is_alive(), f"a member hung: {results}"
    outcomes = [results[0][0], results[1][0]]
    if outcomes == ["ok", "ok"]:  # the stranger's write was overwritten before anyone read it
        assert results[1][1], "the weights that arrived are not the ones sent"
        return
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, SyncFailed), f"rank {rank}: {outcome!r} ({results})"
        assert results[f"{rank}-seconds"] < 3 * TIMEOUT.total_seconds(), results
