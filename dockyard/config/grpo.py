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
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Std normalisation: `group`, `batch`, or `none` (Dr.GRPO)."
    )


class AdvantageEstimatorConfig(Section):
    name: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline", "opd"] = Field(
        "grpo",
        description=(
            "`grpo`: group-relative advantages of the rewards (`grpo.advantage`); `rloo`: reward minus the "
            "mean of the group's other rewards, unscaled; `reinforce++`: the reward normalised over the "
            "step's tokens (`reinforce++-baseline`: minus its group's mean first; "
            "[algorithms.md](algorithms.md#advantage-estimators)); `opd`: on-policy "
            "distillation, the advantage of each student token is sg[log π_teacher − log π_student] "
            "on the student's own rollouts, with the teacher of `on_policy_distillation` (the "
            "token-level estimator, not a full-vocabulary KL; "
            "[algorithms.md](algorithms.md#on-policy-distillation))."
        ),
    )
    kl_in_reward: float = Field(
        0.0,
        ge=0.0,
        le=1e3,
        description=(
            "`reinforce++` and `reinforce++-baseline`: β of the per-token KL (k1, log π_old − log π_ref) each "
            "token pays in the reward, summed into its return to go; 0 = none, > 0 loads the reference. "
            "Torch backend, unpacked rows."
        ),
    )


class ToggleConfig(Section):
    """A feature that is off unless `enabled`; each subclass states what `enabled` turns on."""

    enabled: bool = False


class AsyncConfig(ToggleConfig):
    enabled: bool = Field(
        False,
        description=(
            "Asynchronous GRPO: generation and scoring run without pause while the trainer steps on "
            "whole groups within `grpo.max_trajectory_age_steps` (oldest version first) "
            "([architecture.md](architecture.md#asynchronous-grpo)). Needs `loss_fn.is_correction`."
        ),
    )
    in_flight_weight_updates: bool = Field(
        False,
        description=(
            "Rollout engines load new weights while a generation runs (between two decode steps, KV "
            "cache kept) instead of waiting for it to end; each result lists every weight version it "
            "spanned (`GenerateResponse.weight_versions`) and reports the oldest as `weight_version`. "
            "Read by the rollout replica whatever `enabled` says."
        ),
    )


class RewardScalingConfig(ToggleConfig):
    enabled: bool = Field(False, description="Apply the scaling.")
    source_min: float = Field(0.0, description="Lower clamp of the raw reward.")
    source_max: float = Field(1.0, description="Upper clamp of the raw reward.")
    target_min: float = Field(0.0, description="Value source_min maps to.")
    target_max: float = Field(1.0, description="Value source_max maps to.")


class RewardShapingConfig(ToggleConfig):
    enabled: bool = Field(False, description="Apply the overlong penalty.")
    max_response_length: int = Field(
        32, ge=1, le=MAX_TOKENS, description="Tokens beyond which the full penalty applies."
    )
    overlong_buffer_length: int = Field(
        8, ge=0, le=MAX_TOKENS, description="Tokens before the max over which the penalty ramps; 0 = a step at the max."
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Penalty at and beyond the max.")


class DynamicSamplingConfig(ToggleConfig):
    enabled: bool = Field(
        False, description="Drop groups whose valid rewards are all equal and draw further tasks to refill the step."
    )
    max_refills: int = Field(
        3,
        ge=0,
        le=100,
        description=(
            "Extra generation rounds to refill dropped groups; a step with no kept group after them fails the job."
        ),
    )


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(8, ge=1, le=MAX_BATCH, description="Groups per step.")
    num_generations_per_prompt: int = Field(
        8, ge=1, le=MAX_GROUP, description="Group size: completions per prompt (one `Generate` call)."
    )
    max_num_steps: int = Field(20, ge=1, le=MAX_STEPS, description="Optimizer steps of the job.")
    max_trajectory_age_steps: int = Field(
        1,
        ge=0,
        le=1000,
        description=(
            "A group generated at version v is sampled by a trainer at version s (steps taken before "
            "this step) only if s − v ≤ this; older groups are dropped and counted. Synchronous "
            "groups have age 0; in async mode the producer keeps at most this many steps' groups "
            "ahead of the trainer (held plus in flight)."
        ),
    )
    max_buffered_groups: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description=(
            "Buffer capacity of the job (held + pending groups); null = `num_prompts_per_step × "
            "(max_trajectory_age_steps + 1)`. A put beyond it is RESOURCE_EXHAUSTED and the collector "
            "backs off."
        ),
    )
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="Validate every this many steps; 0 = only at start/end.")
    val_at_start: bool = Field(True, description="Validate at weight version 0, before step 1.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seed of the training task order and of each group's generation seed."
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    adv_estimator: AdvantageEstimatorConfig = Field(default_factory=AdvantageEstimatorConfig)
    max_rollout_turns: int = Field(
        16,
        ge=1,
        le=4096,
        description=(
            "Agent trials (`env.tools` set): model calls per trial at most; a trial that runs out is "
            "scored as it stands, with finish reason `turns` ([agents.md](agents.md))."
        ),
    )
    max_trial_tokens: int = Field(
        4096,
        ge=16,
        le=MAX_TOKENS,
        description=(
            "Agent trials: tokens of a trial's whole sequence (prompt, every turn, tool output) at "
            "most, each counted once (context a later segment repeats counts once; replies the "
            "scaffold abandoned, not at all); each turn asks for no more than what is left, the trial "
            "ends (`tokens`) when the endpoint's usage reaches it, and the recorded tokens are cut to "
            "it. Keep it within the model's positions."
        ),
    )
    max_trial_seconds: float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description=(
            "Agent trials: wall clock per trial before its answer is scored (checked before each turn "
            "and bounding each call); one that runs out ends with `time`."
        ),
    )
    max_concurrent_trials: int = Field(
        64,
        ge=1,
        le=4096,
        description=(
            "Agent trials the coordinator runs at once for a job (each holds a sandbox session and an "
            "endpoint session)."
        ),
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
        description=(
            "Subtracted (once) from the reward of a valid trajectory with a malformed action: a tool "
            "call that is not a valid call of the offered tools or a reply the scaffold dropped (agent "
            "trials), or a `<think>` block never closed by `</think>` (any completion); 0 = off. "
            "Reward shaping: refused with `grpo.async_grpo.enabled=true`. Counted per step as "
            "`invalid_action_trajectories` ([rewards.md](rewards.md#the-invalid-action-penalty))."
        ),
    )

    @property
    def buffer_capacity(self) -> int:
        return self.max_buffered_groups or self.num_prompts_per_step * (self.max_trajectory_age_steps + 1)
