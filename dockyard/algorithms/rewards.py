"""Reward shaping applied where a reward is computed, before any group statistic.

    raw verdict reward [B] ─> apply_integrity ─> + invalid_action_penalty ─> + overlong_penalty
                           ─> scale_rewards (optional) ─> compute_advantages

Guarantees:
- Every function is pure and elementwise over [B]: no batch statistic, so a sample's shaped
  reward does not depend on the other samples it was collected with.
- Inputs are never modified in place; outputs keep the float dtype of ``rewards``
  (overlong_penalty, which has no reward input, returns float32 or the lengths' float dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong penalty, a value in [−penalty, 0] to add to the reward.

    0 while length <= max − buffer; −penalty·(length − (max − buffer))/buffer inside the buffer;
    −penalty beyond max. With buffer_length 0 it is a step: 0 up to max, −penalty beyond.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    if not 0 <= buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must lie in [0, max_response_length], got {buffer_length}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty}")
    lengths = response_lengths.to(torch.promote_types(response_lengths.dtype, torch.float32))
    if buffer_length == 0:
        return -penalty * (lengths > max_response_length).to(lengths.dtype)
    start = max_response_length - buffer_length
    return -penalty * ((lengths - start) / buffer_length).clamp(0.0, 1.0)


def apply_integrity(rewards: Tensor, touched_protected: Tensor) -> Tensor:
    """Zero the reward of every sample whose patch touched a held-out (protected) test file.

    Apply it to the verdict reward, before penalties are added: penalties then still push a
    cheating sample below 0 instead of being erased by the zeroing.
    """
    if touched_protected.shape != rewards.shape:
        raise ValueError(
            f"touched_protected shape {tuple(touched_protected.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    return torch.where(touched_protected.to(torch.bool), torch.zeros_like(rewards), rewards)


def invalid_action_penalty(rewards: Tensor, is_invalid: Tensor, penalty: float) -> Tensor:
    """Subtract ``penalty`` from the reward of every sample whose action could not be used.

    "Invalid" means the model's output could not be turned into an action: a malformed or
    empty patch, a program that does not parse, a missing answer block. It is a property of
    the sample, unlike an infrastructure failure, which is masked out of the statistics instead.
    """
    if is_invalid.shape != rewards.shape:
        raise ValueError(f"is_invalid shape {tuple(is_invalid.shape)} != rewards shape {tuple(rewards.shape)}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty}")
    return torch.where(is_invalid.to(torch.bool), rewards - penalty, rewards)


def scale_rewards(
    rewards: Tensor,
    source_min: float,
    source_max: float,
    target_min: float,
    target_max: float,
) -> Tensor:
    """Clamp to [source_min, source_max], then map that range linearly onto [target_min, target_max].

    Same convention as NeMo-RL's ``grpo.reward_scaling``: out-of-range rewards saturate at
    the target bounds instead of extrapolating.
    """
    if not source_max > source_min:
        raise ValueError(f"source_max ({source_max}) must exceed source_min ({source_min})")
    clamped = rewards.clamp(source_min, source_max)
    return target_min + (clamped - source_min) * ((target_max - target_min) / (source_max - source_min))
