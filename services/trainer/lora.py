"""LoRA on the trainer's policy (peft): adapters in, merged weights out, adapters saved and restored.

    HF causal LM ─add_adapters(policy.lora)─> the same model, each target Linear wrapped by peft:
        <module>.base_layer.{weight,bias}   frozen, as loaded
        <module>.lora_{A,B}.default.weight  trained (B starts at zero: the step-0 policy is the base)
    (peft name, tensor) ─merged─> (base HF name, W + (alpha / rank)·B·A), one tensor at a time
        ─> the weight sync (named_weights) and the checkpoint's merged HF folder
    adapter state ─save_adapter─> <checkpoint>/adapter/{adapter_model.safetensors, adapter_config.json}
        ─load_adapter─> the same adapters on a freshly loaded base (resume)

Guarantees: only adapter parameters require gradients; the base weights are
never modified (the merge is computed on the fly, never merged in place), so
the base with adapters off (`base_only`) is exactly the loaded model, the
reference policy without a second copy. `merged` yields every parameter (or
state-dict entry) of the plain model under its plain name and shape, in the
plain model's order, so a receiver built from the base config cannot tell a
LoRA policy from a fully trained one. A target list that matches no linear
layer, or matches anything but linear layers or a tied weight, raises
ConfigError at load. On a mixture-of-experts policy that leaves the attention
projections: the experts' fused 3-D weights and the router take no adapters.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dockyard.config import ConfigError, LoraConfig
from dockyard.models.moe import moe_family

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # inside a checkpoint folder
_PEFT_PREFIX = "base_model.model."  # peft's prefix of the wrapped model's state-dict keys


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """Wrap the target linear layers of `model` in place; returns the PeftModel that owns the adapters.

    Keep training `model` itself (`peft.get_base_model() is model`): it stays a plain
    transformers model whose forward runs base + adapters.
    """
    import peft
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    if moe_family(model.config) is not None:
        _check_moe_targets(model, lora)
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model" and the like
        raise ConfigError(f"policy.lora.target_modules: {exc}") from None
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    odd = sorted(name for name, m in layers.items() if not isinstance(m, LoraLinear) or m.fan_in_fan_out)
    if odd:
        raise ConfigError(f"policy.lora.target_modules: only nn.Linear layers take adapters here, not {odd[:4]}")
    # A tied weight (lm_head with tied embeddings) is sent once under its other name: its merge would be lost.
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = sorted(n for n, m in layers.items() if len(names[id(m.base_layer.weight)]) > 1)
    if tied:
        raise ConfigError(f"policy.lora.target_modules: {tied[:4]} share their weight with another layer (tied)")
    return wrapped


def _check_moe_targets(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Every target of an MoE policy names nn.Linear layers: its experts are fused 3-D weights, its router no Linear.

    peft would otherwise wrap the experts with a parameter adapter (its merge and names are not the plain
    model's) or, for a family it knows no mapping for, match nothing and silently train attention only.
    """
    linear = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if missing := sorted(set(lora.target_modules) - linear):
        raise ConfigError(
            f"policy.lora.target_modules: {missing} name no nn.Linear layer of this mixture-of-experts policy; "
            "only attention takes adapters: [q_proj, k_proj, v_proj, o_proj]"
        )


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """{module name: alpha / rank} of every adapted layer of `model` (names as in model.named_modules)."""
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def plain_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    return name.replace(".base_layer.", ".")


def merged(
    named: Iterable[tuple[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    scale: Mapping[str, float],
    full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, tensor) for each non-adapter entry of `named`; an adapted weight W comes merged.

    `tensors` holds the adapters by their peft names; `full` turns a (possibly sharded)
    tensor into the whole one, called once per tensor used, in the same order on every rank.
    The merge is computed in fp32 and returned in W's dtype; W itself is left alone.
    """
    for name, tensor in named:
        if is_adapter(name):
            continue
        module, _, leaf = name.rpartition(".")
        whole = full(tensor)
        if module.endswith(".base_layer") and leaf == "weight":
            owner = module.removesuffix(".base_layer")
            a = full(tensors[f"{owner}.lora_A.{ADAPTER}.weight"]).float()
            b = full(tensors[f"{owner}.lora_B.{ADAPTER}.weight"]).float()
            whole = (whole.float() + (b @ a) * scale[owner]).to(whole.dtype)
        yield plain_name(name), whole


def merged_parameters(
    model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged` over the parameters of the adapted `model` (what the weight sync sends)."""
    named = dict(model.named_parameters())
    return merged(named.items(), named, scalings(model), full)


@contextlib.contextmanager
def base_only(model: torch.nn.Module, wrapped: PeftModel) -> Iterator[torch.nn.Module]:
    """`model` run as its base alone, in eval mode (as a frozen reference copy is): the reference
    policy without a second copy. The model's train/eval mode comes back afterwards."""
    training = model.training
    model.eval()
    try:
        with wrapped.disable_adapter():
            yield model
    finally:
        model.train(training)


def save(model: PreTrainedModel, wrapped: PeftModel, folder: Path, state: Mapping[str, torch.Tensor]) -> None:
    """Write the merged model as a Hugging Face folder and peft's adapter folder under ADAPTER_DIR.

    `state` is the full state dict of the adapted `model` (no peft prefix), e.g. gathered from all ranks.
    """
    model.save_pretrained(folder, state_dict=dict(merged(state.items(), state, scalings(model))))
    adapter_state = {_PEFT_PREFIX + k: v for k, v in state.items() if is_adapter(k)}
    wrapped.save_pretrained(str(folder / ADAPTER_DIR), state_dict=adapter_state)


def load_adapter(wrapped: PeftModel, folder: Path, lora: LoraConfig) -> None:
    """Load the adapter weights of a checkpoint into `wrapped` (made from the same policy.lora)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((folder / "adapter_config.json").read_text())
    mine = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    theirs = {
        "r": saved.get("r"),
        "lora_alpha": saved.get("lora_alpha"),
        "target_modules": sorted(saved.get("target_modules") or []),
    }
    if mine != theirs:
        raise ConfigError(f"policy.lora {mine} differs from the checkpoint's adapter {theirs} in {folder}")
    result = set_peft_model_state_dict(wrapped, load_file(folder / "adapter_model.safetensors"))
    missing = [k for k in result.missing_keys if is_adapter(k)]
    if result.unexpected_keys or missing:
        raise ValueError(f"adapter in {folder} does not fit the policy: {(missing + result.unexpected_keys)[:4]}")
