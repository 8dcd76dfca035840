"""GRPO math as a pure torch library: advantages, losses, reward shaping.

    rewards ─> rewards.* (shaping) ─> dynamic_sampling.dynamic_sampling_mask
            ─> advantages.compute_advantages | rloo_advantages | reinforce_pp_advantages
            ─> loss.clipped_pg_loss (surrogates.surrogate: GRPO, GSPO, CISPO, SAPO; loss.kl_estimate)
            ─> scalar loss + metrics

Guarantees: every name below is public API with a stable signature; nothing here holds state,
touches a device other than its inputs', or does I/O. Formulas and defaults: docs/algorithms.md.
Names load on first use (PEP 562). The names the config chooses among (SCALES, IS_CORRECTIONS,
KL_TYPES, REDUCTIONS, POLICY_LOSSES, ADV_ESTIMATORS) live in dockyard.config.choices, and the
launch rules that check a config against this math in dockyard.config.launch_rules: the config
layer validates without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "SCALES": "dockyard.config.choices",
    "IS_CORRECTIONS": "dockyard.config.choices",
    "KL_TYPES": "dockyard.config.choices",
    "REDUCTIONS": "dockyard.config.choices",
    "POLICY_LOSSES": "dockyard.config.choices",
    "ADV_ESTIMATORS": "dockyard.config.choices",
    "compute_advantages": "advantages",
    "rloo_advantages": "advantages",
    "reinforce_pp_advantages": "advantages",
    "surrogate": "surrogates",
    "opd_advantages": "advantages",
    "dynamic_sampling_mask": "dynamic_sampling",
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
    home = _HOMES[name]
    return getattr(importlib.import_module(home if "." in home else f"{__name__}.{home}"), name)
