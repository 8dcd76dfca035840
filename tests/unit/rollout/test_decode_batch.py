"""TorchEngine's decode batch: requests join and leave between decode steps, each row on its own terms.

DOCKYARD_TEST_DEVICE=cuda runs the same checks on a GPU (default: cpu).
"""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import timedelta

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.cache_utils import DynamicCache

from dockyard.weights.transports import CheckpointTransport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import GenerationResult, UnsupportedRequest
from services.rollout.kv_slots import DecodeStep, SlotCache, grouped_decode_attention, span_for
from services.rollout.torch_engine import TorchEngine
from tests.unit.rollout.test_torch_engine import PROMPT, greedy_reference, recompute_logprobs, tiny_engine

DEVICE = os.environ.get("DOCKYARD_TEST_DEVICE", "cpu")
LONG_PROMPT = "12+34+56+78+90="
GREEDY = DecodingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)


class PauseAt:
    """A forward hook that holds the scheduler at its n-th forward pass (prefills and decode steps) until released."""

    def __init__(self, engine: TorchEngine, n: int) -> None:
        self.n, self.calls = n, 0
        self.reached, self.go = threading.Event(), threading.Event()
        self.handle = engine.model.register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        self.calls += 1
        if self.calls == self.n:
            self.reached.set()
            self.go.wait(30)

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30)

    def release(self) -> None:
        self.go.set()
        self.handle.remove()


async def until(condition, what: str) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def tokens(result: GenerationResult) -> list[list[int]]:
    return [c.token_ids for c in result.completions]


async def joined_mid_run(engine: TorchEngine, first: tuple, second: tuple) -> tuple[GenerationResult, GenerationResult]:
    """Start `first` (prompt, n, decoding); submit `second` while first is paused at its fifth forward pass."""
    pause = PauseAt(engine, 5)
    running = asyncio.create_task(engine.generate(*first))
    try:
        await pause.wait()
        joining = asyncio.create_task(engine.generate(*second))
        await until(lambda: engine._batch._queue, "the second request to be queued")  # while the first is mid-step
    finally:
        pause.release()
    return await running, await joining


async def test_a_request_arriving_mid_generation_joins_the_running_batch() -> None:
    engine = tiny_engine(DEVICE)
    a, b = await joined_mid_run(
        engine, (PROMPT, 3, GREEDY), (LONG_PROMPT, 2, DecodingParams(temperature=0.0, max_new_tokens=20))
    )
    stats = engine.batch_stats
    assert stats.rows_joined_running == 2 and stats.largest_batch == 5
    # Fewer steps than one request after the other: the two shared decode steps.
    assert stats.steps < (30 - 1) + (20 - 1)
    # Rows of different lengths (a longer prompt shifted the batch right) decode what the model computes.
    assert stats.shifts >= 1
    assert tokens(a) == [greedy_reference(engine, a.prompt_token_ids, 30)] * 3
    for c in b.completions:
        reference = greedy_reference(engine, b.prompt_token_ids, 20)
        assert c.token_ids == reference[: len(c.token_ids)]


async def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_busy_batch() -> None:
    engine = tiny_engine(DEVICE)
    seeded = DecodingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=5)
    alone = await engine.generate(PROMPT, 4, seeded)
    others = [
        engine.generate(LONG_PROMPT, 3, DecodingParams(temperature=1.5, max_new_tokens=40, ignore_eos=True)),
        engine.generate("7*8=", 2, DecodingParams(temperature=0.0, max_new_tokens=10)),
        engine.generate(PROMPT, 5, DecodingParams(temperature=0.9, top_k=4, max_new_tokens=30, seed=6)),
    ]
    busy, *_ = await asyncio.gather(engine.generate(PROMPT, 4, seeded), *others)
    assert engine.batch_stats.largest_batch > 4
    assert tokens(busy) == tokens(alone)
    for x, y in zip(busy.completions, alone.completions, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        assert x.finish_reason == y.finish_reason
    assert len({tuple(t) for t in tokens(alone)}) > 1  # rows draw from their own streams


async def test_each_row_keeps_its_own_decoding_parameters_in_one_batch() -> None:
    engine = tiny_engine(DEVICE)
    asks = {
        "greedy": DecodingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        "top1": DecodingParams(temperature=1.7, top_k=1, max_new_tokens=12, ignore_eos=True, seed=1),
        "hot": DecodingParams(temperature=2.5, top_k=5, max_new_tokens=9, ignore_eos=True, seed=2),
        "cool": DecodingParams(temperature=0.5, top_p=0.8, max_new_tokens=17, ignore_eos=True, seed=3),
        "stop": DecodingParams(temperature=3.0, max_new_tokens=16, stop=("a", "5"), ignore_eos=True, seed=1),
    }
    results = dict(
        zip(asks, await asyncio.gather(*(engine.generate(PROMPT, 4, d) for d in asks.values())), strict=True)
    )
    assert engine.batch_stats.largest_batch == 20
    reference = greedy_reference(engine, results["greedy"].prompt_token_ids, 12)
    assert tokens(results["greedy"]) == tokens(results["top1"]) == [reference] * 4
    for name, d in asks.items():
        for c in results[name].completions:
            expected = recompute_logprobs(engine, results[name].prompt_token_ids, c.token_ids, d.temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
            if name == "stop":
                assert c.finish_reason in ("stop", "length")
                assert any(c.text.endswith(s) for s in d.stop) == (c.finish_reason == "stop")
            else:
                assert (len(c.token_ids), c.finish_reason) == (d.max_new_tokens, "length")
    assert "stop" in {c.finish_reason for c in results["stop"].completions}
    hot = {t for c in results["hot"].completions for t in c.token_ids}
    assert len(hot) > 1  # sampled, not greedy


async def test_cancelling_one_request_leaves_the_others_untouched() -> None:
    engine = tiny_engine(DEVICE)
    keep = DecodingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=9)
    alone = await engine.generate(PROMPT, 3, keep)
    pause = PauseAt(engine, 6)
    doomed = asyncio.create_task(engine.generate(LONG_PROMPT, 4, DecodingParams(max_new_tokens=200, ignore_eos=True)))
    kept = asyncio.create_task(engine.generate(PROMPT, 3, keep))
    try:
        await pause.wait()
        doomed.cancel()
    finally:
        pause.release()
    result = await kept
    await asyncio.gather(doomed, return_exceptions=True)
    assert doomed.cancelled()
    assert len(engine.batch_stats.cancelled_steps) == 1 and engine.batch_stats.cancelled_steps[0] < 10
    assert tokens(result) == tokens(alone)
    assert engine.batch_stats.steps < 200  # the cancelled rows did not run to their end


async def test_in_flight_update_versions_are_per_row(tmp_path) -> None:
    engine = tiny_engine(DEVICE, in_flight_weight_updates=True)
    transport = CheckpointTransport(tmp_path, timedelta(seconds=5))
    transport.send([(n, t.detach() + 0.5) for n, t in engine.named_weights().items()], version=1)
    pause = PauseAt(engine, 5)
    early = asyncio.create_task(engine.generate(PROMPT, 2, DecodingParams(max_new_tokens=30, ignore_eos=True)))
    try:
        await pause.wait()
        update = asyncio.create_task(engine.receive_weights(transport, 1, None, timedelta(seconds=5)))
        await until(lambda: engine._gate.waiting, "the update to wait for the weights")
    finally:
        pause.release()
    await update
    late = await engine.generate(PROMPT, 2, DecodingParams(max_new_tokens=5, ignore_eos=True))
    first = await early
    assert first.weight_version == 0 and all(c.weight_versions == (0, 1) for c in first.completions)
    assert late.weight_version == 1 and all(c.weight_versions == (1,) for c in late.completions)


def test_token_id_prompts_are_used_exactly_as_given() -> None:
    engine = tiny_engine(DEVICE)
    tok = engine.tokenizer
    ids = [tok.bos_token_id, *tok(PROMPT)["input_ids"]]  # a BOS the tokenizer would not add
    result = engine.generate_blocking(ids, 2, GREEDY)
    assert result.prompt_token_ids == ids
    assert tokens(result) == [greedy_reference(engine, ids, 30)] * 2
    as_text = engine.generate_blocking(PROMPT, 1, GREEDY)
    assert as_text.prompt_token_ids == tok(PROMPT)["input_ids"] != ids
    with pytest.raises(UnsupportedRequest, match=rf"^prompt_token_ids\[1\]: {len(tok)} is outside the vocabulary"):
        engine.generate_blocking([5, len(tok)], 1, GREEDY)
    with pytest.raises(UnsupportedRequest, match="^prompt_token_ids"):
        engine.generate_blocking([-1], 1, GREEDY)
    with pytest.raises(UnsupportedRequest, match="^prompt_token_ids: empty"):
        engine.generate_blocking([], 1, GREEDY)


async def test_rows_beyond_the_batch_bound_wait_and_the_cache_grows_and_compacts() -> None:
    engine = tiny_engine(DEVICE, max_batch_rows=3)
    first = asyncio.create_task(engine.generate(PROMPT, 5, DecodingParams(temperature=0.0, max_new_tokens=60)))
    await asyncio.sleep(0)
    longer = asyncio.create_task(engine.generate(LONG_PROMPT, 2, DecodingParams(temperature=0.0, max_new_tokens=90)))
    a, b = await first, await longer
    assert engine.batch_stats.largest_batch == 3
    assert engine._batch.cache.length >= len(b.prompt_token_ids) + 90
    assert engine.batch_stats.shifts >= 1
    ref_a = greedy_reference(engine, a.prompt_token_ids, 60)
    ref_b = greedy_reference(engine, b.prompt_token_ids, 90)
    assert all(t == ref_a[: len(t)] for t in tokens(a)) and all(t == ref_b[: len(t)] for t in tokens(b))


async def test_a_failing_step_fails_the_batch_not_the_engine() -> None:
    engine = tiny_engine(DEVICE)
    calls = []

    def fail_third(module, args, output) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")

    hook = engine.model.register_forward_hook(fail_third)
    try:
        with pytest.raises(RuntimeError, match="injected step failure"):
            await engine.generate(PROMPT, 2, GREEDY)
    finally:
        hook.remove()
    again = await engine.generate(PROMPT, 2, GREEDY)
    assert tokens(again) == [greedy_reference(engine, again.prompt_token_ids, 30)] * 2


def test_grouped_decode_attention_is_attention_over_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 6, 2, 10, 8
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    hidden = torch.rand(batch, 1, 1, length) < 0.4
    hidden[:, :, :, -1] = False  # every row sees at least one column
    mask = hidden.float() * torch.finfo(torch.float32).min
    out, _ = grouped_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=dim**-0.5)
    # The reference: every query head against its own copy of its KV head (h -> h // 3), as repeat_kv pairs them.
    k, v = key.repeat_interleave(heads // kv_heads, dim=1), value.repeat_interleave(heads // kv_heads, dim=1)
    weights = (query @ k.transpose(-1, -2) * dim**-0.5 + mask).softmax(-1)
    assert out.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(out, (weights @ v).transpose(1, 2), atol=1e-5, rtol=0)


def test_a_decode_step_reads_only_its_span_and_idle_slots_only_themselves() -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    config.vocab_size = 50
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 50, (1, 10))
    with torch.no_grad():
        expected = model(ids).logits[0, -1]
        prefill = model(input_ids=ids[:, :9], past_key_values=DynamicCache(), use_cache=True).past_key_values
        cache = SlotCache(3, torch.device("cpu"))
        cache.allocate(prefill, 256)
        span = span_for(20, cache.length)
        assert span < cache.length
        for t in cache.keys + cache.values:
            t[:, :, span:] = float("nan")  # were they read, every logit would be NaN
        cache.load_prompt([0, 2], prefill, column=20)  # the prompt in columns 11..19 of slots 0 and 2
        step = DecodeStep(model, cache, pad_token_id=0, graphs=False)
        step.tokens[:, 0] = ids[0, 9]
        step.starts.fill_(11)
        step.active.copy_(torch.tensor([True, False, True]))
        cache.column.fill_(20)
        logits = step.run(3, column=20)
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[2], expected, atol=1e-5, rtol=0)
    # Slot 1 is idle: it attends to its own column only, which holds this step's token at position 0.
    with torch.no_grad():
        alone = model(ids[:, 9:]).logits[0, -1]
    torch.testing.assert_close(logits[1], alone, atol=1e-5, rtol=0)


async def test_requests_queued_with_prompts_of_one_length_share_one_prefill_pass() -> None:
    engine = tiny_engine(DEVICE)
    passes: list[tuple[int, int]] = []

    def record(module, args, kwargs, output) -> None:
        passes.append(tuple(kwargs["input_ids"].shape))

    hook = engine.model.register_forward_hook(record, with_kwargs=True)
    short = DecodingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    same_length = ["1+2=", "3+4=", "5+6="]
    try:
        with engine.exclusive():  # the scheduler waits for the weights while the requests queue up
            tasks = [asyncio.create_task(engine.generate(p, 2, short)) for p in same_length]
            await until(lambda: len(engine._batch._queue) == 3, "three queued requests")
            tasks.append(asyncio.create_task(engine.generate(LONG_PROMPT, 2, short)))
            await until(lambda: len(engine._batch._queue) == 4, "the fourth request queued")
        results = await asyncio.gather(*tasks)
    finally:
        hook.remove()
    prompt_len = len(results[0].prompt_token_ids)
    assert [p for p in passes if p[1] > 1] == [(3, prompt_len), (1, len(results[3].prompt_token_ids))]
    for result in results:
        assert tokens(result) == [greedy_reference(engine, result.prompt_token_ids, 6)] * 2
