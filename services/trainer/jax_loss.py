"""The policy-gradient loss in JAX: dockyard.algorithms.loss and .surrogates, term for term, differentiable.

    logprobs [B, T] (grad), old, generation, reference [B, T], advantages [B, T], mask [B, T]
        ─> per-token objective of loss_fn.name (GRPO's clip and dual clip, GSPO, CISPO, SAPO) ─> × IS weight
        ─> token, sequence or constant reduction ─> + β · reduced KL estimate ─> loss, statistics (0-d arrays)

Guarantees: the same formulas, clamps, masks and reductions as the torch
`clipped_pg_loss` and `kl_estimate` (a test compares them option by option to
float32 rounding); the arguments are validated there (`LossConfig` and the
torch function's checks hold for both backends), so this function takes the
job's `LossConfig` as it was accepted. Masked tokens contribute nothing, also
when they hold inf/NaN; advantages and IS weights are constants (gradient only
through `logprobs`); the KL term is never importance-weighted. Traceable under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dockyard.config import LossConfig
from dockyard.config.choices import POLICY_LOSS_OF


def kl_estimate(logprobs, reference_logprobs, kl_type: str = "k3", input_clamp=20.0, output_clamp=10.0):
    """Per-token estimate of KL(π ‖ π_ref): k1, k2 or k3 of log r = ref − logprobs, clamped as in torch."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        log_ratio = jnp.clip(log_ratio, -input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = jnp.square(log_ratio) / 2
    else:
        kl = jnp.expm1(log_ratio) - log_ratio
    return kl if output_clamp is None else jnp.clip(kl, -output_clamp, output_clamp)


def clipped_pg_loss(logprobs, old, advantages, mask, generation, reference, cfg: LossConfig):
    """(loss, {statistic: 0-d array}) of one micro-batch; `reference` None when there is no KL term."""
    valid = mask.astype(bool)
    validf = valid.astype(jnp.float32)

    def masked(x):
        return jnp.where(valid, x.astype(jnp.float32), 0.0)

    def reduce(x):
        x = masked(x)
        if cfg.reduction == "token":
            return x.sum() / jnp.maximum(validf.sum(), 1.0)
        per_sequence = validf.sum(-1)
        if cfg.reduction == "constant":
            return x.sum() / (jnp.maximum((per_sequence > 0).sum(), 1.0) * cfg.length_normaliser)
        means = x.sum(-1) / jnp.maximum(per_sequence, 1.0)
        has_tokens = (per_sequence > 0).astype(jnp.float32)
        return (means * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)

    def token_mean(x):
        return masked(x).sum() / jnp.maximum(validf.sum(), 1.0)

    lp = logprobs.astype(jnp.float32)
    old = jax.lax.stop_gradient(old)
    adv = masked(jax.lax.stop_gradient(advantages))
    per_token, ratio, clipped, dual_clipped, gate = _surrogate(cfg, masked(lp), masked(old), adv, valid)
    weights, out_of_bounds = _is_weights(cfg, masked(old), generation, valid)
    pg_loss = reduce(weights * per_token)
    ratio = jax.lax.stop_gradient(ratio)
    kl = jnp.zeros((), jnp.float32)
    if reference is not None:
        kl = reduce(kl_estimate(masked(lp), masked(reference), cfg.kl_type))
    loss = pg_loss + cfg.kl_penalty * kl if cfg.kl_penalty != 0 else pg_loss
    stats = {
        "pg_loss": pg_loss,
        "kl": kl,
        "clip_fraction": token_mean(clipped),
        "dual_clip_fraction": token_mean(dual_clipped),
        "gate_mean": token_mean(gate),
        "is_weight_mean": token_mean(weights),
        "is_oob_fraction": token_mean(out_of_bounds),
        "ratio_mean": token_mean(ratio),
        # Over valid tokens; 0 when there is none, as in torch.
        "ratio_min": jnp.where(valid.any(), jnp.where(valid, ratio, jnp.inf).min(), 0.0),
        "ratio_max": jnp.where(valid.any(), jnp.where(valid, ratio, -jnp.inf).max(), 0.0),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)


def _surrogate(cfg: LossConfig, lp, old, adv, valid):
    """(per-token loss, ratio, clipped, dual-clipped, gate) of the objective, as surrogates.surrogate."""
    policy_loss = POLICY_LOSS_OF[cfg.name]
    if policy_loss == "grpo":
        return _clip(cfg, jnp.exp(lp - old), adv, valid)
    if policy_loss in ("gspo", "gspo-token"):
        count = jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(jnp.float32)
        sequence_log_ratio = (lp - old).sum(-1, keepdims=True) / count
        if policy_loss == "gspo":
            ratio = jnp.broadcast_to(jnp.exp(sequence_log_ratio), lp.shape)
        else:
            ratio = jax.lax.stop_gradient(jnp.exp(sequence_log_ratio)) * jnp.exp(lp - jax.lax.stop_gradient(lp))
        return _clip(cfg, jnp.where(valid, ratio, 1.0), adv, valid)
    ratio = jnp.exp(lp - old)
    none = jnp.zeros_like(valid)
    if policy_loss == "cispo":
        fixed = jax.lax.stop_gradient(ratio)
        weight = jnp.clip(fixed, 1 - cfg.clip_low, 1 + cfg.clip_high)
        return -weight * adv * lp, ratio, valid & (weight != fixed), none, weight / fixed
    # sapo
    tau = jnp.where(adv > 0, cfg.tau_pos, cfg.tau_neg)
    sigma = jax.nn.sigmoid(tau * (ratio - 1))
    gate = jax.lax.stop_gradient(4 * sigma * (1 - sigma))
    return -(4 / tau) * sigma * adv, ratio, none, none, gate


def _clip(cfg: LossConfig, ratio, adv, valid):
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = jnp.zeros_like(valid)
    if cfg.dual_clip_c is not None:
        cap = -cfg.dual_clip_c * adv
        dual_active = (adv < 0) & (per_token > cap)
        per_token = jnp.where(dual_active, cap, per_token)
    gate = (~(clip_active | dual_active)).astype(jnp.float32)
    return per_token, ratio, clip_active, dual_active, gate


def _is_weights(cfg: LossConfig, old, generation, valid):
    """Constant per-token IS weights and the tokens whose weight was clamped or zeroed."""
    none = jnp.zeros_like(valid)
    if cfg.is_correction is None:
        return jnp.ones(valid.shape, jnp.float32), none
    log_w = jnp.where(valid, old - generation.astype(jnp.float32), 0.0)
    raw = jax.lax.stop_gradient(jnp.exp(log_w))
    if cfg.is_correction == "plain":
        return raw, none
    if cfg.is_correction == "tis":
        low = 0.0 if cfg.is_min is None else cfg.is_min
        return jnp.clip(raw, low, cfg.is_max), valid & ((raw < low) | (raw > cfg.is_max))
    if cfg.is_correction == "icepop":
        outside = valid & ((raw < cfg.is_min) | (raw > cfg.is_max))
        return jnp.where(outside, 0.0, raw), outside
    # seq-mask-tis: the geometric mean of a sequence's token weights decides for the whole sequence.
    sequence_w = jnp.exp(log_w.sum(-1) / jnp.maximum(valid.sum(-1), 1))
    dropped = ((sequence_w < cfg.is_min) | (sequence_w > cfg.is_max))[:, None] & valid
    return jnp.where(dropped, 0.0, raw), dropped
