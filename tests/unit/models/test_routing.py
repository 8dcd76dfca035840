"""Routing capture and replay (dockyard/models/routing.py) on tiny MoE policies, one property per test.

The engine side of the tests that need one is the torch engine with a hook that flips near ties: where
the k-th and the (k+1)-th experts' router probabilities lie within TIE of each other, it routes to the
(k+1)-th instead, with the weights the router gives those experts. That is what bf16 rounding does to an
engine on a GPU (the same token, another expert); here it happens on purpose, on CPU in float32, where
engine and trainer otherwise compute the same logprobs to rounding.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import yaml

from dockyard.config import ConfigError, load_config, load_config_text
from dockyard.experience.routing_layout import RoutingShape, from_bytes, to_bytes
from dockyard.experience.trainable import BatchError, validate_groups
from dockyard.models.load import load_policy
from dockyard.models.moe import MOE_FAMILIES
from dockyard.models.routing import NOT_RECORDED, RoutingRecorder, RoutingReplay, routers
from services.rollout.decoding import DecodingParams
from services.rollout.torch_engine import TorchEngine
from services.trainer.batch import build_batch
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.logprobs import sampled_logprobs
from services.trainer.micro_batches import plan
from services.trainer.policy import PolicyTrainer
from tests.unit.rollout.test_moe_engine import PROMPTS, moe_config, moe_engine

TIE = 0.01
DENSE = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request) -> str:
    return request.param


def test_bytes_round_trip_exactly_in_both_widths() -> None:
    for experts in (8, 256, 257, 4096):
        shape = RoutingShape(moe_layers=3, top_k=2, num_experts=experts)
        ids = np.random.default_rng(0).integers(0, experts, size=(5, 3, 2))
        data = to_bytes(ids, shape)
        assert len(data) == 5 * shape.bytes_per_position
        assert shape.dtype.itemsize == (1 if experts <= 256 else 2)
        np.testing.assert_array_equal(from_bytes(data, shape), ids)
    with pytest.raises(ValueError, match="not a whole number of positions"):
        from_bytes(b"\0" * 5, RoutingShape(3, 2, 8))


def captured(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, moe_layers, k] expert ids of one forward of `ids`."""
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder.recording() as layers:
        model(input_ids=ids)
    recorder.close()
    return recorder.stacked(layers).long().reshape(*ids.shape, len(layers), -1)


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return sampled_logprobs(model, ids, None, None, 1.0, entropy=False)[0]


def test_replaying_the_models_own_routing_changes_no_logprob(family: str) -> None:
    model, tokenizer = load_policy(moe_config(family).policy)
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"][:12], tokenizer(PROMPTS[2])["input_ids"][:12]])
    plain = logprobs(model, ids)
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.applied(captured(model, ids), replay=True):
        replayed = logprobs(model, ids)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    assert replay.take_counts() == (0, ids.numel() * len(routers(model)))


def test_replay_routes_to_the_recorded_experts_and_the_router_still_gets_gradient(family: str) -> None:
    model, tokenizer = load_policy(moe_config(family).policy)
    ids = torch.tensor([tokenizer(PROMPTS[1])["input_ids"]])
    experts = routers(model)[0].num_experts
    recorded = captured(model, ids)
    flipped = recorded.clone()
    flipped[0, 1, 0] = (recorded[0, 1, 0] + 1) % experts  # position 1, layer 0: the next experts
    flipped[0, 1, 0] = flipped[0, 1, 0].sort().values
    flipped[0, 2:] = NOT_RECORDED  # not recorded: the model's own choice
    seen: list[torch.Tensor] = []
    first = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    handle = first.register_forward_pre_hook(lambda _m, args: seen.append(args[1].sort(-1).values.clone()))
    replay = RoutingReplay(model)
    with replay.applied(flipped, replay=True):
        logprobs(model, ids).sum().backward()
    handle.remove()
    torch.testing.assert_close(seen[0][:2], flipped[0, :2, 0])  # the experts that ran: the recorded ones
    torch.testing.assert_close(seen[0][2:], recorded[0, 2:, 0])
    assert replay.take_counts() == (1, 2 * len(routers(model)))  # one of the recorded decisions differs
    grad = routers(model)[0].weight.grad
    assert grad is not None and grad.abs().sum() > 0 and torch.isfinite(grad).all()


def flip_near_ties(engine: TorchEngine) -> None:
    """Route the engine's tokens whose k-th and (k+1)-th experts lie within TIE to the (k+1)-th (module doc)."""

    def hook(module, _args, output):
        logits, _scores, own = output
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(module.top_k + 1, dim=-1)
        near = (top.values[:, -2] - top.values[:, -1]) < TIE
        chosen = torch.where(near[:, None], torch.cat([top.indices[:, :-2], top.indices[:, -1:]], -1), own)
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) if getattr(module, "norm_topk_prob", True) else weights
        return logits, weights.to(_scores.dtype), chosen

    for router in routers(engine.model):
        router.register_forward_hook(hook, prepend=True)  # before the engine's recorder: it records these


def generated_group(engine: TorchEngine) -> TrainingGroup:
    result = asyncio.run(engine.generate(PROMPTS[0], 4, DecodingParams(temperature=1.0, max_new_tokens=12, seed=7)))
    samples = []
    for i, c in enumerate(result.completions):
        routing = None if c.routing is None else np.concatenate([c.prompt_routing, c.routing])
        samples.append(
            Sample(f"g/{i}", result.prompt_token_ids, c.token_ids, c.logprobs, float(i % 2), True, routing=routing)
        )
    return TrainingGroup("g", samples)


def first_step(config, group: TrainingGroup) -> dict[str, float]:
    return PolicyTrainer(config).train_step([group])


def test_with_replay_recomputed_logprobs_match_the_generation_as_closely_as_a_dense_models(family: str) -> None:
    engine = moe_engine(family)
    flip_near_ties(engine)
    group = generated_group(engine)
    asyncio.run(engine.close())
    off = first_step(moe_config(family, "policy.record_routing=true"), group)
    on = first_step(moe_config(family, "policy.routing_replay=true"), group)
    grpo = {"num_prompts_per_step": 1, "num_generations_per_prompt": 4}
    dense_config = load_config_text(yaml.safe_dump({"policy": dense_policy(), "grpo": grpo}))
    model, tokenizer = load_policy(dense_config.policy)
    dense_engine = TorchEngine(model, tokenizer, "cpu")
    dense = first_step(dense_config, generated_group(dense_engine))
    asyncio.run(dense_engine.close())
    # The flipped near ties (a layer's own choice also depends on what the layers before it routed).
    assert 0 < off["routing_mismatch_fraction"] < 1 and 0 < on["routing_mismatch_fraction"] < 1
    assert on["gen_train_logprob_abs_diff"] <= max(10 * dense["gen_train_logprob_abs_diff"], 1e-6)
    assert off["gen_train_logprob_abs_diff"] > 100 * on["gen_train_logprob_abs_diff"]
    assert abs(on["gen_train_kl"]) <= max(10 * abs(dense["gen_train_kl"]), 1e-6)


def dense_policy() -> dict:
    return {
        "model": DENSE,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 4,
        "optimizer": {"lr": 0.01, "max_grad_norm": None},
        "generation": {"temperature": 1.0},
    }


def test_replay_on_a_dense_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="policy.routing_replay.*dense"):
        load_config_text(yaml.safe_dump({"policy": {"model": DENSE, "routing_replay": True}}))


def test_the_engine_records_what_the_trainer_compares(family: str) -> None:
    engine = moe_engine(family)
    group = generated_group(engine)
    asyncio.run(engine.close())
    metrics = first_step(moe_config(family, "policy.record_routing=true"), group)
    assert metrics["routing_mismatch_fraction"] == 0.0  # same weights, float32: the same experts everywhere
    assert metrics["gen_train_logprob_abs_diff"] < 1e-5
    sample = group.samples[0]
    assert sample.routing.shape[0] == len(sample.prompt_ids) + len(sample.completion_ids) - 1


def routed_sample(prompt: int, completion: int, value: int) -> Sample:
    routing = np.full((prompt + completion - 1, 2, 2), value, dtype=np.uint8)
    return Sample(f"g/{value}", [1] * prompt, [2] * completion, [-0.5] * completion, 1.0, True, routing=routing)


def test_the_batch_lays_routing_out_like_the_tokens_and_micro_batches_keep_it() -> None:
    samples = [routed_sample(3, 4, 5), routed_sample(2, 2, 6)]
    batch = build_batch([TrainingGroup("g", samples)], pad_token_id=0)
    assert batch.routing.shape == (2, 7, 2, 2)
    assert (batch.routing[0, :6] == 5).all() and (batch.routing[0, 6] == NOT_RECORDED).all()  # last token: none
    assert (batch.routing[1, :3] == 6).all() and (batch.routing[1, 3:] == NOT_RECORDED).all()  # and padding
    for packing in (False, True):
        micro = plan(batch, torch.zeros(2), rank=0, world=1, max_rows=2, max_tokens=64, packing=packing)
        [mb] = micro
        assert mb.routing.shape[:2] == mb.input_ids.shape  # one row of routing per input position
        assert int((mb.routing[..., 0, 0] == 5).sum()) == 6 and int((mb.routing[..., 0, 0] == 6).sum()) == 3
    short = routed_sample(3, 4, 5)
    short.routing = short.routing[:-1]
    with pytest.raises(BatchError, match=r"routing of 5 positions; its tokens need 6 \(all but the last\)"):
        validate_groups([TrainingGroup("g", [short])], vocab_size=10, max_length=64)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["policy.generation.backend=vllm"], "the vllm engine does not capture expert routing"),
        (["policy.generation.backend=sglang"], "the sglang engine does not capture expert routing"),
        (["policy.backend=jax"], "the jax trainer backend cannot replay routing"),
        (["policy.compile_layers=true"], "not inside compiled layers: set policy.compile_layers=false"),
    ],
)
def test_what_cannot_record_routing_is_refused_at_launch_naming_the_setting(overrides, words) -> None:
    for setting in ("policy.record_routing", "policy.routing_replay"):
        with pytest.raises(ConfigError, match=rf"{setting}.*{words}"):
            moe_config("qwen3_moe", f"{setting}=true", *overrides)


def test_multi_turn_jobs_may_record_and_replay_routing() -> None:
    agent = load_config("examples/configs/tiny_agent.yaml")  # its env: tools, so trials go through the endpoint
    for setting in ("policy.record_routing", "policy.routing_replay"):
        config = moe_config("qwen3_moe", f"{setting}=true", f"env.tools={agent.env.model_dump()['tools']}")
        assert config.env.agentic and config.policy.records_routing
