"""Advantages: group-relative (GRPO, RLOO), batch-normalised (REINFORCE++) and on-policy distillation.

    rewards [B] ─┐
    group_ids [B]├─> compute_advantages | rloo_advantages ─> advantages [B]   (one scalar per sample)
    valid [B] ───┘

    rewards [B], mask [B, T], valid [B], kl [B, T] (optional)
        ─> reinforce_pp_advantages ─> advantages [B, T]   (return to go, normalised over the batch's tokens)

    teacher_logprobs [B, T] ─┐
    student_logprobs [B, T] ─┼─> opd_advantages ─> advantages [B, T]   (detached)
    mask [B, T] ─────────────┘

Guarantees:
- Invalid samples (infrastructure failures) never enter any statistic, even when their reward is
  NaN, and get advantage exactly 0.
- A group whose baseline rewards are all equal gets exactly the unscaled difference from that
  baseline; a group whose valid rewards are all equal gets exactly 0, whatever the dtype.
- A group with at most one valid sample gets advantage 0.
- reinforce_pp_advantages: valid tokens of valid samples have mean 0 and (population) std 1
  over the batch unless they are all equal, when they are exactly 0; everything else is 0.
- Inputs of any float dtype are accepted; statistics are computed in at least float32 and the
  result has dtype ``promote_types(rewards.dtype, float32)``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from dockyard.config.choices import SCALES

Scale = Literal["group", "batch", "none"]


def compute_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    leave_one_out: bool = True,
    scale: Scale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample advantage A_i = (r_i - b_i) / (s_i + eps), see docs/algorithms.md.

    Args:
        rewards: float [B].
        group_ids: int [B]; samples with equal id form a group (ids need not be contiguous).
        valid: bool [B]; False marks an infrastructure failure. None means all valid.
        leave_one_out: baseline b_i is the mean of the *other* valid rewards of the group;
            otherwise the mean of all valid rewards of the group.
        scale: "group" divides by the Bessel-corrected std of the rewards the baseline used,
            "batch" by the Bessel-corrected std of every valid reward in the batch, "none"
            does not divide (Dr.GRPO). A std is only divided by where it is > 0.
        eps: added to the std before dividing.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(f"valid shape {tuple(valid.shape)} != rewards shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")

    dtype = torch.promote_types(rewards.dtype, torch.float32)
    valid = valid.to(torch.bool)
    # torch.where, not multiplication: an invalid sample's reward may be NaN.
    r = torch.where(valid, rewards.to(dtype), torch.zeros((), dtype=dtype, device=rewards.device))
    if r.numel() == 0:
        return r

    # Lay groups out as rows of a padded [G, N] matrix so every statistic is a masked reduction.
    _, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse)
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(r.numel(), device=r.device) - starts[inverse[order]]
    num_groups, width = counts.numel(), int(counts.max())
    values = r.new_zeros(num_groups, width)
    values[inverse, slot] = r
    present = torch.zeros(num_groups, width, dtype=torch.bool, device=r.device)
    present[inverse, slot] = valid

    # used[g, i, j]: reward j enters sample i's baseline.
    used = present.unsqueeze(1).expand(num_groups, width, width)
    if leave_one_out:
        used = used & ~torch.eye(width, dtype=torch.bool, device=r.device)
    baseline, spread, std = _masked_stats(values.unsqueeze(1).expand_as(used), used)
    advantage = values - baseline

    if scale == "group":
        advantage = torch.where(spread, advantage / (std + eps), advantage)
    elif scale == "batch":
        _, batch_spread, batch_std = _masked_stats(r, valid)
        advantage = torch.where(batch_spread, advantage / (batch_std + eps), advantage)

    keep = present & (present.sum(-1, keepdim=True) > 1)
    advantage = torch.where(keep, advantage, torch.zeros((), dtype=dtype, device=r.device))
    return advantage[inverse, slot]


def rloo_advantages(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """RLOO: A_i = r_i − the mean of the other valid rewards of i's group, unscaled.

    The leave-one-out baseline without std scaling: ``compute_advantages(leave_one_out=True,
    scale="none")``, with the same guarantees for invalid samples and groups of one.
    """
    return compute_advantages(rewards, group_ids, valid, leave_one_out=True, scale="none")


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    valid: Tensor | None = None,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++: the return to go of each token, normalised over every valid token of the batch.

    The reward r_i comes at the sequence's last token and each token t pays −β·kl_t, so (γ = 1)
    G_t = r_i − β Σ_{s ≥ t} kl_s over the valid tokens s of the row; then A_t = (G_t − μ) / (σ + eps)
    with μ and σ (population std) over the valid tokens of valid rows, divided only where σ > 0.

    Args:
        rewards: [B], one per row (for REINFORCE++-baseline, pass r − the group mean:
            ``compute_advantages(..., leave_one_out=False, scale="none")``).
        mask: [B, T], 1 on the tokens the policy sampled.
        valid: [B]; False rows (infrastructure failures) get 0 and enter no statistic.
        kl: [B, T] per-token KL estimate (log π_old − log π_ref, k1), or None for none.
        kl_coef: β.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T], got {tuple(rewards.shape)}, {tuple(mask.shape)}")
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"kl shape {tuple(kl.shape)} != mask shape {tuple(mask.shape)}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    rows = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    tokens = mask.to(torch.bool) & rows.unsqueeze(-1)
    r = torch.where(rows, rewards.to(dtype), zero)
    returns = r.unsqueeze(-1).expand(mask.shape)
    if kl is not None and kl_coef != 0:
        paid = torch.where(tokens, kl.to(dtype), zero)
        to_go = paid.flip(-1).cumsum(-1).flip(-1)  # Σ_{s ≥ t} kl_s
        returns = returns - kl_coef * to_go
    returns = torch.where(tokens, returns, zero)
    if not tokens.any():
        return returns
    _, spread, _ = _masked_stats(returns.flatten(), tokens.flatten())
    if not spread:
        return torch.zeros_like(returns)
    n = tokens.sum()
    mean = returns.sum() / n
    std = (torch.where(tokens, returns - mean, zero).square().sum() / n).sqrt()
    return torch.where(tokens, (returns - mean) / (std + eps), zero)


def _masked_stats(values: Tensor, used: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, "not all equal" flag and Bessel-corrected std of ``values`` where ``used``, on the last dim.

    When the used values are all equal the mean is one of them, bit for bit, and the std is 0:
    an all-equal group then yields exactly zero advantage instead of rounding noise, and a
    rounding-sized std can never be divided by.
    """
    count = used.sum(-1)
    highest = values.masked_fill(~used, float("-inf")).amax(-1)
    lowest = values.masked_fill(~used, float("inf")).amin(-1)
    spread = highest > lowest
    mean = torch.where(used, values, 0).sum(-1) / count.clamp(min=1)
    deviation = torch.where(used, values - mean.unsqueeze(-1), 0)
    variance = deviation.square().sum(-1) / (count - 1).clamp(min=1)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    mean = torch.where(spread, mean, torch.where(count > 0, highest, zero))
    std = torch.where(spread, variance.sqrt(), zero)
    return mean, spread, std


def opd_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation advantage per token: sg[teacher - student], 0 where ``mask`` is 0.

    All of teacher_logprobs, student_logprobs and mask are [B, T]. Masked positions may hold
    anything (padding logprobs of -inf included); they come out as exactly 0.
    """
    if teacher_logprobs.shape != student_logprobs.shape or mask.shape != teacher_logprobs.shape:
        raise ValueError(
            "teacher_logprobs, student_logprobs and mask must share one [B, T] shape, got "
            f"{tuple(teacher_logprobs.shape)}, {tuple(student_logprobs.shape)}, {tuple(mask.shape)}"
        )
    difference = (teacher_logprobs - student_logprobs).detach()
    zero = torch.zeros((), dtype=difference.dtype, device=difference.device)
    return torch.where(mask.to(torch.bool), difference, zero)
