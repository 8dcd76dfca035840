"""The `loss_fn` section: the objective, clipping, KL, importance-sampling correction and reduction.

Guarantees: each choice is one of the names the loss functions accept (choices.py); the knobs a
`name` presets are filled in by presets.py when the config leaves them unset; the combinations that
need each other are checked by launch_rules.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import MAX_TOKENS, Section


class LossConfig(Section):
    name: Literal["grpo", "dapo", "dr-grpo", "gspo", "gspo-token", "cispo", "sapo"] = Field(
        "grpo",
        description=(
            "The policy-gradient objective: `grpo` (the clipped token ratio), `gspo` / `gspo-token` "
            "(clipped length-normalised sequence ratio), `cispo` (clipped, stop-gradient IS weight on "
            "log π), `sapo` (soft gate), or the presets `dapo` and `dr-grpo` of the GRPO objective; "
            "each fills the knobs the config leaves unset "
            "([algorithms.md](algorithms.md#the-policy-gradient-family))."
        ),
    )
    clip_low: float = Field(
        0.2, ge=0.0, le=1.0, description="ρ is clipped below at 1 − clip_low; in [0, 1] (1: no lower bound)."
    )
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
    reduction: Literal["token", "sequence", "constant"] = Field(
        "token",
        description=(
            "`token`: mean over all valid tokens of the global batch; `sequence`: mean of per-sequence means; "
            "`constant` (Dr.GRPO): token sum over sequences × `length_normaliser`."
        ),
    )
    length_normaliser: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="The constant length of `reduction: constant`; null = `policy.generation.max_new_tokens`.",
    )
    tau_pos: float = Field(1.0, gt=0.0, le=1e3, description="SAPO's gate temperature where the advantage is > 0.")
    tau_neg: float = Field(1.05, gt=0.0, le=1e3, description="SAPO's gate temperature where the advantage is ≤ 0.")
    opd: bool = Field(
        False, description="On-policy distillation advantages; the same switch as `grpo.adv_estimator.name=opd`."
    )
    zero_prev_logprobs: bool = Field(
        False,
        description=(
            "Treat previous logprobs as zero. Checked by the launch rules only; the trainer does not use it yet."
        ),
    )
