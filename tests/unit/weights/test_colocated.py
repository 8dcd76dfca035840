"""The colocated transport between two real processes on one host: CPU shared memory runs the same protocol
as CUDA IPC (tests/gpu/test_colocated_gpu.py runs it on a GPU)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.util import Finalize

import pytest
import torch

from dockyard.weights import colocated, colocated_sender, devices
from dockyard.weights.collective import TensorSink
from dockyard.weights.colocated import ColocatedTransport
from dockyard.weights.group import SyncFailed, WeightSyncGroup
from dockyard.weights.handles import new_shared_file, remove_file, shared_file_of
from tests.conftest import free_port

BUCKET = 2048  # bytes: the large tensor spans several buckets, so both staging buckets are reused


_FILES: list[str] = []  # this process's files of _shared, removed at its exit (or before it dies on purpose)


def _shared(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in a file mapped shared: the sender shares it as it is, as it does a GPU's memory."""
    out = new_shared_file(t.nbytes).view(t.dtype).view(t.shape)
    if not _FILES:
        Finalize(None, _remove_files, exitpriority=0)  # multiprocessing's children run no atexit
    _FILES.append(shared_file_of(out))
    return out.copy_(t)


def _remove_files() -> None:
    while _FILES:
        remove_file(_FILES.pop())


def _sender_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    shared = _shared(torch.randn(40, 30, generator=gen))  # shared as it is, no staging
    return [
        ("_orig_mod.model.embed.weight", torch.randn(50, 20, generator=gen)),  # 4000 bytes: cut across buckets
        ("model.layers.0.attn.weight", shared),
        ("model.layers.0.mlp.weight", torch.randn(16, 8, generator=gen).t()),  # strided: staged
        ("model.norm.weight", torch.randn(5, generator=gen).to(torch.bfloat16)),
    ]


def _receiver_targets(shape_mismatch: bool = False) -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": torch.zeros(50, 20),
        "model.layers.0.attn.weight": torch.zeros(40, 30, dtype=torch.bfloat16),  # cast on load
        "model.layers.0.mlp.weight": torch.zeros(8, 16),
        "model.norm.weight": torch.zeros(5 if not shape_mismatch else 6, dtype=torch.bfloat16),
    }


def _group(rank: int, port: int, secret: str = "the epoch's secret") -> WeightSyncGroup:
    return WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=2, secret=secret)


def _sums(tensors) -> list[float]:
    return [round(float(t.double().sum()), 2) for _, t in tensors]


def _patch(rank: int, scenario: str) -> None:
    """What goes wrong in `scenario`, on this rank (and nothing of the scenario before)."""
    colocated_sender.sign = _REAL_SIGN
    if scenario == "corrupt" and rank == 0:
        real_sign = colocated_sender.sign

        def corrupt(secret, key, payload):  # a message altered on its way through the store
            signed = real_sign(secret, key, payload)
            return signed[:-1] + bytes([signed[-1] ^ 1]) if "/message/" in key else signed

        colocated_sender.sign = corrupt
    if scenario == "killed" and rank == 1:  # a replica that dies after the manifest, before any acknowledgement
        colocated.ColocatedReceiver._load = lambda *args, **kwargs: os._exit(3)  # type: ignore[method-assign]
    if scenario == "killed-sender" and rank == 0:  # a trainer that dies between the manifest and its first bucket
        colocated.ColocatedSender._stage = lambda *args: (_remove_files(), os._exit(3))  # type: ignore[method-assign]


_REAL_SIGN = colocated_sender.sign


def _scenario(rank: int, port: int, scenario: str) -> tuple:
    _patch(rank, scenario)
    transport = ColocatedTransport(timedelta(seconds=4 if "killed" in scenario else 30), BUCKET, checksum=True)
    try:
        if rank == 0:
            tensors = _sender_tensors()
            reports = [transport.send(tensors, 1, _group(0, port))]
            with torch.no_grad():
                for _, t in tensors:
                    t.add_(1.0)  # an optimizer step, in place: the shared storages stay the same
            handles = dict(transport.peer.ids)
            reports.append(transport.send(tensors, 2, _group(0, port)))
            return ("ok", [r.checksum for r in reports], _sums(tensors), handles == transport.peer.ids)
        targets = _receiver_targets(scenario == "mismatch")
        sink = TensorSink(targets=targets)
        reports = [transport.receive(sink, 1, _group(1, port))]
        opened = dict(transport.peer.handles)
        reports.append(transport.receive(sink, 2, _group(1, port)))
        same = all(transport.peer.handles[h] is t for h, t in opened.items())
        return ("ok", [r.checksum for r in reports], _sums(targets.items()), same)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), None)
    finally:
        transport.close()


def _member(rank: int, ports: list[int], scenarios: list[str], out) -> None:
    torch.set_num_threads(1)
    for port, scenario in zip(ports, scenarios, strict=True):
        out.put((scenario, rank, *_scenario(rank, port, scenario)))


def _run(scenarios: list[str], wait: float = 90) -> dict[tuple[str, int], tuple]:
    """Both members run `scenarios` in turn (each on its own epoch's store); (scenario, rank) -> outcome."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in scenarios]
    procs = {rank: ctx.Process(target=_member, args=(rank, ports, scenarios, out)) for rank in (0, 1)}
    for p in procs.values():
        p.start()
    results: dict[tuple[str, int], tuple] = {}
    deadline = time.monotonic() + wait
    try:
        while len(results) < 2 * len(scenarios) and time.monotonic() < deadline:
            try:
                item = out.get(timeout=0.5)
                results[item[:2]] = item[2:]
            except queue.Empty:
                if not any(p.is_alive() for p in procs.values()):
                    break
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
    for scenario in scenarios:
        for rank, p in procs.items():
            results.setdefault((scenario, rank), ("died", p.exitcode))
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, int], tuple]:
    """One pair of processes runs every scenario in which both survive, then one in which the replica dies."""
    return _run(["ok", "mismatch", "corrupt", "killed"])


def test_a_replica_holds_exactly_the_trainers_bytes_across_versions_and_keeps_its_handles(outcomes) -> None:
    sender, receiver = outcomes["ok", 0], outcomes["ok", 1]
    assert sender[0] == "ok" and receiver[0] == "ok", (sender, receiver)
    assert sender[1] == receiver[1] and len(set(sender[1])) == 2 and all(len(c) == 64 for c in sender[1])
    # one tensor is bfloat16 on the replica: compared after the same cast on the trainer's values
    expected = _sums([(n, t + 1.0) for n, t in _sender_tensors()])
    got = receiver[2]
    assert got[0] == expected[0] and got[2] == expected[2] and got[3] == expected[3]
    assert abs(got[1] - expected[1]) < 2.0  # 1200 values rounded to bfloat16
    assert sender[3] and receiver[3]  # version 2 shared no new handle and opened none


def test_a_layout_mismatch_fails_both_sides_before_any_byte_moves(outcomes) -> None:
    for rank in (0, 1):
        status, message = outcomes["mismatch", rank][:2]
        assert status == "error" and message.startswith("RefitError") and "model.norm.weight" in message, message


def test_a_corrupted_message_is_refused_and_the_sender_learns_why(outcomes) -> None:
    receiver, sender = outcomes["corrupt", 1], outcomes["corrupt", 0]
    assert receiver[0] == "error" and "not signed with the epoch's secret" in receiver[1], receiver
    assert sender[0] == "error" and "SyncFailed" in sender[1] and "not signed" in sender[1], sender


def test_a_replica_killed_mid_sync_fails_the_send_within_the_timeout(outcomes) -> None:
    assert outcomes["killed", 1] == ("died", 3), outcomes["killed", 1]
    sender = outcomes["killed", 0]
    assert sender[0] == "error" and "no answer within 4s" in sender[1], sender


def test_a_trainer_killed_mid_sync_fails_the_receive() -> None:
    results = _run(["killed-sender"])
    assert results["killed-sender", 0] == ("died", 3), results
    receiver = results["killed-sender", 1]
    assert receiver[0] == "error" and "SyncFailed" in receiver[1], receiver


def test_a_replica_that_never_comes_fails_the_send_cleanly() -> None:
    transport = ColocatedTransport(timedelta(seconds=1), BUCKET)
    start = time.monotonic()
    with pytest.raises(SyncFailed, match="epoch 2"):
        transport.send(_sender_tensors(), 1, _group(0, free_port()))
    assert time.monotonic() - start < 10 and transport.peer is None


def test_device_checks_name_the_ranks_and_the_fix() -> None:
    gpu = {"kind": "cuda", "uuid": "GPU-aaaa", "host": "h"}
    other = {"kind": "cuda", "uuid": "GPU-bbbb", "host": "h"}
    devices.distinct_gpus([gpu, other])
    with pytest.raises(devices.DeviceMismatch, match="ranks 0 and 1 are both on GPU GPU-aaaa.*transport=colocated"):
        devices.distinct_gpus([gpu, other, gpu][::2])
    devices.one_device([gpu, dict(gpu)])
    with pytest.raises(devices.DeviceMismatch, match="rank 1 on GPU GPU-bbbb.*transport=collective"):
        devices.one_device([gpu, other])
    with pytest.raises(devices.DeviceMismatch, match="rank 1 on the CPU"):
        devices.one_device([gpu, {"kind": "cpu", "host": "h"}])


def test_versions_that_switch_between_shared_and_staged_tensors_stay_exact() -> None:
    """One process, two threads: a bucket left out of a version stays mapped for a later one that needs it."""
    gen = torch.Generator().manual_seed(1)
    port = free_port()
    sender = ColocatedTransport(timedelta(seconds=30), BUCKET)
    receiver = ColocatedTransport(timedelta(seconds=30), BUCKET)
    targets = {"a": torch.zeros(30, 20), "b": torch.zeros(8, 16)}
    try:
        for version, staged in ((1, False), (2, True), (3, False), (4, True)):
            a = _shared(torch.randn(30, 20, generator=gen))
            b = torch.randn(16, 8, generator=gen).t() if staged else _shared(torch.randn(8, 16, generator=gen))
            box: list = []
            thread = threading.Thread(
                target=lambda v=version, out=box: out.append(
                    receiver.receive(TensorSink(targets=targets), v, _group(1, port))
                )
            )
            thread.start()
            sent = sender.send([("a", a), ("b", b)], version, _group(0, port))
            thread.join(30)
            assert box and box[0].checksum == sent.checksum, version
            assert torch.equal(targets["a"], a) and torch.equal(targets["b"], b), version
    finally:
        sender.close()
        receiver.close()


def test_an_unchanged_layout_is_replayed_and_a_changed_engine_refuses_the_replay() -> None:
    """Checksum off, the trainer's tensors stepped in place: the next version is a replay of the last one's copies."""
    gen = torch.Generator().manual_seed(2)
    sent = [
        ("a", _shared(torch.randn(30, 20, generator=gen))),
        ("b", _shared(torch.randn(9, generator=gen))),
    ]
    targets = {"a": torch.zeros(30, 20), "b": torch.zeros(9)}
    sender = ColocatedTransport(timedelta(seconds=5), BUCKET, checksum=False)
    receiver = ColocatedTransport(timedelta(seconds=5), BUCKET, checksum=False)

    def sync(version: int, port: int) -> list:
        got: list = []

        def receive() -> None:
            try:
                got.append(receiver.receive(TensorSink(targets=targets), version, _group(1, port)))
            except SyncFailed as exc:
                got.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        try:
            sender.send(sent, version, _group(0, port))
        except SyncFailed as exc:
            got.append(exc)
        thread.join(30)
        return got

    try:
        port = free_port()
        for version in (1, 2, 3):
            with torch.no_grad():
                for _, t in sent:
                    t.mul_(-0.5)  # an optimizer step, in place
            assert not any(isinstance(r, Exception) for r in sync(version, port)), version
            assert torch.equal(targets["a"], sent[0][1]) and torch.equal(targets["b"], sent[1][1]), version
            assert receiver.peer.replay[0] == version and sender.peer.last_version == version
        # Repeats go through the mailbox: the store holds no key of theirs, and the full version's are gone.
        assert sender.peer.keys == [] and not sender.peer.store.check(["colocated/v3/manifest"])
        assert not sender.peer.store.check(["colocated/v1/manifest"])
        assert not os.path.exists(sender.peer.mailbox.path)  # unlinked once the receiver mapped it
        # A new storage on the trainer's side: sent in full, which the mailbox tells the receiver.
        sent[1] = ("b", _shared(sent[1][1] + 1.0))
        assert not any(isinstance(r, Exception) for r in sync(4, port))
        assert torch.equal(targets["b"], sent[1][1]) and sender.peer.store.check(["colocated/v4/manifest"])
        assert not any(isinstance(r, Exception) for r in sync(5, port))  # and a repeat again
        assert sender.peer.keys == [] and receiver.peer.replay[0] == 5
        sent[:] = [(n, t.view_as(t)) for n, t in sent]  # new objects, the same layout: still a repeat
        assert not any(isinstance(r, Exception) for r in sync(6, port))
        assert sender.peer.keys == [] and receiver.peer.replay[0] == 6
        with torch.no_grad():  # the same object, moved to other memory: the cheap check sees it, sent in full
            sent[0][1].set_(_shared(torch.randn(30, 20, generator=gen)))
        assert not any(isinstance(r, Exception) for r in sync(7, port))
        assert torch.equal(targets["a"], sent[0][1]) and sender.peer.store.check(["colocated/v7/manifest"])
        targets = {"a": torch.zeros(30, 20), "b": torch.zeros(9)}  # the engine reloaded: other tensors
        failures = sync(8, port)
        assert any("tensors changed" in str(r) for r in failures) and len(failures) == 2, failures
        sync_again = sync(8, free_port())  # the next epoch starts over with the whole protocol
        assert not any(isinstance(r, Exception) for r in sync_again)
        assert torch.equal(targets["a"], sent[0][1]) and torch.equal(targets["b"], sent[1][1])
    finally:
        sender.close()
        receiver.close()


def test_a_repeat_taken_on_an_event_loop_runs_there_without_a_thread_and_leaves_the_loop_free(monkeypatch) -> None:
    """receive_on_loop: a full version goes through a worker thread, a repeat runs on the loop itself
    (no thread), and while it waits for a late trainer the loop's other tasks keep running."""
    gen = torch.Generator().manual_seed(3)
    sent = [("a", _shared(torch.randn(30, 20, generator=gen))), ("b", torch.randn(9, generator=gen))]
    sent[1] = ("b", _shared(sent[1][1]))
    targets = {"a": torch.zeros(30, 20), "b": torch.zeros(9)}
    sender = ColocatedTransport(timedelta(seconds=5), BUCKET, checksum=False)
    receiver = ColocatedTransport(timedelta(seconds=5), BUCKET, checksum=False)
    port = free_port()

    def sync(version: int, delay: float = 0.0) -> tuple[list, int]:
        """(the outcomes of both sides, how often another task on the receiver's loop ran meanwhile)."""
        got: list = []

        def send() -> None:
            time.sleep(delay)
            try:
                got.append(sender.send(sent, version, _group(0, port)))
            except SyncFailed as exc:
                got.append(exc)

        async def receive() -> int:
            ticks = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.005)

            task = asyncio.create_task(ticker())
            try:
                got.append(await receiver.receive_on_loop(TensorSink(targets=targets), version, _group(1, port)))
            except SyncFailed as exc:
                got.append(exc)
            stop.set()
            await task
            return ticks

        thread = threading.Thread(target=send)
        thread.start()
        ticks = asyncio.run(receive())
        thread.join(30)
        return got, ticks

    try:
        got, _ = sync(1)  # a full version: through a worker thread
        assert not any(isinstance(r, Exception) for r in got) and torch.equal(targets["a"], sent[0][1])

        def no_thread(*args, **kwargs):
            raise AssertionError("a repeat went to a worker thread")

        monkeypatch.setattr(asyncio, "to_thread", no_thread)
        with torch.no_grad():
            for _, t in sent:
                t.mul_(-2.0)  # an optimizer step, in place: the next version is a repeat
        got, ticks = sync(2, delay=0.3)
        assert not any(isinstance(r, Exception) for r in got), got
        assert torch.equal(targets["a"], sent[0][1]) and torch.equal(targets["b"], sent[1][1])
        assert receiver.peer.replay[0] == 2 and sender.peer.last_version == 2
        assert ticks >= 10, ticks  # the loop ran its other task while the repeat waited ~0.3 s for the trainer
        monkeypatch.undo()
        targets = {"a": torch.zeros(30, 20), "b": torch.zeros(9)}  # the engine reloaded: other tensors
        got, _ = sync(3)
        assert len(got) == 2 and all("tensors changed" in str(r) for r in got), got
    finally:
        sender.close()
        receiver.close()
