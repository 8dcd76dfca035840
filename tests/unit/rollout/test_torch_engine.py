"""TorchEngine on a tiny random qwen2 with the character tokenizer: one property per test.

DOCKYARD_TEST_DEVICE=cuda runs the same checks on a GPU (default: cpu).
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from dockyard.models import build_char_tokenizer, build_random_model
from services.rollout import engine as engine_module
from services.rollout.decoding import DecodingParams
from services.rollout.engine import GenerationCancelled, GenerationResult, UnsupportedRequest
from services.rollout.torch_engine import TorchEngine

TINY = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
}
PROMPT = "1+2="


def tiny_engine(device: str, **options) -> TorchEngine:
    """A TorchEngine on the TINY model (seed 0) with the character tokenizer; `options` go to TorchEngine."""
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_random_model(
        TINY,
        len(tok),
        seed=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    return TorchEngine(model, tok, device, **options)


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return tiny_engine(os.environ.get("DOCKYARD_TEST_DEVICE", "cpu"))


def run(engine: TorchEngine, n: int, **sampling) -> GenerationResult:
    return engine.generate_blocking(PROMPT, n, DecodingParams(**sampling))


def recompute_logprobs(
    engine: TorchEngine, prompt_ids: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """What the trainer does: one forward pass of prompt + completion, temperature-scaled log_softmax."""
    ids = torch.tensor([prompt_ids + tokens], device=engine.device)
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt_ids) - 1 : -1].float().cpu()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def greedy_reference(engine: TorchEngine, prompt_ids: list[int], steps: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(engine.model(torch.tensor([ids], device=engine.device)).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_result_shapes(engine: TorchEngine) -> None:
    engine.set_weight_version(3)
    try:
        result = run(engine, 5, temperature=1.0, max_new_tokens=8, seed=0)
    finally:
        engine.set_weight_version(0)
    assert result.prompt_token_ids == engine.tokenizer(PROMPT)["input_ids"]
    assert result.weight_version == 3
    assert len(result.completions) == 5
    for c in result.completions:
        assert 1 <= len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in {"eos", "stop", "length"}
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_k": 10, "top_p": 0.9},  # truncation must not leak into the logprobs
        {"temperature": 1.0},
        {"temperature": 2.5, "top_k": 5},
        {"temperature": 0.0},
    ],
)
def test_logprobs_match_a_forward_pass(engine: TorchEngine, sampling: dict) -> None:
    result = run(engine, 4, max_new_tokens=12, seed=7, ignore_eos=True, **sampling)
    for c in result.completions:
        expected = recompute_logprobs(engine, result.prompt_token_ids, c.token_ids, sampling["temperature"])
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_is_argmax_decoding_and_deterministic(engine: TorchEngine) -> None:
    first = run(engine, 3, temperature=0.0, max_new_tokens=10, ignore_eos=True)
    second = run(engine, 3, temperature=0.0, max_new_tokens=10, ignore_eos=True)
    reference = greedy_reference(engine, first.prompt_token_ids, 10)
    for c in first.completions + second.completions:
        assert c.token_ids == reference


def test_same_seed_same_samples_different_seed_different(engine: TorchEngine) -> None:
    a = run(engine, 4, temperature=1.0, max_new_tokens=16, seed=11, ignore_eos=True)
    b = run(engine, 4, temperature=1.0, max_new_tokens=16, seed=11, ignore_eos=True)
    c = run(engine, 4, temperature=1.0, max_new_tokens=16, seed=12, ignore_eos=True)
    tokens = lambda r: [x.token_ids for x in r.completions]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert [x.logprobs for x in a.completions] == [x.logprobs for x in b.completions]
    assert tokens(a) != tokens(c)
    # The rows of one group are independent samples, not copies.
    assert len({tuple(t) for t in tokens(a)}) > 1


def test_eos_ends_a_completion_and_no_padding_follows(engine: TorchEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    # Near-uniform sampling over ~60 tokens: some rows of the group hit eos, some do not.
    result = run(engine, 16, temperature=5.0, max_new_tokens=48, seed=0)
    reasons = {c.finish_reason for c in result.completions}
    assert reasons == {"eos", "length"}, reasons
    for c in result.completions:
        expected = recompute_logprobs(engine, result.prompt_token_ids, c.token_ids, 5.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
        if c.finish_reason == "eos":
            assert c.token_ids[-1] == eos
            assert eos not in c.token_ids[:-1]
            assert len(c.token_ids) <= 48  # an eos drawn as the last allowed token still ends with "eos"
            assert "<eos>" not in c.text
        else:
            assert eos not in c.token_ids
            assert len(c.token_ids) == 48


def test_ignore_eos_gives_exactly_max_new_tokens(engine: TorchEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    result = run(engine, 16, temperature=5.0, max_new_tokens=48, seed=0, ignore_eos=True)
    assert all(len(c.token_ids) == 48 and c.finish_reason == "length" for c in result.completions)
    # Same seed as the eos test: generation really went past sampled eos tokens.
    assert any(eos in c.token_ids[:-1] for c in result.completions)


def test_stop_string_cut_right_after_the_completing_token(engine: TorchEngine) -> None:
    stops = ("a", "5")
    result = run(engine, 16, temperature=3.0, max_new_tokens=16, seed=1, stop=stops, ignore_eos=True)
    assert {"stop", "length"} <= {c.finish_reason for c in result.completions}
    for c in result.completions:
        before = engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in stops)
        if c.finish_reason == "stop":
            assert any(c.text.endswith(s) for s in stops)
        else:
            assert not any(s in c.text for s in stops)
            assert len(c.token_ids) == 16


def test_special_tokens_never_complete_a_stop_string(engine: TorchEngine) -> None:
    # "<pad>", "<eos>", "<bos>", "<unk>" contain these letters, but a completion's text skips them.
    specials = set(engine.tokenizer.all_special_ids)
    stops = ("a", "o", "s")
    result = run(engine, 16, temperature=5.0, max_new_tokens=24, seed=2, stop=stops, ignore_eos=True)
    assert any(t in specials for c in result.completions for t in c.token_ids), "no special token was sampled"
    for c in result.completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] not in specials
            assert any(c.text.endswith(s) for s in stops)


def test_multi_token_stop_string_does_not_straddle_the_prompt(engine: TorchEngine) -> None:
    greedy = run(engine, 1, temperature=0.0, max_new_tokens=4, ignore_eos=True).completions[0]
    # The prompt ends with "=" and greedy continues with "="s: "==" is complete only at the second token.
    assert PROMPT.endswith("=") and greedy.text.startswith("==")
    result = run(engine, 2, temperature=0.0, max_new_tokens=8, stop=("==",))
    for c in result.completions:
        assert (c.text, c.finish_reason) == ("==", "stop")
        assert len(c.token_ids) == len(c.logprobs) == 2


def test_top_k_1_equals_greedy(engine: TorchEngine) -> None:
    greedy = run(engine, 1, temperature=0.0, max_new_tokens=12, ignore_eos=True).completions[0]
    top1 = run(engine, 4, temperature=1.3, top_k=1, max_new_tokens=12, seed=5, ignore_eos=True)
    assert all(c.token_ids == greedy.token_ids for c in top1.completions)


def test_unproducible_stop_string_is_refused(engine: TorchEngine) -> None:
    with pytest.raises(UnsupportedRequest, match="^sampling.stop:"):
        run(engine, 1, temperature=1.0, max_new_tokens=4, stop=("€",))


def test_named_weights_are_the_live_parameters(engine: TorchEngine) -> None:
    weights = engine.named_weights()
    params = dict(engine.model.named_parameters())
    assert weights.keys() == params.keys()
    assert all(weights[k].data_ptr() == params[k].data_ptr() for k in params)
    assert engine.num_parameters == sum(p.numel() for p in params.values())


async def test_generation_does_not_block_the_event_loop(engine: TorchEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        await engine.generate(PROMPT, 8, DecodingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=0))
        assert ticks >= 3
    finally:
        task.cancel()


async def test_a_cancelled_generation_stops_at_its_next_decode_step() -> None:
    engine = tiny_engine(os.environ.get("DOCKYARD_TEST_DEVICE", "cpu"))
    # The fifth forward pass (the prefill, then decode steps) waits until the caller has cancelled.
    reached, go, calls = threading.Event(), threading.Event(), []

    def pause_once(module, args, output) -> None:
        calls.append(1)
        if len(calls) == 5:
            reached.set()
            go.wait()

    hook = engine.model.register_forward_hook(pause_once)
    long = DecodingParams(temperature=1.0, max_new_tokens=100, ignore_eos=True, seed=0)
    task = asyncio.create_task(engine.generate(PROMPT, 2, long))
    try:
        await asyncio.to_thread(reached.wait)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        go.set()
        hook.remove()
    short = await engine.generate(PROMPT, 1, DecodingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    assert task.cancelled()
    # No result, and it left a step past the pause (the paused one was its fourth decode step).
    assert list(engine.batch_stats.cancelled_steps) == [4]
    assert len(short.completions[0].token_ids) == 4


async def test_a_stream_gives_every_token_as_it_is_sampled_and_the_same_result(engine: TorchEngine) -> None:
    decoding = DecodingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3)
    # Lockstep: each forward pass after the prefill waits until on_deltas has had the previous step's tokens,
    # so they were handed on while the generation ran, not with its end.
    taken, passes = threading.Semaphore(0), []

    def count_pass(module, args, output) -> None:
        passes.append(1)

    def before_pass(module, args) -> None:
        if passes:
            assert taken.acquire(timeout=60), "the stream's on_deltas never had a step's tokens"

    def on_deltas(step: list) -> None:
        deltas.append(step)
        taken.release()

    deltas: list[list] = []
    hooks = [engine.model.register_forward_pre_hook(before_pass), engine.model.register_forward_hook(count_pass)]
    try:
        result = await engine.generate_stream(PROMPT, 3, decoding, on_deltas)
    finally:
        for hook in hooks:
            hook.remove()
    assert isinstance(result, GenerationResult)
    # One call per decode step; the step that ends the rows reports its tokens in the result alone.
    assert len(deltas) == 11 and all(len(step) == 3 for step in deltas)
    for i, c in enumerate(result.completions):
        mine = [d for step in deltas for d in step if d.index == i]
        assert [t for d in mine for t in d.token_ids] == c.token_ids[:11]
        assert [lp for d in mine for lp in d.logprobs] == c.logprobs[:11]
    assert result == await engine.generate(PROMPT, 3, decoding)  # seeded: the same group either way


async def test_a_paced_stream_hands_steps_on_together_and_loses_none(engine: TorchEngine, monkeypatch) -> None:
    """With an interval, the tokens of the steps between two hand-offs go in one, at the first step of each
    new multiple of the interval (a fake clock moved a quarter interval per forward pass); the tokens held when
    the rows end are in the result alone."""
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    hook = engine.model.register_forward_hook(lambda module, args, output: now.__setitem__(0, now[0] + 0.25))
    decoding = DecodingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3)
    handed: list[list] = []
    try:
        result = await engine.generate_stream(PROMPT, 3, decoding, handed.append, interval=1.0)
    finally:
        hook.remove()
    # Token t is sampled at 0.25 t: the first at once, then at 1.0 (tokens 2 to 4) and 2.0 (5 to 8); 9 to 11
    # are held when the step of the 12th ends the rows.
    assert [[len(d.token_ids) for d in step] for step in handed] == [[1] * 3, [3] * 3, [4] * 3]
    assert all([d.index for d in step] == [0, 1, 2] for step in handed)
    for i, c in enumerate(result.completions):
        assert [t for step in handed for t in step[i].token_ids] == c.token_ids[:8]
        assert [lp for step in handed for lp in step[i].logprobs] == c.logprobs[:8]
    assert result == await engine.generate(PROMPT, 3, decoding)


async def test_cancelling_a_stream_stops_its_rows_and_its_deltas() -> None:
    engine = tiny_engine(os.environ.get("DOCKYARD_TEST_DEVICE", "cpu"))
    steps: list[list] = []
    first = asyncio.Event()

    def on_deltas(step: list) -> None:
        steps.append(step)
        first.set()

    long = DecodingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
    stream = asyncio.ensure_future(engine.generate_stream(PROMPT, 2, long, on_deltas))
    await first.wait()
    stream.cancel()  # the reader went away
    with pytest.raises(asyncio.CancelledError):
        await stream
    seen = len(steps)
    short = await engine.generate(PROMPT, 1, DecodingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    assert {d.index for d in steps[0]} <= {0, 1} and len(short.completions[0].token_ids) == 4
    assert len(steps) == seen  # nothing handed on once it was cancelled, steps in flight then included
    (cancelled,) = engine.batch_stats.cancelled_steps  # it left the batch long before its 400 tokens
    assert cancelled < 399


async def test_a_failing_on_deltas_stops_the_rows_with_its_error() -> None:
    engine = tiny_engine(os.environ.get("DOCKYARD_TEST_DEVICE", "cpu"))
    calls = []

    def on_deltas(step: list) -> None:
        calls.append(step)
        raise ValueError("the consumer broke")

    long = DecodingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
    with pytest.raises(ValueError, match="the consumer broke"):
        await engine.generate_stream(PROMPT, 2, long, on_deltas)
    short = await engine.generate(PROMPT, 1, DecodingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    assert len(calls) == 1 and len(short.completions[0].token_ids) == 4
    (cancelled,) = engine.batch_stats.cancelled_steps
    assert cancelled < 399


def test_a_generation_cancelled_before_its_first_step_gives_no_result(engine: TorchEngine) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled) as raised:
        engine.generate_blocking(PROMPT, 2, DecodingParams(temperature=1.0, max_new_tokens=50, ignore_eos=True), cancel)
    assert raised.value.steps == 0  # it never joined the batch


def test_policy_generation_ignore_eos_reaches_the_engine_through_the_request(engine: TorchEngine) -> None:
    """policy.generation.ignore_eos, as the collector sends it and the rollout reads it, runs past sampled eos."""
    from dockyard.config import GenerationConfig
    from services.coordinator.collector import sampling_params
    from services.rollout.decoding import decoding_from_proto

    def sample(ignore_eos: bool) -> GenerationResult:
        gen = GenerationConfig(temperature=5.0, max_new_tokens=48, ignore_eos=ignore_eos)
        decoding = decoding_from_proto(sampling_params(gen, seed=0), max_new_tokens_ceiling=4096)
        return engine.generate_blocking(PROMPT, 16, decoding)

    eos = engine.tokenizer.eos_token_id
    stopped, kept_going = sample(False), sample(True)
    assert "eos" in {c.finish_reason for c in stopped.completions}
    assert all(len(c.token_ids) == 48 and c.finish_reason == "length" for c in kept_going.completions)
    assert any(eos in c.token_ids[:-1] for c in kept_going.completions)
