"""The `grpo` section: groups per step, staleness, advantages, async mode and reward shaping.

Guarantees: every size is bounded (section.py); what async mode refuses is checked by
launch_rules.py, not here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dockyard.config.section import MAX_BATCH, MAX_GROUP, MAX_SEED, MAX_STEPS, MAX_TOKENS, Section


class AdvantageConfig(Section):
    leave_one_out: bool = Field(True, description="Baseline excludes the sample itself.")
    scale: Literal["group", "batch", "none"] = Field("group", description="Std normalisation; none = Dr.GRPO.")


class AdvantageEstimatorConfig(Section):
    name: Literal["grpo", "opd"] = Field(
        "grpo",
        description="grpo: group-relative advantages of the rewards; opd: on-policy distillation, "
        "sg[log π_teacher − log π_student] per token (teachers in on_policy_distillation).",
    )


class ToggleConfig(Section):
    enabled: bool = False


class AsyncConfig(ToggleConfig):
    in_flight_weight_updates: bool = Field(
        False, description="Rollout engines load new weights between decode steps of a running generation."
    )


class RewardScalingConfig(ToggleConfig):
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


class RewardShapingConfig(ToggleConfig):
    max_response_length: int = Field(
        32, ge=1, le=MAX_TOKENS, description="Tokens beyond which the full penalty applies."
    )
    overlong_buffer_length: int = Field(
        8, ge=0, le=MAX_TOKENS, description="Tokens before the max over which the penalty ramps."
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Penalty at and beyond the max.")


class DynamicSamplingConfig(ToggleConfig):
    max_refills: int = Field(3, ge=0, le=100, description="Extra generation rounds to refill dropped groups.")


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(8, ge=1, le=MAX_BATCH, description="Groups per step.")
    num_generations_per_prompt: int = Field(8, ge=1, le=MAX_GROUP, description="Group size.")
    max_num_steps: int = Field(20, ge=1, le=MAX_STEPS, description="Optimizer steps of the job.")
    max_trajectory_age_steps: int = Field(
        1,
        ge=0,
        le=1000,
        description="A group generated at weight version v is trained by a trainer at version s "
        "(optimizer steps taken) only if s − v ≤ this; synchronous GRPO always trains at age 0, "
        "and asynchronous GRPO generates at most this many steps' groups ahead of the trainer.",
    )
    max_buffered_groups: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="Buffer capacity of the job (held + pending groups); "
        "null = num_prompts_per_step × (max_trajectory_age_steps + 1).",
    )
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="Validate every this many steps; 0 = only at start/end.")
    val_at_start: bool = True
    val_at_end: bool = True
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of task order and of generation.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    adv_estimator: AdvantageEstimatorConfig = Field(default_factory=AdvantageEstimatorConfig)
    max_rollout_turns: int = Field(
        16, ge=1, le=4096, description="Agent trials: model calls per trial; one that runs out is scored as it is."
    )
    max_trial_tokens: int = Field(
        4096,
        ge=16,
        le=MAX_TOKENS,
        description="Agent trials: tokens of the trial's sequence (prompt, turns, tool output) at most.",
    )
    max_trial_seconds: float = Field(
        600.0, gt=0.0, le=86400.0, description="Agent trials: wall clock per trial, scoring excluded."
    )
    max_concurrent_trials: int = Field(
        64, ge=1, le=4096, description="Agent trials run at once by the coordinator's agent workers."
    )

    async_grpo: AsyncConfig = Field(default_factory=AsyncConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    invalid_action_penalty: float = Field(
        0.0,
        ge=0.0,
        le=1e6,
        allow_inf_nan=False,
        description="Subtracted from the reward of a trajectory with a malformed action (an unparsable tool "
        "call, an unclosed thinking block); 0 = off. Reward shaping: refused with async GRPO.",
    )

    @property
    def buffer_capacity(self) -> int:
        return self.max_buffered_groups or self.num_prompts_per_step * (self.max_trajectory_age_steps + 1)
