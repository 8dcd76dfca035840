"""Load the job's policy the one way trainer and rollout both use.

A local Hugging Face folder goes through AutoModelForCausalLM/AutoTokenizer
.from_pretrained, exactly as a real checkpoint would; an architecture given
in `policy.model` is built with random weights and the built-in character
tokenizer (its vocabulary size unless `policy.model` names a larger
`vocab_size`). Nothing is ever downloaded from a hub. A missing folder raises
FileNotFoundError (it may appear later); an architecture that cannot be
built raises ConfigError (it never will). A vision-language folder (a config that only
AutoModelForImageTextToText knows, e.g. LLaVA) loads through that class, and `load_processor`
gives its processor (None for a text-only folder). A mixture-of-experts model passes
dockyard/models/moe.py's check (supported families, no router jitter) or raises ConfigError.
`folder_parameters` counts a folder's parameters from its safetensors headers, loading no tensor.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from dockyard.config import ConfigError, PolicyConfig
from dockyard.models.build import build_random_model
from dockyard.models.moe import check_moe_model
from dockyard.models.tokenizer import build_char_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(policy: PolicyConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer alone, as load_policy would give it (for services that never run the model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if policy.model_name is None:
        tokenizer = build_char_tokenizer()
    else:
        path = Path(policy.model_name)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"policy.model_name={policy.model_name!r} is not a local model folder (no config.json)"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    policy: PolicyConfig, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy model (in `dtype`, default policy.dtype) and its tokenizer."""
    # Offline by construction: a missing folder must fail here, not trigger a download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = dtype or DTYPES[policy.dtype]
    if policy.model_name is not None:
        path = Path(policy.model_name)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"policy.model_name={policy.model_name!r} is not a local model folder (no config.json)"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = _model_class(path).from_pretrained(path, dtype=dtype)
    else:
        tokenizer = build_char_tokenizer()
        # A vocab_size in policy.model builds a model of real shape (e.g. for benchmarks) beside the
        # small character tokenizer, whose ids are all below it.
        fields = dict(policy.model)
        vocab_size = int(fields.pop("vocab_size", len(tokenizer)))
        if vocab_size < len(tokenizer):
            raise ConfigError(f"policy.model.vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        try:
            model = build_random_model(fields, vocab_size=vocab_size, seed=policy.seed).to(dtype)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"policy.model: cannot build a {policy.model.get('model_type')!r} model: {exc}") from None
    check_moe_model(model)  # an MoE family or setting the engine and trainer cannot keep token-faithful
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def _model_class(path: Path) -> type:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language folder (e.g. LLaVA)."""
    config = type(AutoConfig.from_pretrained(path))
    if config not in MODEL_FOR_CAUSAL_LM_MAPPING and config in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_processor(policy: PolicyConfig) -> Any:
    """The image processor of a vision-language policy folder (AutoProcessor), or None for a text-only one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if policy.model_name is None:
        return None
    path = Path(policy.model_name)
    if not (path / "processor_config.json").is_file() and not (path / "preprocessor_config.json").is_file():
        return None
    processor = AutoProcessor.from_pretrained(path)
    return processor if hasattr(processor, "image_processor") else None


def folder_parameters(folder: str | Path) -> int:
    """The number of parameters in a model folder's safetensors files (their headers only); 0 (unknown) for a
    folder without any (weights in .bin files)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += math.prod(f.get_slice(name).get_shape())
    return total
