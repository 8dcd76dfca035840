"""The `loss_fn` section: clipping, KL, importance-sampling correction and reduction of the policy loss.

Guarantees: each choice is one of the names the loss functions accept (choices.py); the
combinations that need each other are checked by launch_rules.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import Section


class LossConfig(Section):
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ρ is clipped below at 1 − clip_low; in [0, 1).")
    clip_high: float = Field(0.2, ge=0.0, description="ρ is clipped above at 1 + clip_high.")
    dual_clip_c: float | None = Field(None, description="Dual-clip bound for A < 0; null = off; must exceed 1.")
    kl_penalty: float = Field(
        0.0,
        ge=0.0,
        description=(
            "β of the reference KL; 0 loads no reference model. The reference is the job's starting "
            "policy (`model_name` or `model`), also after a resume."
        ),
    )
    kl_type: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator: `k1`, `k2` or `k3`.")
    is_correction: Literal["plain", "tis", "icepop", "seq-mask-tis"] | None = Field(
        None,
        description=(
            "Importance-sampling correction of the generation/training mismatch: `plain`, `tis`, "
            "`icepop`, `seq-mask-tis`, or null = off."
        ),
    )
    is_min: float | None = Field(None, ge=0.0, description="Lower bound of the IS weight.")
    is_max: float | None = Field(None, gt=0.0, description="Upper bound of the IS weight.")
    reduction: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "`token`: mean over all valid tokens of the global batch; `sequence`: mean of per-sequence means."
        ),
    )
    opd: bool = Field(
        False, description="On-policy distillation advantages; the same switch as `grpo.adv_estimator.name=opd`."
    )
    zero_prev_logprobs: bool = Field(
        False,
        description=(
            "Treat previous logprobs as zero. Checked by the launch rules only; the trainer does not use it yet."
        ),
    )
