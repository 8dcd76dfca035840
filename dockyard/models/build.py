"""Randomly initialised causal language models built from a config dict.

``build_random_model`` creates a Hugging Face causal LM of any registered
``model_type`` (default ``llama``) with the given vocabulary size and special
token ids, in float32, with weights drawn from a generator seeded by
``seed``: the same arguments give bit-identical weights. The config dict
uses Hugging Face field names (``hidden_size``, ``num_hidden_layers``, ...)
and overrides the defaults in ``DEFAULT_MODEL``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

# Small enough to train on two CPU cores in about a minute. Not ``qwen2``:
# AutoTokenizer forces Qwen2Tokenizer (byte-level, whitespace-merging) onto
# any folder whose config says qwen2, which breaks a character tokenizer.
DEFAULT_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def build_random_model(
    model_config: dict[str, Any],
    vocab_size: int,
    seed: int,
    *,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> PreTrainedModel:
    """A freshly initialised causal LM described by ``model_config``."""
    fields = {**DEFAULT_MODEL, **model_config}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        **fields,
    )
    # Seed the global generator only for the duration of initialisation so
    # callers' random streams are left as they were.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model
