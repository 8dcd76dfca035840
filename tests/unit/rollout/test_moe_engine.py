"""The torch engine on tiny mixture-of-experts policies (Qwen3-MoE and Mixtral shapes), one property per test.

Each family is built from `policy.model` (random init, seed 0) exactly as a job builds it, so the engine and
the trainer (PolicyTrainer on the same config) hold the same weights. Batched decoding equals one request at a
time, the prefix cache changes nothing, the engine's logprobs equal the trainer's recompute in float32, and
weights the trainer pushes after a GRPO step are what the engine then generates with.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import torch
import yaml

from dockyard.config import MasterConfig, load_config_text
from dockyard.models.load import load_policy
from dockyard.models.moe import MOE_FAMILIES, TINY_MOE
from dockyard.weights.transports import CheckpointTransport
from services.rollout.decoding import DecodingParams
from services.rollout.torch_engine import TorchEngine
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.logprobs import sampled_logprobs
from services.trainer.policy import PolicyTrainer

PROMPTS = ["f(1)=3, f(2)=5, f=", "1+2=", "x*x+7 at 3 is "]


def moe_config(family: str, *overrides: str) -> MasterConfig:
    data = {
        "policy": {
            "model": TINY_MOE[family],
            "train_global_batch_size": 4,
            "train_micro_batch_size": 4,
            "optimizer": {"lr": 0.01, "max_grad_norm": None},
            "generation": {"temperature": 1.0},
        },
        "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 4},
    }
    return load_config_text(yaml.safe_dump(data), list(overrides))


def moe_engine(family: str, **options) -> TorchEngine:
    torch.set_num_threads(1)
    model, tokenizer = load_policy(moe_config(family).policy)
    return TorchEngine(model, tokenizer, "cpu", **options)


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The trainer's computation of the sampled tokens' logprobs: one forward pass of prompt + completion."""
    with torch.no_grad():
        logprobs, _ = sampled_logprobs(model, torch.tensor([prompt + tokens]), None, None, temperature, entropy=False)
    return logprobs[0, len(prompt) - 1 :]


def group(tokenizer, rewards: list[float]) -> TrainingGroup:
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    samples = []
    for i, (text, reward) in enumerate(zip(["2*x+1", "x+9", "x*x", "7"], rewards, strict=True)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples.append(Sample(f"g/{i}", list(prompt), ids, [-1.0] * len(ids), reward=reward, valid=True))
    return TrainingGroup(group_id="g", samples=samples)


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(family: str) -> TorchEngine:
    engine = moe_engine(family)
    yield engine
    asyncio.run(engine.close())


def test_batched_generation_equals_one_request_at_a_time(engine: TorchEngine) -> None:
    asks = [
        (prompt, 3, DecodingParams(temperature=1.0, top_k=20, max_new_tokens=12 + 4 * i, ignore_eos=True, seed=i))
        for i, prompt in enumerate(PROMPTS)
    ]

    async def together():
        return await asyncio.gather(*(engine.generate(*ask) for ask in asks))

    batched = asyncio.run(together())
    assert engine.batch_stats.largest_batch >= 6  # the rows did decode together
    for ask, joint in zip(asks, batched, strict=True):
        alone = engine.generate_blocking(*ask)
        assert [c.token_ids for c in joint.completions] == [c.token_ids for c in alone.completions]
        for a, b in zip(joint.completions, alone.completions, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_the_prefix_cache_gives_the_same_tokens(family: str, engine: TorchEngine) -> None:
    cached = moe_engine(family, prefix_cache_tokens=2048)
    prompt = engine.tokenize(PROMPTS[0])
    plain_prompt, cached_prompt = list(prompt), list(prompt)
    for turn in range(3):
        decoding = DecodingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=10 + turn)
        plain = engine.generate_blocking(plain_prompt, 2, decoding)
        reused = cached.generate_blocking(cached_prompt, 2, decoding)
        assert [c.token_ids for c in plain.completions] == [c.token_ids for c in reused.completions]
        for a, b in zip(plain.completions, reused.completions, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        plain_prompt = [*plain_prompt, *plain.completions[0].token_ids, 5, 6, 7 + turn]
        cached_prompt = [*cached_prompt, *reused.completions[0].token_ids, 5, 6, 7 + turn]
    assert cached.kv_cache_stats.prefill_tokens_saved > 0  # later turns reused the earlier turns' KV
    asyncio.run(cached.close())


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.0}])
def test_engine_logprobs_equal_the_trainers_recompute(family: str, engine: TorchEngine, sampling: dict) -> None:
    policy = PolicyTrainer(moe_config(family))
    for name, tensor in engine.named_weights().items():  # the same weights: the same config, the same seed
        assert torch.equal(tensor, dict(policy.model.named_parameters())[name]), name
    decoding = DecodingParams(max_new_tokens=24, ignore_eos=True, seed=3, **sampling)
    result = engine.generate_blocking(PROMPTS[0], 8, decoding)
    diffs = []
    for c in result.completions:
        expected = trainer_logprobs(policy.model, result.prompt_token_ids, c.token_ids, sampling["temperature"])
        diffs.append((torch.tensor(c.logprobs) - expected).abs())
    worst = float(torch.cat(diffs).max())
    print(f"\n{family} {sampling}: max |engine - trainer| logprob over {sum(map(len, diffs))} tokens = {worst:.3g}")
    assert worst <= 1e-5


def test_weights_the_trainer_pushes_are_what_the_engine_generates_with(family: str, tmp_path) -> None:
    engine = moe_engine(family)
    policy = PolicyTrainer(moe_config(family))
    metrics = policy.train_step([group(policy.tokenizer, [1.0, 0.0, 0.0, 0.0])])
    assert metrics["weight_version"] == 1.0
    transport = CheckpointTransport(tmp_path, timedelta(seconds=10))
    sent = transport.send(list(policy.named_weights()), version=1)
    report = asyncio.run(engine.receive_weights(transport, 1, None, timedelta(seconds=10)))
    assert report.checksum == sent.checksum and engine.weight_version == 1
    trained = dict(policy.named_weights())
    assert list(engine.named_weights()) == list(trained)  # fused expert tensors under the same names
    for name, tensor in engine.named_weights().items():
        assert torch.equal(tensor, trained[name]), name
    result = engine.generate_blocking(PROMPTS[1], 4, DecodingParams(temperature=1.0, max_new_tokens=16, seed=5))
    assert result.weight_versions == [1]
    for c in result.completions:
        expected = trainer_logprobs(policy.model, result.prompt_token_ids, c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
    asyncio.run(engine.close())
