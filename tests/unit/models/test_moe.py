"""Which mixture-of-experts policies load, and what is refused about them, with a message naming why."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from dockyard.config import ConfigError
from dockyard.models.load import load_policy
from dockyard.models.moe import MOE_FAMILIES, TINY_MOE, check_moe_config, checkpoint_layout, moe_family, num_experts
from dockyard.rpc.errors import InvalidArgument
from services.rollout.job_engines import build_engine
from services.rollout.torch_engine import _check_moe
from tests.unit.rollout.test_moe_engine import moe_config


def test_families_and_expert_counts() -> None:
    for family in MOE_FAMILIES:
        fields = {k: v for k, v in TINY_MOE[family].items() if k != "model_type"}
        config = AutoConfig.for_model(family, **fields)
        assert moe_family(config) == family and num_experts(config) in (4, 8)
    dense = AutoConfig.for_model("qwen2", hidden_size=32, num_attention_heads=2)
    assert moe_family(dense) is None and num_experts(dense) == 0
    check_moe_config(dense)  # a dense model passes untouched


def test_an_moe_family_outside_the_supported_ones_is_refused() -> None:
    config = AutoConfig.for_model("qwen2_moe", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match="'qwen2_moe' model is not supported; supported MoE families are qwen3_moe"):
        check_moe_config(config)


def test_router_jitter_is_refused_at_load() -> None:
    cfg = moe_config("mixtral", "+policy.model.router_jitter_noise=0.1")
    with pytest.raises(ConfigError, match="router_jitter_noise=0.1 perturbs the router in training only"):
        load_policy(cfg.policy)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_aux_loss_is_switched_off_at_load(family: str) -> None:
    cfg = moe_config(family, "+policy.model.output_router_logits=true")
    model, tokenizer = load_policy(cfg.policy)
    assert model.config.output_router_logits is False
    out = model(torch.tensor([tokenizer("1+2=")["input_ids"]]))
    assert getattr(out, "aux_loss", None) is None and getattr(out, "router_logits", None) is None


def test_the_engine_refuses_graphs_and_fp8_for_moe() -> None:
    with pytest.raises(ConfigError, match="kv_cache=static: the torch engine captures no CUDA graphs"):
        _check_moe("static", "auto", torch.device("cuda"))
    with pytest.raises(ConfigError, match="precision=fp8: not supported for mixture-of-experts"):
        _check_moe("auto", "fp8", torch.device("cuda"))
    _check_moe("auto", "auto", torch.device("cuda"))  # auto: eager decode, no refusal
    _check_moe("static", "auto", torch.device("cpu"))  # CPU never captures graphs
    # What LoadPolicy answers (fp8 parses only for cluster.device=cuda; the refusal comes before any device use).
    cfg = moe_config("qwen3_moe", "policy.generation.precision=fp8", "cluster.device=cuda")
    with pytest.raises(InvalidArgument, match="fp8: not supported for mixture-of-experts"):
        asyncio.run(build_engine(cfg, "cpu"))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpoint_layout_is_what_save_pretrained_writes(family: str, tmp_path) -> None:
    model, _ = load_policy(moe_config(family).policy)
    model.save_pretrained(tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    mapped = dict(checkpoint_layout(family, model.named_parameters()))
    assert mapped.keys() == files.keys()  # per-expert names (Mixtral: block_sparse_moe.experts.<i>.w1/w2/w3)
    for name, tensor in files.items():
        assert torch.equal(mapped[name], tensor), name
    dense = [("model.layers.0.mlp.gate_proj.weight", torch.zeros(2, 2))]
    assert list(checkpoint_layout(None, dense)) == dense
