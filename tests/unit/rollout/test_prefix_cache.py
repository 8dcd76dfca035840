"""The torch engine's prefix cache: multi-turn prompts reuse the KV of earlier turns, and nothing changes.

Two engines on the same tiny random model (one with the cache, one without) run the same seeded
multi-turn conversations; tokens must be equal and logprobs equal to float tolerance, while the cached
engine's counters show the prefill it saved. Then evictions under a small budget, and no reuse across a
weight update.
"""

from __future__ import annotations

import pytest
import torch

from services.rollout.decoding import DecodingParams
from services.rollout.prefix_cache import common_prefix
from tests.unit.rollout.test_torch_engine import tiny_engine


@pytest.fixture(scope="module")
def pair():
    plain, cached = tiny_engine("cpu"), tiny_engine("cpu", prefix_cache_tokens=4096)
    yield plain, cached
    for engine in (plain, cached):
        import asyncio

        asyncio.run(engine.close())


def converse(engine, first: list[int], turns: int, seed: int, n: int = 1) -> list:
    """Each turn's prompt = the last prompt + the first completion + a fixed user tail (as the endpoint builds it)."""
    prompt, results = list(first), []
    for turn in range(turns):
        result = engine.generate_blocking(
            prompt, n, DecodingParams(temperature=1.0, max_new_tokens=6, seed=seed + turn)
        )
        results.append(result)
        prompt = [*prompt, *result.completions[0].token_ids, 5, 6, 7 + turn]
    return results


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([9], [1]) == 0
    assert common_prefix(list(range(1000)), [*range(700), -1]) == 700


def test_same_seeded_output_and_logprobs_with_and_without_the_cache(pair) -> None:
    plain, cached = pair
    before = cached.kv_cache_stats
    assert plain.kv_cache_stats is None
    start = list(range(10, 40))
    for seed, n in ((1, 1), (20, 3)):
        expected, got = converse(plain, start, 4, seed, n), converse(cached, start, 4, seed, n)
        for a, b in zip(expected, got, strict=True):
            assert a.prompt_token_ids == b.prompt_token_ids
            assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
            for ca, cb in zip(a.completions, b.completions, strict=True):
                assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-4)
    stats = cached.kv_cache_stats
    assert stats.hits - before.hits >= 6  # every turn after the first found its history
    saved = stats.prefill_tokens_saved - before.prefill_tokens_saved
    computed = stats.prefill_tokens_computed - before.prefill_tokens_computed
    assert saved > computed > 0
    # A turn's prompt supersedes the entry of the row it continues: one entry of the single-row
    # conversation, and of the three-row one the two rows not continued per turn plus the last turn's three.
    assert stats.cached_entries == 1 + 2 * 3 + 3 and 0 < stats.pressure <= 1


def test_small_budget_evicts_least_recently_used() -> None:
    engine = tiny_engine("cpu", prefix_cache_tokens=80)
    try:
        for start in (10, 20, 30):
            converse(engine, list(range(start, start + 30)), 1, seed=start)
        stats = engine.kv_cache_stats
        assert stats.evictions >= 1 and stats.cached_tokens <= 80
        # The newest conversation is still there: its next turn reuses it.
        saved = stats.prefill_tokens_saved
        engine.generate_blocking(list(range(30, 60)) + [1], 1, DecodingParams(max_new_tokens=2, seed=0))
        assert engine.kv_cache_stats.prefill_tokens_saved - saved == 30
    finally:
        import asyncio

        asyncio.run(engine.close())


def test_no_reuse_across_a_weight_update() -> None:
    engine = tiny_engine("cpu", prefix_cache_tokens=4096)
    try:
        converse(engine, list(range(10, 40)), 1, seed=3)
        assert engine.kv_cache_stats.cached_entries == 1
        with engine.exclusive(), torch.no_grad():
            for p in engine.model.parameters():
                p.mul_(1.01)
            engine.set_weight_version(1)
        saved = engine.kv_cache_stats.prefill_tokens_saved
        result = engine.generate_blocking(list(range(10, 45)), 1, DecodingParams(max_new_tokens=2, seed=0))
        stats = engine.kv_cache_stats
        assert stats.prefill_tokens_saved == saved and stats.invalidated >= 1
        assert result.weight_version == 1
    finally:
        import asyncio

        asyncio.run(engine.close())
