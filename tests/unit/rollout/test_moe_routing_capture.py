"""The torch engine's routing capture on tiny MoE policies: one row per position, each as its forward routed it.

The reference for every check is one plain forward of the whole sequence (prompt + sampled tokens but the
last) through the same weights, with a RoutingRecorder on it: the engine's rows must equal its rows whatever
the batching (requests of different lengths together, several rows per request), the prefix cache (a reused
prefix hands back the rows kept with its KV) and in-flight weight updates (rows before the update are the old
weights' routing, rows after it the new weights').
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import numpy as np
import pytest
import torch

from dockyard.models.moe import MOE_FAMILIES
from dockyard.models.routing import RoutingRecorder, as_numpy
from dockyard.weights.transports import CheckpointTransport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import Completion, GenerationResult
from services.rollout.torch_engine import TorchEngine
from tests.unit.rollout.test_decode_batch import PauseAt, until
from tests.unit.rollout.test_moe_engine import PROMPTS, moe_engine

SAMPLED = DecodingParams(temperature=1.0, max_new_tokens=8, seed=3)


def forward_routing(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """[len(ids), moe_layers, k] expert ids of one plain forward of `ids`."""
    recorder = RoutingRecorder(model)
    try:
        with torch.no_grad(), recorder.recording() as layers:
            model(input_ids=torch.tensor([ids]))
        assert recorder.shape is not None
        return as_numpy(recorder.stacked(layers), recorder.shape)
    finally:
        recorder.close()


def sequence_routing(result: GenerationResult, completion: Completion) -> tuple[list[int], np.ndarray]:
    """The positions a completion's routing covers (prompt + tokens but the last) and its rows."""
    ids = [*result.prompt_token_ids, *completion.token_ids[:-1]]
    return ids, np.concatenate([completion.prompt_routing, completion.routing])


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request) -> str:
    return request.param


async def test_rows_equal_a_plain_forward_across_batched_requests(family: str) -> None:
    engine = moe_engine(family)
    try:
        # "9-4=" has the length of "1+2=": queued together, the two prompts may share one prefill pass.
        results = await asyncio.gather(*(engine.generate(p, 3, SAMPLED) for p in [*PROMPTS, "9-4="]))
        assert engine.batch_stats.largest_batch > 3  # the requests' rows decoded together
        for result in results:
            assert result.routing_shape.moe_layers == 2 and result.routing_shape.top_k == 2
            for completion in result.completions:
                assert completion.routing.dtype == np.uint8
                assert len(completion.routing) == len(completion.token_ids) - 1
                assert completion.prompt_routing is result.prompt_routing
                ids, rows = sequence_routing(result, completion)
                assert rows.shape == (len(ids), 2, 2)
                assert (np.diff(rows.astype(int), axis=-1) > 0).all()  # ascending, k distinct experts
                np.testing.assert_array_equal(rows, forward_routing(engine.model, ids))
    finally:
        await engine.close()


async def test_a_prefix_cache_hit_returns_the_kept_rows(family: str) -> None:
    engine = moe_engine(family, prefix_cache_tokens=512)
    try:
        first = await engine.generate(PROMPTS[0], 1, SAMPLED)
        ids, rows = sequence_routing(first, first.completions[0])
        follow = [*ids, first.completions[0].token_ids[-1], *engine.tokenize(" and")]
        second = await engine.generate(follow, 1, SAMPLED)
        assert engine.kv_cache_stats.prefill_tokens_saved >= len(ids)  # the kept prefix was reused
        np.testing.assert_array_equal(second.prompt_routing[: len(ids)], rows)
        np.testing.assert_array_equal(second.prompt_routing, forward_routing(engine.model, follow))
    finally:
        await engine.close()


def permuted(engine: TorchEngine, shift: int) -> list[tuple[str, torch.Tensor]]:
    """The engine's weights with expert e renumbered (e + shift) % experts: the same function, other expert ids."""
    out = []
    for name, tensor in engine.named_weights().items():
        if name.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
            tensor = tensor.roll(shift, dims=0)
        out.append((name, tensor.detach().clone()))
    return out


async def test_rows_follow_the_weights_of_their_step_across_an_in_flight_update(family: str, tmp_path) -> None:
    engine = moe_engine(family, in_flight_weight_updates=True)
    before = {n: t.detach().clone() for n, t in engine.named_weights().items()}
    transport = CheckpointTransport(tmp_path, timedelta(seconds=5))
    transport.send(permuted(engine, 1), version=1)
    pause = PauseAt(engine, 4)  # the prefill, then decode steps: paused in the third
    decoding = DecodingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=5)
    running = asyncio.create_task(engine.generate(PROMPTS[1], 2, decoding))
    try:
        await pause.wait()
        update = asyncio.create_task(engine.receive_weights(transport, 1, None, timedelta(seconds=5)))
        await until(lambda: engine.update_waiting, "the update to wait for the weights")
    finally:
        pause.release()
    await update
    result = await running
    after = {n: t.detach().clone() for n, t in engine.named_weights().items()}
    for completion in result.completions:
        assert completion.weight_versions == (0, 1)
        ids, rows = sequence_routing(result, completion)
        assert len(rows) == len(ids)
        with torch.no_grad():
            for name, tensor in engine.named_weights().items():
                tensor.copy_(before[name])
            old = forward_routing(engine.model, ids)
            for name, tensor in engine.named_weights().items():
                tensor.copy_(after[name])
            renumbered = forward_routing(engine.model, ids)
        matches_old = (rows == old).all(axis=(1, 2))
        matches_new = (rows == renumbered).all(axis=(1, 2))
        boundary = int(np.argmin(matches_old))  # the first position routed by the new weights
        assert len(result.prompt_token_ids) < boundary < len(ids)
        assert matches_old[:boundary].all() and matches_new[boundary:].all()
    await engine.close()
