"""Dynamic sampling (DAPO): which samples to keep because their group carries a learning signal.

    rewards [B], group_ids [B], valid [B] ─> dynamic_sampling_mask ─> keep [B] (bool)

Guarantees:
- Groups are kept or dropped whole (the buffer is group-atomic): ``keep`` is constant over the
  samples of a group, invalid ones included.
- A group is kept iff it has two valid samples with different rewards. The test is exact
  equality, the same one compute_advantages uses, so a kept group always has a non-zero
  advantage under every estimator and a dropped group has only zero advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_mask(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """True for every sample of a group whose valid rewards are not all equal.

    The collector drops the False groups and draws more prompts until the step is full.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(f"valid shape {tuple(valid.shape)} != rewards shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        return torch.zeros_like(rewards, dtype=torch.bool)
    valid = valid.to(torch.bool)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    # ±inf fillers leave invalid samples out of the extremes, NaN rewards included.
    highest = torch.full((num_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    lowest = torch.full((num_groups,), float("inf"), dtype=values.dtype, device=values.device)
    highest = highest.scatter_reduce(0, inverse, values.masked_fill(~valid, float("-inf")), "amax")
    lowest = lowest.scatter_reduce(0, inverse, values.masked_fill(~valid, float("inf")), "amin")
    return (highest > lowest)[inverse]
