"""The driver-to-workers relay of a tensor-parallel vLLM engine, with a stand-in for vLLM's TP broadcast.

Real vLLM at tensor_parallel_size=2 runs in tests/integration/test_vllm_tensor_parallel.py; here the
relay's protocol runs in threads over queues, so the failure paths (a corrupted relay, a driver whose
transport failed, a follower whose load failed, workers that disagree) each show in milliseconds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dockyard.weights.fingerprint import fingerprint
from dockyard.weights.group import SyncFailed, SyncReport
from services.rollout.worker_relay import DriverRelay, agreed_report, follow

REPORT = SyncReport("trainer-checksum", 1234, 0.5)


class StandIn:
    """vLLM's broadcast_tensor_dict over N ranks: rank 0 hands each follower a copy of its dict."""

    def __init__(self, followers: int, tamper: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.queues = [queue.Queue() for _ in range(followers)]
        self.tamper = tamper

    def driver(self, message: dict[str, Any] | None) -> dict[str, Any]:
        assert message is not None
        for q in self.queues:
            copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in message.items()}
            if self.tamper is not None:
                self.tamper(copy)
            q.put(copy)
        return message

    def follower(self, rank: int) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
        def receive(message: dict[str, Any] | None) -> dict[str, Any]:
            assert message is None
            return self.queues[rank - 1].get(timeout=10)

        return receive


def _batches() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [("model.embed_tokens.weight", torch.randn(16, 8, generator=g))],
        [
            ("model.layers.0.mlp.up_proj.weight", torch.randn(8, 4, generator=g).t()),
            ("model.norm.weight", torch.ones(8)),
        ],
    ]


def _run(stand_in: StandIn, followers: int, fail_driver: bool = False, follower_load=None) -> tuple[Any, list[Any]]:
    """Drive the batches through the relay; ((driver's reply, what each rank loaded), each follower's reply or
    exception)."""
    loaded: dict[int, list[tuple[str, torch.Tensor]]] = {r: [] for r in range(followers + 1)}
    results: list[Any] = [None] * followers

    def run_follower(rank: int) -> None:
        load = follower_load or loaded[rank].extend
        try:
            results[rank - 1] = follow(stand_in.follower(rank), load, checksum=True, rank=rank)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            results[rank - 1] = exc

    threads = [threading.Thread(target=run_follower, args=(r,)) for r in range(1, followers + 1)]
    for t in threads:
        t.start()
    relay = DriverRelay(stand_in.driver, loaded[0].extend, checksum=True)
    for batch in _batches():
        relay.load(batch)
    if fail_driver:
        relay.abort(TimeoutError("the trainer stopped sending"))
        driver: Any = None
    else:
        driver = relay.done(REPORT)
    for t in threads:
        t.join(10)
    return (driver, loaded), results


def test_every_worker_loads_every_whole_tensor_and_answers_the_trainers_checksum() -> None:
    (driver, loaded), followers = _run(StandIn(2), 2)
    sent = [t for batch in _batches() for _, t in batch]
    assert driver == {"checksum": "trainer-checksum", "num_bytes": 1234, "seconds": 0.5, "tensors": 3}
    assert followers == [driver, driver]
    for rank in range(3):
        assert [n for n, _ in loaded[rank]] == [n for batch in _batches() for n, _ in batch]
        assert fingerprint(*(t for _, t in loaded[rank])) == fingerprint(*(t.contiguous() for t in sent))


def test_a_tensor_changed_on_the_way_to_a_follower_fails_that_follower() -> None:
    def flip(message: dict[str, Any]) -> None:
        if message["op"] == "load":
            message["t0"].view(torch.int32)[0, 0] ^= 1  # one bit of the first tensor of each batch

    _, followers = _run(StandIn(1, tamper=flip), 1)
    assert isinstance(followers[0], SyncFailed) and "fingerprint" in str(followers[0])


def test_a_driver_whose_transport_failed_releases_every_follower() -> None:
    _, followers = _run(StandIn(2), 2, fail_driver=True)
    for error in followers:
        assert isinstance(error, SyncFailed)
        assert "driver worker failed to receive: TimeoutError: the trainer stopped sending" in str(error)


def test_a_follower_that_fails_to_load_drains_the_relay_then_fails() -> None:
    calls = []

    def load(batch):
        calls.append(batch)
        raise ValueError("no parameter named model.embed_tokens.weight")

    stand_in = StandIn(1)
    (driver, _), followers = _run(stand_in, 1, follower_load=load)
    assert driver["tensors"] == 3 and len(calls) == 1  # the driver finished; the follower stopped loading
    assert stand_in.queues[0].empty()  # every message was taken: the group is in step
    assert isinstance(followers[0], SyncFailed) and "failed to load its shard: no parameter" in str(followers[0])


def test_a_count_that_differs_from_the_drivers_fails() -> None:
    def drop(message: dict[str, Any]) -> None:
        if message["op"] == "load" and len(message["names"]) == 2:
            message["names"] = message["names"][:1]

    _, followers = _run(StandIn(1, tamper=drop), 1)
    assert isinstance(followers[0], SyncFailed) and "received 2 tensors" in str(followers[0])


def test_the_engine_reports_a_version_only_when_every_worker_agrees() -> None:
    answer = {"checksum": "abc", "num_bytes": 10, "seconds": 0.1, "tensors": 3}
    assert agreed_report([answer, dict(answer)]) == SyncReport("abc", 10, 0.1)
    with pytest.raises(SyncFailed, match=r"^worker 1 loaded 2 tensors .* the driver 3 "):
        agreed_report([answer, {**answer, "tensors": 2}])
    with pytest.raises(SyncFailed, match="^worker 2 loaded 3 tensors with checksum other"):
        agreed_report([answer, answer, {**answer, "checksum": "other"}])
    # Workers answer a failure instead of raising; every failure is named.
    failed = {"error": "AssertionError: shape"}
    with pytest.raises(SyncFailed, match=r"^worker 0: AssertionError: shape; worker 1: SyncFailed: relay$"):
        agreed_report([failed, {"error": "SyncFailed: relay"}])
    with pytest.raises(SyncFailed, match="^no worker answered"):
        agreed_report([])
