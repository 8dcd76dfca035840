"""On CUDA, the torch engine's decode step replayed from a captured CUDA graph decodes what eager steps decode.

Run with `make test-gpu` (or `python -m pytest tests/gpu -q`) on a machine with a CUDA GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.decoding import DecodingParams
from services.rollout.engine import GenerationResult
from services.rollout.torch_engine import TorchEngine
from tests.conftest import missing
from tests.unit.rollout.test_torch_engine import PROMPT, greedy_reference, recompute_logprobs, tiny_engine

LONG_PROMPT = "12+34+56+78+90="


@pytest.fixture(autouse=True)
def cuda() -> None:
    if not torch.cuda.is_available():
        missing("no CUDA device: the CUDA graph decode step needs one")


def tokens(result: GenerationResult) -> list[list[int]]:
    return [c.token_ids for c in result.completions]


async def mixed_batch(engine: TorchEngine) -> list[GenerationResult]:
    """Requests of different prompt lengths and parameters, concurrently (rows join and leave mid-run)."""
    asks = [
        (PROMPT, 4, DecodingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)),
        (LONG_PROMPT, 3, DecodingParams(temperature=1.0, top_p=0.9, max_new_tokens=70, seed=3)),
        ("7*8=", 5, DecodingParams(temperature=0.8, top_k=8, max_new_tokens=100, ignore_eos=True, seed=4)),
        (PROMPT, 2, DecodingParams(temperature=2.0, max_new_tokens=24, stop=("a", "5"), ignore_eos=True, seed=5)),
    ]
    return await asyncio.gather(*(engine.generate(*ask) for ask in asks))


def test_graph_decode_equals_eager_decode() -> None:
    graphed = tiny_engine("cuda", kv_cache="static", max_batch_rows=8)
    eager = tiny_engine("cuda", kv_cache="dynamic", max_batch_rows=8)
    graph_results = asyncio.run(mixed_batch(graphed))
    eager_results = asyncio.run(mixed_batch(eager))
    assert graphed._batch.step.replays > 0 and eager._batch.step.replays == 0
    assert graphed._batch.cache.length > 64  # the cache grew, and the graph was captured again for it
    for g, e in zip(graph_results, eager_results, strict=True):
        assert tokens(g) == tokens(e)
        for x, y in zip(g.completions, e.completions, strict=True):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
            assert x.finish_reason == y.finish_reason
    greedy = graph_results[0]
    assert tokens(greedy) == [greedy_reference(graphed, greedy.prompt_token_ids, 40)] * 4
    for c in graph_results[2].completions:
        expected = recompute_logprobs(graphed, graph_results[2].prompt_token_ids, c.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_graph_survives_a_weight_load_into_the_live_parameters() -> None:
    engine = tiny_engine("cuda", kv_cache="static", max_batch_rows=4)
    greedy = DecodingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    before = engine.generate_blocking(PROMPT, 2, greedy)
    torch.manual_seed(0)
    with torch.no_grad(), engine.exclusive():
        for t in engine.named_weights().values():
            t.add_(0.05 * torch.randn_like(t))
    asyncio.run(engine.prepare_for_generation())
    after = engine.generate_blocking(PROMPT, 2, greedy)
    assert tokens(after) == [greedy_reference(engine, after.prompt_token_ids, 30)] * 2
    for b, a in zip(before.completions, after.completions, strict=True):
        # The replayed graph read the new weights: logprobs are the new model's, not the old one's.
        expected = recompute_logprobs(engine, after.prompt_token_ids, a.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(a.logprobs), expected, atol=1e-4, rtol=0)
        assert not torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3)
