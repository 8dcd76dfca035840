"""Regional compilation: each decoder layer of a policy runs through torch.compile.

    model ─its `_no_split_modules` (the decoder layer class, as FSDP shards it)─> each such layer
        ─nn.Module.compile(dynamic=True)─> one graph for every layer (they share code), any micro-batch shape

Why per layer and not the whole model: the layers are identical, so one compilation serves all of
them (seconds, not minutes), the chunked LM-head loss and the forward hooks stay eager, and
parameter names, state dicts, FSDP2 sharding and checkpoints are those of the eager model
(`Module.compile` compiles in place; no `_orig_mod` prefix).

What it buys: inductor fuses each layer's elementwise chains (norms, rotary, the gated MLP, residual
adds) and its min-cut partitioner recomputes cheap intermediates in backward instead of keeping
them, so a step takes less time and less activation memory than eager at the same micro-batches.

Guarantees: numerics equal the eager layers' to the rounding of fused kernels (a test compares a
training step); a model without a declared layer class is refused with its name, not silently left
eager.
"""

from __future__ import annotations

import torch

from dockyard.config import ConfigError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model`: the modules of its declared layer class (empty: none declared)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in blocks]


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of `model` in place; returns how many were compiled."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"policy.compile_layers: {type(model).__name__} declares no decoder layer class (_no_split_modules); "
            "set policy.compile_layers=false"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
