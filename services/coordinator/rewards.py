"""Rewards of a group: verdict -> raw reward, then the shaping the config asks for, and dynamic sampling's test.

    Verdict ─reward_functions (env.reward)─> (reward, valid) ─shape_rewards─> integrity zeroing
            ─> invalid-action penalty ─> overlong penalty ─> reward scaling (valid trajectories only)
    has_signal: any spread among valid rewards?

The invalid-action penalty (grpo.invalid_action_penalty) is subtracted once from a trajectory with
any malformed action (Trajectory.invalid_actions > 0: an unparsable tool call, a reply the scaffold
dropped, an unclosed thinking block). The overlong penalty counts sampled tokens (loss mask 1) over all
segments, and gives an agent trial that ran out of turns, tokens or time the full penalty.

Guarantees: an ERROR verdict is an infrastructure failure, invalid (masked), never a zero reward;
a trajectory flagged integrity_violation earns nothing for passing, before any penalty; shaping
never touches an invalid trajectory's reward.
"""

from __future__ import annotations

import torch

from dockyard.algorithms import (
    apply_integrity,
    dynamic_sampling_mask,
    invalid_action_penalty,
    overlong_penalty,
    scale_rewards,
)
from dockyard.api.common.v1 import common_pb2
from dockyard.config import GRPOConfig


def reward_of(verdict: common_pb2.Verdict, kind: str) -> tuple[float, bool]:
    """(reward, valid) of a verdict; ERROR is an infrastructure failure, not a zero."""
    if verdict.status == common_pb2.VERDICT_STATUS_ERROR:
        return 0.0, False
    if kind == "all_pass":
        return float(verdict.status == common_pb2.VERDICT_STATUS_PASSED), True
    if verdict.tests_total == 0:
        return 0.0, True
    return verdict.tests_passed / verdict.tests_total, True


# How an agent trial ends when one of its budgets runs out (dockyard/agents/scaffold.py).
BUDGET_ENDS = frozenset({"turns", "tokens", "time"})


def sampled_tokens(trajectory: common_pb2.Trajectory) -> int:
    """Tokens the policy sampled, over every segment (context tokens of a multi-turn trial excluded); for
    metadata whose arrays the rollout staged, the count it carries."""
    if trajectory.sampled_tokens:
        return trajectory.sampled_tokens
    total = 0
    for segment in [trajectory, *trajectory.later_segments]:
        mask = segment.completion_loss_mask
        total += sum(mask) if mask else len(segment.completion_token_ids)
    return total


def shape_rewards(trajectories: list[common_pb2.Trajectory], grpo: GRPOConfig) -> None:
    """Integrity zeroing, then the invalid-action and overlong penalties and reward scaling, on the valid
    trajectories (in place)."""
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    # Before any penalty: a patch that touched protected (test) files earns nothing for passing.
    rewards = apply_integrity(rewards, torch.tensor([t.verdict.integrity_violation for t in trajectories]))
    if grpo.invalid_action_penalty > 0:
        malformed = torch.tensor([t.invalid_actions > 0 for t in trajectories], dtype=torch.bool)
        rewards = invalid_action_penalty(rewards, malformed, grpo.invalid_action_penalty)
    if grpo.reward_shaping.enabled:
        shaping = grpo.reward_shaping
        # A trial cut short by a budget is overlong by definition: the full penalty.
        lengths = torch.tensor(
            [shaping.max_response_length if t.finish_reason in BUDGET_ENDS else sampled_tokens(t) for t in trajectories]
        )
        rewards = rewards + overlong_penalty(
            lengths, shaping.max_response_length, shaping.overlong_buffer_length, shaping.overlong_penalty
        )
    if grpo.reward_scaling.enabled:
        s = grpo.reward_scaling
        rewards = scale_rewards(rewards, s.source_min, s.source_max, s.target_min, s.target_max)
    for t, r in zip(trajectories, rewards.tolist(), strict=True):
        if t.valid:
            t.reward = r


def has_signal(group: common_pb2.Group) -> bool:
    rewards = torch.tensor([t.reward for t in group.trajectories])
    valid = torch.tensor([t.valid for t in group.trajectories])
    return bool(dynamic_sampling_mask(rewards, torch.zeros(len(rewards), dtype=torch.long), valid).all())
