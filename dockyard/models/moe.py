"""Mixture-of-experts policies: which families dockyard runs, and what it refuses about them.

    trainer tensors (fused experts) ──checkpoint_layout(family)──> the HF files' names, one tensor per expert
    transformers config ──moe_family──> "qwen3_moe" / "mixtral" (checked end to end) / None (dense)
    loaded model ──check_moe_model──> ConfigError for an MoE it cannot keep token-faithful, else
        the router's load-balancing loss switched off (GRPO's loss is the only objective)

Guarantees:
- A dense model passes through untouched: nothing here changes a model without routed experts.
- An MoE model of a family outside `MOE_FAMILIES` is refused with a ConfigError naming the families
  that are supported: the engine and trainer were checked to route and score tokens alike only for those.
- Router jitter (Mixtral's `router_jitter_noise`, noise on the router input in training mode only)
  is refused: the trainer's routing would differ from the engine's by construction.
- `output_router_logits` is set False on every MoE model loaded: the trainer's loss is the GRPO
  loss alone (no auxiliary load-balancing term), and no forward spends time collecting router logits.
- `checkpoint_layout` maps the trainer's tensors (transformers' fused 3-D experts) onto the names and
  shapes `save_pretrained` writes (one tensor per expert; Mixtral's `block_sparse_moe`), views of the
  same memory and the same values: what an engine that loads checkpoint files (vLLM) takes unambiguously.
- `TINY_MOE` holds the small shapes the tests and examples/configs/tiny_moe.yaml build (head_dim 32:
  vLLM's CPU attention takes no smaller head).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dockyard.config import ConfigError
from dockyard.config.launch_rules import EXPERT_FIELDS

# Families whose generation, training, sync and checkpoints are tested (tests/unit/*/test_moe*.py).
MOE_FAMILIES = ("qwen3_moe", "mixtral")

# Config fields holding the number of routed experts, across transformers' MoE families.
_EXPERT_FIELDS = EXPERT_FIELDS

TINY_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    },
}


def num_experts(config: Any) -> int:
    """The number of routed experts per MoE layer of a transformers config (its text config); 0 for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in _EXPERT_FIELDS:
        value = getattr(text, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def moe_family(config: Any) -> str | None:
    """The model_type of an MoE config, or None for a dense one."""
    if num_experts(config) == 0:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(text.model_type)


def check_moe_config(config: Any) -> None:
    """Refuse the config of an MoE policy dockyard cannot keep token-faithful (ConfigError); a dense one passes."""
    family = moe_family(config)
    if family is None:
        return
    if family not in MOE_FAMILIES:
        raise ConfigError(
            f"policy: a mixture-of-experts {family!r} model is not supported; supported MoE families are "
            f"{', '.join(MOE_FAMILIES)} (engine and trainer are checked to compute the same logprobs only for those)"
        )
    text = config.get_text_config()
    if getattr(text, "router_jitter_noise", 0.0):
        raise ConfigError(
            f"policy: router_jitter_noise={text.router_jitter_noise} perturbs the router in training only, so the "
            "trainer would route tokens to other experts than the engine did; set it to 0"
        )


def check_moe_model(model: Any) -> None:
    """check_moe_config on the model's config, then its auxiliary router loss switched off."""
    check_moe_config(model.config)
    if moe_family(model.config) is not None:
        model.config.get_text_config().output_router_logits = False


# Per family: (the layer's MoE module on disk, names of gate, up and down on disk).
_ON_DISK = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def checkpoint_layout(
    family: str | None, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` under the checkpoint files' names and shapes; a dense model's (family None) pass unchanged.

    transformers holds `<layer>.mlp.experts.gate_up_proj` [experts, 2·ffn, hidden] (gate rows first) and
    `down_proj` [experts, hidden, ffn]; the files hold `<layer>.<module>.experts.<i>.<gate|up|down>.weight`.
    """
    if family not in _ON_DISK:
        yield from items
        return
    module, gate, up, down = _ON_DISK[family]
    for name, tensor in items:
        layer, sep, rest = name.partition(".mlp.")
        if not sep:
            yield name, tensor
        elif rest == "experts.gate_up_proj":
            ffn = tensor.shape[1] // 2
            for i in range(tensor.shape[0]):
                yield f"{layer}.{module}.experts.{i}.{gate}.weight", tensor[i, :ffn]
                yield f"{layer}.{module}.experts.{i}.{up}.weight", tensor[i, ffn:]
        elif rest == "experts.down_proj":
            for i in range(tensor.shape[0]):
                yield f"{layer}.{module}.experts.{i}.{down}.weight", tensor[i]
        else:  # the router (`gate.weight`), or a dense MLP layer of a model that mixes both
            yield f"{layer}.{module}.{rest}", tensor
