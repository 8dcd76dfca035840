"""GRPO math as a pure torch library: advantages, losses, reward shaping, launch rules.

    rewards ─> rewards.* (shaping) ─> dynamic_sampling.dynamic_sampling_mask ─> advantages.compute_advantages
            ─> loss.clipped_pg_loss (with loss.kl_estimate) ─> scalar loss + metrics

Guarantees: every name below is public API with a stable signature; nothing here holds state,
touches a device other than its inputs', or does I/O. Formulas and defaults: docs/algorithms.md.
"""

from dockyard.algorithms.advantages import SCALES, compute_advantages, opd_advantages
from dockyard.algorithms.dynamic_sampling import dynamic_sampling_mask
from dockyard.algorithms.launch_rules import launch_errors
from dockyard.algorithms.loss import IS_CORRECTIONS, KL_TYPES, REDUCTIONS, clipped_pg_loss, kl_estimate
from dockyard.algorithms.rewards import apply_integrity, invalid_action_penalty, overlong_penalty, scale_rewards

__all__ = [
    "IS_CORRECTIONS",
    "KL_TYPES",
    "REDUCTIONS",
    "SCALES",
    "apply_integrity",
    "clipped_pg_loss",
    "compute_advantages",
    "dynamic_sampling_mask",
    "invalid_action_penalty",
    "kl_estimate",
    "launch_errors",
    "opd_advantages",
    "overlong_penalty",
    "scale_rewards",
]
