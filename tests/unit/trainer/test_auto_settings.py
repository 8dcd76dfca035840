"""`auto` compile and packing: on only where measured to pay, never where an explicit `true` is refused."""

from __future__ import annotations

import pytest
import torch

from dockyard.config import ConfigError, load_config_text
from services.trainer import packed_attention
from services.trainer.auto_settings import compiles_layers, packs_rows
from services.trainer.policy import PolicyTrainer

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  max_tokens_per_micro_batch: 64
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""


@pytest.fixture(autouse=True)
def c_compiler(monkeypatch) -> None:
    """As on a GPU machine with a C compiler, whatever this one has (Triton reads $CC first)."""
    monkeypatch.setenv("CC", "cc")


def config(*overrides: str):
    return load_config_text(CONFIG, list(overrides))


def test_the_defaults_are_auto() -> None:
    policy = config().policy
    assert policy.compile_layers == "auto" and policy.sequence_packing == "auto"


def test_auto_compiles_on_cuda_only_and_not_where_true_is_refused() -> None:
    policy = config().policy
    assert compiles_layers(policy, "cuda:0", layered=True)
    assert not compiles_layers(policy, "cpu", layered=True)
    assert not compiles_layers(policy, "cuda", layered=False)  # true would raise: no declared layer class
    moe = config("policy.model.model_type=qwen3_moe", "+policy.model.num_experts=4", "policy.record_routing=true")
    assert not compiles_layers(moe.policy, "cuda", layered=True)
    with pytest.raises(ConfigError, match="compile_layers"):  # where auto stays off, true is refused
        config(
            "policy.model.model_type=qwen3_moe",
            "+policy.model.num_experts=4",
            "policy.record_routing=true",
            "policy.compile_layers=true",
        )
    assert compiles_layers(config("policy.compile_layers=true").policy, "cpu", layered=True)
    assert not compiles_layers(config("policy.compile_layers=false").policy, "cuda", layered=True)


def test_auto_does_not_compile_without_a_c_compiler(monkeypatch) -> None:
    import services.trainer.auto_settings as auto

    policy = config().policy
    monkeypatch.delenv("CC")
    monkeypatch.setattr(auto.shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert auto.c_compiler_available() and compiles_layers(policy, "cuda", layered=True)
    monkeypatch.setattr(auto.shutil, "which", lambda name: None)
    assert not auto.c_compiler_available()
    assert not compiles_layers(policy, "cuda", layered=True)  # Triton could not build its launchers
    assert compiles_layers(config("policy.compile_layers=true").policy, "cuda", layered=True)  # as set


@pytest.mark.parametrize(
    "blocker",
    [
        "policy.max_tokens_per_micro_batch=null",
        "loss_fn.reduction=sequence",
        "loss_fn.name=gspo",
    ],
)
def test_auto_packs_only_where_true_would_be_accepted(blocker: str) -> None:
    assert packs_rows(config(), "cuda", varlen=True)
    assert not packs_rows(config(blocker), "cuda", varlen=True)  # auto: off, the job loads
    with pytest.raises(ConfigError, match="sequence_packing"):
        config(blocker, "policy.sequence_packing=true")


def test_auto_packs_on_cuda_with_the_varlen_kernel_only() -> None:
    assert not packs_rows(config(), "cpu", varlen=True)
    assert not packs_rows(config(), "cuda", varlen=False)
    assert packs_rows(config("policy.sequence_packing=true"), "cpu", varlen=False)
    assert not packs_rows(config("policy.sequence_packing=false"), "cuda", varlen=True)


def test_the_varlen_kernel_is_ready_for_half_precision_and_installed_models_only() -> None:
    policy = PolicyTrainer(config())
    model = policy.model
    assert packed_attention.installed(model)
    assert packed_attention.varlen_ready(model, torch.bfloat16) == (packed_attention.varlen_attn is not None)
    assert not packed_attention.varlen_ready(model, torch.float32)
    plain = torch.nn.Linear(2, 2)
    assert not packed_attention.varlen_ready(plain, torch.bfloat16)


def test_a_cpu_trainer_resolves_auto_to_eager_padded_rows() -> None:
    policy = PolicyTrainer(config())
    assert not policy.compiled and not policy.packing
    assert all(layer._compiled_call_impl is None for layer in policy.model.model.layers)
    packed = PolicyTrainer(config("policy.sequence_packing=true"))
    assert packed.packing
