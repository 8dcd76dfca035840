"""GRPO math as a pure torch library: advantages, losses, reward shaping, launch rules.

    rewards ─> rewards.* (shaping) ─> dynamic_sampling.dynamic_sampling_mask ─> advantages.compute_advantages
            ─> loss.clipped_pg_loss (with loss.kl_estimate) ─> scalar loss + metrics

Guarantees: every name below is public API with a stable signature; nothing here holds state,
touches a device other than its inputs', or does I/O. Formulas and defaults: docs/algorithms.md.
Names load on first use (PEP 562), so the config layer's `launch_rules` and `choices` never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "SCALES": "choices",
    "IS_CORRECTIONS": "choices",
    "KL_TYPES": "choices",
    "REDUCTIONS": "choices",
    "compute_advantages": "advantages",
    "opd_advantages": "advantages",
    "dynamic_sampling_mask": "dynamic_sampling",
    "launch_errors": "launch_rules",
    "clipped_pg_loss": "loss",
    "kl_estimate": "loss",
    "apply_integrity": "rewards",
    "invalid_action_penalty": "rewards",
    "overlong_penalty": "rewards",
    "scale_rewards": "rewards",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
