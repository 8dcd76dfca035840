"""The per-token objectives of the policy-gradient family: GRPO's clip, GSPO, CISPO and SAPO.

    log π_θ, log π_old, A (masked, [B, T]) ─> surrogate(policy_loss) ─> per-token loss L_t,
                                               the ratio it uses, clipped tokens, gate per token

Guarantees:
- Inputs arrive masked (0 at padding, `valid` False there); every output is finite at padding,
  so the caller's masked reduction sees no NaN.
- Gradient flows only through ``logprobs``: advantages, π_old and every weight a formula puts
  under a stop-gradient are constants.
- ``gate`` is, per token, the share of the unclipped policy gradient ρ·A·∇log π the objective
  keeps (detached): 1 on-policy, 0 for a token whose hard clip binds, ρ̂/ρ under CISPO,
  4σ(1 − σ) under SAPO. Formulas and defaults: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Surrogate:
    per_token: Tensor  # L_t, before importance weighting and reduction
    ratio: Tensor  # the ratio the objective uses: ρ_t, or the sequence ratio s_i broadcast to its tokens
    clipped: Tensor  # bool: the hard clip binds (the clipped branch strictly wins, or CISPO's weight was cut)
    dual_clipped: Tensor  # bool: the dual cap binds
    gate: Tensor  # detached share of the unclipped gradient kept


def surrogate(
    policy_loss: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    tau_pos: float,
    tau_neg: float,
) -> Surrogate:
    """Per-token loss of `policy_loss` on masked [B, T] inputs (`logprobs` carries the gradient)."""
    if policy_loss == "grpo":
        return _clip(torch.exp(logprobs - old_logprobs), advantages, valid, clip_low, clip_high, dual_clip_c)
    if policy_loss in ("gspo", "gspo-token"):
        # s_i = exp(mean over the sequence's valid tokens of log ρ_t): the length-normalised sequence ratio.
        count = valid.sum(-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
        sequence_log_ratio = (logprobs - old_logprobs).sum(-1, keepdim=True) / count
        if policy_loss == "gspo":
            ratio = torch.exp(sequence_log_ratio).expand_as(logprobs)
        else:  # s_i,t = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]: the value of s_i, the gradient of one token
            ratio = torch.exp(sequence_log_ratio).detach() * torch.exp(logprobs - logprobs.detach())
        ratio = torch.where(valid, ratio, torch.ones_like(ratio))
        return _clip(ratio, advantages, valid, clip_low, clip_high, dual_clip_c)
    if dual_clip_c is not None:
        raise ValueError(f"dual_clip_c applies to the clipped objectives, not to policy_loss={policy_loss!r}")
    ratio = torch.exp(logprobs - old_logprobs)
    none = torch.zeros_like(valid)
    if policy_loss == "cispo":
        # L_t = −sg[clip(ρ_t, 1 − ε_low, 1 + ε_high)] · A_t · log π_θ(y_t): every token keeps a gradient.
        weight = ratio.detach().clamp(1 - clip_low, 1 + clip_high)
        cut = valid & (weight != ratio.detach())
        return Surrogate(-weight * advantages * logprobs, ratio, cut, none, (weight / ratio.detach()).detach())
    if policy_loss == "sapo":
        # L_t = −(4/τ) σ(τ(ρ_t − 1)) A_t, τ = τ_pos where A_t > 0 else τ_neg: a soft gate, no hard clip.
        tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
        sigma = torch.sigmoid(tau * (ratio - 1))
        gate = (4 * sigma * (1 - sigma)).detach()
        return Surrogate(-(4 / tau) * sigma * advantages, ratio, none, none, gate)
    raise ValueError(f"unknown policy_loss {policy_loss!r}")


def _clip(
    ratio: Tensor, advantages: Tensor, valid: Tensor, clip_low: float, clip_high: float, dual_clip_c: float | None
) -> Surrogate:
    """max(−A ρ, −A clip(ρ, 1 − ε_low, 1 + ε_high)), then the dual cap −c A where A < 0."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        dual_active = torch.zeros_like(valid)
    else:
        cap = -dual_clip_c * advantages
        dual_active = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
    gate = (~(clip_active | dual_active)).to(ratio.dtype)
    return Surrogate(per_token, ratio, clip_active, dual_active, gate)
