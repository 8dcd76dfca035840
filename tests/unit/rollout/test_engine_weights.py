"""TorchEngine with kv_cache="static" (eager on CPU), weight loads through a transport, in-flight weight updates."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
import torch

from dockyard.weights.transports import CheckpointTransport
from services.rollout.decoding import DecodingParams
from services.rollout.torch_engine import TorchEngine
from tests.unit.rollout.test_torch_engine import PROMPT, greedy_reference, recompute_logprobs, tiny_engine


def _engine(kv_cache: str = "dynamic", in_flight: bool = False) -> TorchEngine:
    return tiny_engine("cpu", kv_cache=kv_cache, in_flight_weight_updates=in_flight)


def test_static_cache_generates_what_the_model_computes() -> None:
    engine = _engine("static")
    greedy = engine.generate_blocking(PROMPT, 2, DecodingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True))
    reference = greedy_reference(engine, greedy.prompt_token_ids, 9)
    assert [c.token_ids for c in greedy.completions] == [reference, reference]
    sampled = engine.generate_blocking(
        PROMPT, 3, DecodingParams(temperature=0.8, top_k=7, max_new_tokens=10, ignore_eos=True, seed=3)
    )
    for c in sampled.completions:
        assert len(c.token_ids) == 10
        expected = recompute_logprobs(engine, sampled.prompt_token_ids, c.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
    # A longer request after a shorter one (the cache grows) and seeds still reproduce.
    again = engine.generate_blocking(
        PROMPT, 3, DecodingParams(temperature=0.8, top_k=7, max_new_tokens=10, ignore_eos=True, seed=3)
    )
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in sampled.completions]
    longer = engine.generate_blocking(PROMPT, 1, DecodingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    assert longer.completions[0].token_ids == greedy_reference(engine, greedy.prompt_token_ids, 20)


def _perturbed(engine: TorchEngine) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach() + 0.5) for name, t in engine.named_weights().items()]


def test_receive_weights_loads_exactly_and_tags_the_version(tmp_path) -> None:
    engine = _engine()
    transport = CheckpointTransport(tmp_path, timedelta(seconds=5))
    new = _perturbed(engine)
    sent = transport.send(new, version=4)
    report = asyncio.run(engine.receive_weights(transport, 4, None, timedelta(seconds=5)))
    assert report.checksum == sent.checksum and engine.weight_version == 4
    for (name, expected), (got_name, got) in zip(new, engine.named_weights().items(), strict=True):
        assert name == got_name and torch.equal(expected, got)
    result = engine.generate_blocking(PROMPT, 2, DecodingParams(temperature=1.0, max_new_tokens=4, seed=0))
    assert result.weight_version == 4 and result.weight_versions == [4]


@pytest.mark.parametrize("in_flight", [True, False])
def test_in_flight_update_lands_between_decode_steps(tmp_path, in_flight: bool) -> None:
    engine = _engine(in_flight=in_flight)
    transport = CheckpointTransport(tmp_path, timedelta(seconds=5))
    transport.send(_perturbed(engine), version=1)
    started, forwards = threading.Event(), []

    def slow_step(module, args, output) -> None:
        forwards.append(1)
        if len(forwards) == 5:  # the prefill and four decode steps
            started.set()
        time.sleep(0.01)  # leave the update time to arrive mid-generation

    engine.model.register_forward_hook(slow_step)
    sampling = DecodingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True, seed=1)

    async def scenario():
        generating = asyncio.create_task(engine.generate(PROMPT, 2, sampling))
        await asyncio.to_thread(started.wait, 30)
        await engine.receive_weights(transport, 1, None, timedelta(seconds=5))
        return await generating

    result = asyncio.run(scenario())
    assert engine.weight_version == 1
    if in_flight:
        # The trajectory records both versions; the oldest is its weight_version.
        assert result.weight_version == 0 and result.weight_versions == [0, 1]
        assert all(c.weight_versions == (0, 1) for c in result.completions)
    else:
        # The update waited for the whole generation.
        assert result.weight_version == 0 and result.weight_versions == [0]


def test_an_idle_engine_holds_its_weights_on_the_loop_and_lets_the_transport_load_there(tmp_path) -> None:
    """receive_weights: when the weights are free at once, the engine's hold is taken on the event loop and
    the load goes through the transport's receive_on_loop; while a decode step holds them, through a thread."""
    engine = _engine(in_flight=False)
    seen: list[tuple[str, bool]] = []

    class Watching(CheckpointTransport):
        def receive(self, sink, version, group=None):
            seen.append(("thread", engine.exclusive_now() is None))
            return super().receive(sink, version, group)

        async def receive_on_loop(self, sink, version, group=None):
            seen.append(("loop", engine.exclusive_now() is None))  # None: the hold is taken already
            return self.receive(sink, version, group)

    transport = Watching(tmp_path, timedelta(seconds=5))
    new = _perturbed(engine)
    transport.send(new, version=2)
    asyncio.run(engine.receive_weights(transport, 2, None, timedelta(seconds=5)))
    assert seen == [("loop", True), ("thread", True)] and engine.weight_version == 2
    assert all(torch.equal(t, engine.named_weights()[n]) for n, t in new)
    hold = engine.exclusive_now()
    assert hold is not None
    hold.__enter__()  # a load that finds the weights in use waits for them in a worker thread
    assert engine.exclusive_now() is None
    seen.clear()

    async def late() -> None:
        task = asyncio.create_task(engine.receive_weights(transport, 2, None, timedelta(seconds=5)))
        await asyncio.sleep(0.1)
        assert not task.done()
        hold.__exit__(None, None, None)
        await task

    asyncio.run(late())
    assert seen == [("thread", True)]
