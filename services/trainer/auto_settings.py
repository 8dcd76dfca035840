"""The trainer's `auto` settings, resolved against the device and the model the trainer holds.

    policy.compile_layers   auto ─> on: the torch trainer on CUDA, no expert routing recorded, the model
                                        declares its decoder layer class, and a C compiler is on the PATH
                                        (Triton builds its kernel launchers with it at the first compile;
                                        the slim service images have none)
    policy.sequence_packing auto ─> on: the torch trainer on CUDA, nothing in the job forbids packed rows
                                        (launch_rules.packing_errors), and the model's packed rows run
                                        the varlen kernel in the compute dtype

Why these: on one GPU both were measured to pay (docs/trainer.md: the compiled GRPO step of the
Qwen2.5-0.5B shape 1.5x faster at a lower peak; packed rows through varlen flash attention faster
than padded ones, eager and compiled). On CPU the compile costs more than a short job saves, and
packed rows there take the masked SDPA fallback; a model without the varlen kernel would pack
through a dense mask, which was twice as slow as padding.

Guarantees: an explicit `true` or `false` is returned as set (the launch rules have already
refused a `true` the job cannot run); `auto` never turns on what an explicit `true` would have
been refused for. Pure: no side effects.
"""

from __future__ import annotations

import os
import shutil

import torch

from dockyard.config import MasterConfig, PolicyConfig
from dockyard.config.launch_rules import packing_errors


def compiles_layers(policy: PolicyConfig, device: str, layered: bool) -> bool:
    """Whether the torch trainer compiles its decoder layers; `layered`: the model declares their class."""
    if policy.compile_layers != "auto":
        return policy.compile_layers
    cuda = torch.device(device).type == "cuda"
    return cuda and layered and not policy.records_routing and c_compiler_available()


def c_compiler_available() -> bool:
    """Whether Triton finds a C compiler (it looks at $CC, then cc, gcc and clang on the PATH)."""
    return bool(os.environ.get("CC")) or any(shutil.which(name) for name in ("cc", "gcc", "clang"))


def packs_rows(config: MasterConfig, device: str, varlen: bool) -> bool:
    """Whether the trainer packs sequences into rows; `varlen`: the model's packed rows run the varlen kernel."""
    packing = config.policy.sequence_packing
    if packing != "auto":
        return packing
    return torch.device(device).type == "cuda" and varlen and not packing_errors(config)
