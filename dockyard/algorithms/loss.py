"""The policy-gradient loss of the GRPO family, with reference KL and importance-sampling correction.

    logprobs [B, T] (grad) ──┐
    old_logprobs [B, T] ─────┤   surrogates.surrogate(policy_loss): GRPO's clip, GSPO, CISPO or SAPO
    advantages [B] | [B, T] ─┼─> per-token L_t ─> × IS weight w ─> reduce ─┐
    generation_logprobs ─────┤   w from exp(old − generation)             ├─> loss, metrics
    reference_logprobs ──────┴─> kl_estimate ────────────────────> reduce ─┘ × kl_penalty

Guarantees:
- Tokens where ``mask`` is 0 contribute nothing to the loss, its gradient or any metric, even when
  they hold ±inf or NaN logprobs (padding); rows with no valid token are ignored.
- Advantages and importance weights are constants: gradient flows only through ``logprobs``.
- The KL term is never importance-weighted.
- ``policy_loss="grpo"`` (the default) is the clipped surrogate as it always was, bit for bit.
- A sequence is a row: GSPO's sequence ratio is taken over a row's valid tokens.
- Arithmetic runs in at least float32 (bfloat16 inputs are upcast; their gradient comes back in
  bfloat16); the loss is a 0-d tensor and every metric a Python float.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from dockyard.algorithms.surrogates import surrogate
from dockyard.config.choices import CLIPPED_LOSSES, IS_CORRECTIONS, KL_TYPES, POLICY_LOSSES, REDUCTIONS

KlType = Literal["k1", "k2", "k3"]
IsCorrection = Literal["plain", "tis", "icepop", "seq-mask-tis"]
Reduction = Literal["token", "sequence", "constant"]
PolicyLoss = Literal["grpo", "gspo", "gspo-token", "cispo", "sapo"]


def kl_estimate(
    logprobs: Tensor,
    reference_logprobs: Tensor,
    kl_type: KlType = "k3",
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled-token logprobs, same shape as the inputs.

    log r = reference − logprobs, clamped to ±input_clamp; k1 = −log r, k2 = (log r)²/2,
    k3 = exp(log r) − 1 − log r; the result is clamped to ±output_clamp. None disables a clamp.
    Clamping also stops the gradient of a clamped token, which is the point: one token whose
    reference probability collapsed must not dominate the step.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = torch.expm1(log_ratio) - log_ratio
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def clipped_pg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    generation_logprobs: Tensor | None = None,
    reference_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    kl_penalty: float = 0.0,
    kl_type: KlType = "k3",
    is_correction: IsCorrection | None = None,
    is_min: float | None = None,
    is_max: float | None = None,
    reduction: Reduction = "token",
    policy_loss: PolicyLoss = "grpo",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    length_normaliser: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss of `policy_loss`; formulas and defaults in docs/algorithms.md.

    Args:
        logprobs: [B, T] log π_θ of the sampled tokens, with grad.
        old_logprobs: [B, T] log π_old (the policy the ratio is taken against).
        advantages: [B] (one per sequence) or [B, T].
        mask: [B, T], 1 for tokens that count (bool, int or float 0/1).
        generation_logprobs: [B, T] log π_gen reported by the inference engine; required when
            ``is_correction`` is set.
        reference_logprobs: [B, T] log π_ref; required when ``kl_penalty`` != 0, and used for
            the ``kl`` metric whenever given.
        clip_low, clip_high: ρ is clipped to [1 − clip_low, 1 + clip_high] (clip_low = 1: no lower bound).
        dual_clip_c: where A < 0, L = min(L, −c·A); must be > 1. None disables.
        kl_penalty: β, the weight of the reduced KL estimate added to the loss.
        kl_type: estimator passed to :func:`kl_estimate`.
        is_correction: None, "plain", "tis", "icepop" or "seq-mask-tis".
        is_min, is_max: bounds of the importance weight used by the truncating corrections.
        reduction: "token" (mean over every valid token of the batch), "sequence" (mean over
            sequences with a valid token of each sequence's token mean) or "constant" (Dr.GRPO:
            the token sum over sequences with a valid token × ``length_normaliser``).
        policy_loss: the per-token objective: "grpo" (clipped ρ), "gspo" or "gspo-token" (clipped
            length-normalised sequence ratio), "cispo" (clipped, detached ρ times log π) or
            "sapo" (soft gate); see dockyard.algorithms.surrogates.
        tau_pos, tau_neg: SAPO's gate temperatures where A > 0 and where A ≤ 0.
        length_normaliser: the constant length of the "constant" reduction (required by it).

    Returns:
        The loss and a dict with pg_loss, kl, clip_fraction, dual_clip_fraction, gate_mean,
        is_weight_mean, is_oob_fraction, ratio_mean, ratio_min, ratio_max, num_tokens and
        num_sequences. Fractions and means are over valid tokens (ratio_min and ratio_max over
        them too, 0 when there is none); pg_loss and kl are reduced like the loss.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("generation_logprobs", generation_logprobs),
        ("reference_logprobs", reference_logprobs),
    ):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [B] or [B, T] for logprobs {tuple(shape)}, got {tuple(advantages.shape)}")
    if not 0 <= clip_low <= 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
    if kl_penalty != 0 and reference_logprobs is None:
        raise ValueError("kl_penalty != 0 needs reference_logprobs")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "constant" and (length_normaliser is None or length_normaliser <= 0):
        raise ValueError(f"reduction='constant' needs a length_normaliser > 0, got {length_normaliser}")
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    if dual_clip_c is not None and policy_loss not in CLIPPED_LOSSES:
        raise ValueError(f"dual_clip_c applies to {', '.join(CLIPPED_LOSSES)}, not to policy_loss={policy_loss!r}")
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    _check_is_correction(is_correction, is_min, is_max)
    if is_correction is not None and generation_logprobs is None:
        raise ValueError(f"is_correction={is_correction!r} needs generation_logprobs")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    valid = mask.to(torch.bool)
    validf = valid.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def masked(x: Tensor) -> Tensor:
        # torch.where, not multiplication: padding may hold inf/NaN, and NaN * 0 is NaN.
        return torch.where(valid, x.to(dtype), zero)

    def reduce(x: Tensor) -> Tensor:
        x = masked(x)
        if reduction == "token":
            return x.sum() / validf.sum().clamp(min=1)
        per_sequence = validf.sum(-1)
        if reduction == "constant":
            return x.sum() / ((per_sequence > 0).to(dtype).sum().clamp(min=1) * length_normaliser)
        means = x.sum(-1) / per_sequence.clamp(min=1)
        has_tokens = (per_sequence > 0).to(dtype)
        return (means * has_tokens).sum() / has_tokens.sum().clamp(min=1)

    def token_mean(x: Tensor) -> float:
        return float(masked(x).sum() / validf.sum().clamp(min=1))

    lp = logprobs.to(dtype)
    adv = advantages.detach().to(dtype)
    adv = masked(adv.unsqueeze(-1).expand(shape) if adv.dim() == 1 else adv)
    terms = surrogate(
        policy_loss,
        masked(lp),
        masked(old_logprobs),
        adv,
        valid,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
    )
    ratio = terms.ratio.detach()

    weights, out_of_bounds = _is_weights(
        is_correction, masked(old_logprobs), generation_logprobs, valid, is_min, is_max, dtype
    )
    pg_loss = reduce(weights * terms.per_token)

    if reference_logprobs is not None:
        kl = reduce(kl_estimate(masked(lp), masked(reference_logprobs), kl_type))
    else:
        kl = zero
    loss = pg_loss + kl_penalty * kl if kl_penalty != 0 else pg_loss

    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "pg_loss": float(pg_loss),
            "kl": float(kl),
            "clip_fraction": token_mean(terms.clipped),
            "dual_clip_fraction": token_mean(terms.dual_clipped),
            "gate_mean": token_mean(terms.gate),
            "is_weight_mean": token_mean(weights),
            "is_oob_fraction": token_mean(out_of_bounds),
            "ratio_mean": token_mean(ratio),
            "ratio_min": float(torch.where(valid, ratio, torch.inf).amin()) if valid.any() else 0.0,
            "ratio_max": float(torch.where(valid, ratio, -torch.inf).amax()) if valid.any() else 0.0,
            "num_tokens": float(validf.sum()),
            "num_sequences": float(valid.any(-1).sum()),
        }
    return loss, metrics


def _check_is_correction(is_correction: str | None, is_min: float | None, is_max: float | None) -> None:
    if is_correction is not None and is_correction not in IS_CORRECTIONS:
        raise ValueError(f"is_correction must be None or one of {IS_CORRECTIONS}, got {is_correction!r}")
    if is_correction == "tis" and is_max is None:
        raise ValueError("is_correction='tis' needs is_max")
    if is_correction in ("icepop", "seq-mask-tis") and (is_min is None or is_max is None):
        raise ValueError(f"is_correction={is_correction!r} needs both is_min and is_max")
    if is_min is not None and is_max is not None and is_min > is_max:
        raise ValueError(f"is_min ({is_min}) must not exceed is_max ({is_max})")


def _is_weights(
    is_correction: str | None,
    old_logprobs: Tensor,
    generation_logprobs: Tensor | None,
    valid: Tensor,
    is_min: float | None,
    is_max: float | None,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Detached per-token weights and the tokens whose weight was clamped or zeroed."""
    if is_correction is None or generation_logprobs is None:
        return torch.ones(valid.shape, dtype=dtype, device=valid.device), torch.zeros_like(valid)
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    log_w = torch.where(valid, old_logprobs.detach().to(dtype) - generation_logprobs.detach().to(dtype), zero)
    raw = torch.exp(log_w)
    if is_correction == "plain":
        return raw, torch.zeros_like(valid)
    assert is_max is not None
    if is_correction == "tis":
        low = 0.0 if is_min is None else is_min
        return raw.clamp(low, is_max), valid & ((raw < low) | (raw > is_max))
    assert is_min is not None
    if is_correction == "icepop":
        outside = valid & ((raw < is_min) | (raw > is_max))
        return torch.where(outside, zero, raw), outside
    # seq-mask-tis: geometric mean of a sequence's token weights decides for the whole sequence.
    sequence_w = torch.exp(log_w.sum(-1) / valid.sum(-1).clamp(min=1))
    dropped = ((sequence_w < is_min) | (sequence_w > is_max)).unsqueeze(-1) & valid
    return torch.where(dropped, zero, raw), dropped
