"""A receiver killed mid-sync: the trainer's sync fails within the timeout, the group is formed again, the next works.

The trainer side runs in the test process with the coordinator's own
membership registry as its weight-sync group source; receivers are separate
processes, as deployed.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch

from dockyard.weights.collective import TensorSink
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.synchronizer import WeightSyncFailed, WeightSynchronizer
from dockyard.weights.transports import CollectiveTransport
from services.coordinator.weight_sync_groups import WeightSyncGroups

TIMEOUT = timedelta(seconds=6)
BUCKET = 256 * 1024
NUM_TENSORS = 64  # 64 × 256 KiB = 16 MiB, far beyond loopback socket buffers


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.weight", torch.randn(256, 256, generator=gen)) for i in range(NUM_TENSORS)]


def _group_of(registry: WeightSyncGroups, member: str, failed: int | None = None) -> WeightSyncGroup:
    g, rank = registry.get("job", member, failed)
    return WeightSyncGroup(g.master_address, g.master_port, g.world_size, rank, g.epoch, g.backend, secret=g.secret)


def _receiver(group: WeightSyncGroup, slow: bool, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    transport = CollectiveTransport(TIMEOUT, BUCKET)
    targets = {name: torch.zeros_like(t) for name, t in _weights(seed=99)}
    loaded = 0

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        nonlocal loaded
        for name, tensor in items:
            targets[name].copy_(tensor)
        loaded += 1
        if slow:
            if loaded == 5:
                out.put(("mid", None))
            time.sleep(0.05)

    sink = TensorSink(load=load) if slow else TensorSink(targets=targets)
    out.put(("ready", None))  # imports done: joining now is quick
    try:
        report = transport.receive(sink, 1, group)
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in targets.values())).hexdigest()
        out.put(("done", (report.checksum, digest)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_killed_receiver_fails_the_sync_within_the_timeout_and_the_next_sync_works() -> None:
    torch.set_num_threads(1)
    registry = WeightSyncGroups("127.0.0.1")
    registry.open("job", "gloo")

    async def source(failed: int | None) -> WeightSyncGroup:
        return _group_of(registry, "trainer", failed)

    sync = WeightSynchronizer(CollectiveTransport(TIMEOUT, BUCKET), source)
    weights = _weights(seed=1)
    ctx = mp.get_context("spawn")
    procs: list = []

    async def scenario() -> None:
        # 1. A receiver that loads slowly is killed after a few buckets.
        out = ctx.Queue()  # a queue per process: killing one may leave its queue unusable
        victim = ctx.Process(target=_receiver, args=(_group_of(registry, "rollout"), True, out), daemon=True)
        procs.append(victim)
        victim.start()
        assert (await asyncio.to_thread(out.get, True, 120))[0] == "ready"
        sending = asyncio.create_task(sync.sync_weights(weights, 1))
        kind, _ = await asyncio.to_thread(out.get, True, 60)
        assert kind == "mid"
        victim.kill()
        killed_at = time.monotonic()
        with pytest.raises(WeightSyncFailed) as failure:
            await sending
        assert time.monotonic() - killed_at < TIMEOUT.total_seconds() + 3
        assert "version 1 failed" in str(failure.value) and "epoch 1" in str(failure.value)
        assert sync.is_stale and sync.transport.member is None  # torn down, still to do
        victim.join(10)

        # 2. The coordinator moved to epoch 1; a fresh receiver joins it and the next sync works.
        fresh = _group_of(registry, "rollout")
        assert fresh.epoch == 1 and fresh.world_size == 2
        out = ctx.Queue()
        receiver = ctx.Process(target=_receiver, args=(fresh, False, out), daemon=True)
        procs.append(receiver)
        receiver.start()
        assert (await asyncio.to_thread(out.get, True, 120))[0] == "ready"
        report = await sync.sync_weights(weights, 1)
        kind, payload = await asyncio.to_thread(out.get, True, 60)
        receiver.join(10)
        assert kind == "done", payload
        received_checksum, received_digest = payload
        assert received_checksum == report.checksum and len(report.checksum) == 64
        sent_digest = hashlib.sha256(b"".join(t.numpy().tobytes() for _, t in weights)).hexdigest()
        assert received_digest == sent_digest
        assert not sync.is_stale and sync.failures == 1

    try:
        asyncio.run(scenario())
    finally:
        sync.close()
        for p in procs:
            if p.is_alive():
                p.kill()
