"""A GRPO trainer step's layout and statistics: minibatches of whole groups, each one optimizer step.

    [TrainingGroup] ─build_batch─> Batch (rows in group order) ─advantages over the whole step─>
        ─minibatch_rows(policy.train_global_batch_size)─> Minibatch: rows of whole groups
            ─micro_batches.plan─> this rank's micro-batches, the passes every rank runs,
                                  the minibatch's token and sequence counts (the loss's denominators)
        ─> per optimizer step: loss statistics ─┐
           per step: the tally of π_old ────────┴─step_metrics─> the step's metrics

Guarantees: advantages are computed once per step, over every trajectory of
the step, whatever the minibatches, by the job's estimator
(`grpo.adv_estimator.name`; with REINFORCE++'s KL in the reward, again once π_old
and π_ref of the whole step are known); a group is never split across
minibatches; the tally (sampled-token NLL, entropy, generation-vs-training
mismatch) is taken once per step, on the policy that starts it; loss
statistics (loss, clip fractions, ...) are means over the step's optimizer
steps, but ratio_min and ratio_max, the extremes over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dockyard.algorithms import compute_advantages, reinforce_pp_advantages, rloo_advantages
from dockyard.config import GRPOConfig, LossConfig, MasterConfig
from dockyard.config.choices import POLICY_LOSS_OF
from dockyard.experience.trainable import CheckedGroups, validate_groups
from services.trainer.batch import Batch, build_batch, minibatch_rows
from services.trainer.experience import TrainingGroup
from services.trainer.micro_batches import MicroBatch
from services.trainer.sharding import max_over_ranks, sum_over_ranks

# The loss's statistics a step reports, token-weighted over its micro-batches (both backends).
LOSS_STATS = ("pg_loss", "kl", "clip_fraction", "dual_clip_fraction", "gate_mean", "is_weight_mean", "ratio_mean")
# ... and those that are extremes over the micro-batches, ranks and optimizer steps.
RATIO_EXTREMES = ("ratio_min", "ratio_max")

# (π_old logprobs, π_ref logprobs or None) of one micro-batch, taken before the step's first update.
Frozen = tuple[torch.Tensor, torch.Tensor | None]
TALLY = ("nll", "abs_delta", "kl", "entropy", "sequence_tokens")


@dataclass
class Minibatch:
    micro: list[MicroBatch]  # this rank's micro-batches
    count: int  # forward/backward passes every rank runs (the most micro-batches of any rank)
    tokens: float  # valid tokens of the minibatch, all ranks (the token reduction's denominator)
    sequences: float  # rows with a valid token, all ranks (the sequence reduction's denominator)
    first_row: int = 0  # its first row in the step's batch


@dataclass
class Step:
    batch: Batch
    advantages: torch.Tensor  # one per row, or per token ([rows, L-1]) for the token-level estimators
    minibatches: list[Minibatch]


def trajectory_advantages(batch: Batch, grpo: GRPOConfig, kl: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages of every row, by `grpo.adv_estimator.name`: one per row for the group estimators (its
    trajectory's, computed once per trajectory: its first row stands for it, so a trajectory of several
    segments counts once in its group's statistics), one per token for REINFORCE++ (normalised over
    every valid token of the step; `kl` [rows, L-1], with `grpo.adv_estimator.kl_in_reward`, is the
    per-token KL each token pays, to the end of its trajectory: later segments' too)."""
    first = batch.first_segment
    rewards, groups, valid = batch.rewards[first], batch.group_ids[first], batch.valid[first]
    estimator, advantage = grpo.adv_estimator.name, grpo.advantage
    if estimator == "rloo":
        return rloo_advantages(rewards, groups, valid)[batch.sample_index]
    if estimator in ("reinforce++", "reinforce++-baseline"):
        if estimator == "reinforce++-baseline":
            rewards = compute_advantages(rewards, groups, valid, leave_one_out=False, scale="none")
        per_row = rewards[batch.sample_index]
        beta = grpo.adv_estimator.kl_in_reward
        if kl is not None and beta > 0:
            per_row = per_row - beta * _later_segments(kl, batch.token_mask, batch.sample_index)
        return reinforce_pp_advantages(per_row, batch.token_mask, batch.valid, kl=kl, kl_coef=beta)
    grouped = compute_advantages(rewards, groups, valid, leave_one_out=advantage.leave_one_out, scale=advantage.scale)
    return grouped[batch.sample_index]


def _later_segments(kl: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """Per row: the KL summed over the later rows of its trajectory (rows of a sample are consecutive)."""
    totals = torch.where(mask.bool(), kl, 0.0).sum(-1)
    later = torch.zeros_like(totals)
    for row in range(len(totals) - 2, -1, -1):
        if sample_index[row + 1] == sample_index[row]:
            later[row] = later[row + 1] + totals[row + 1]
    return later


def loss_options(loss: LossConfig) -> dict:
    """The keyword arguments of clipped_pg_loss that the job's `loss_fn` section sets."""
    names = ("clip_low", "clip_high", "dual_clip_c", "kl_penalty", "kl_type", "is_correction", "is_min", "is_max")
    options = {name: getattr(loss, name) for name in names}
    return options | {
        "reduction": loss.reduction,
        "policy_loss": POLICY_LOSS_OF[loss.name],
        "tau_pos": loss.tau_pos,
        "tau_neg": loss.tau_neg,
        "length_normaliser": loss.length_normaliser,
    }


def loss_share(loss: LossConfig, micro: MicroBatch, mini: Minibatch) -> float:
    """A micro-batch's weight in its minibatch's loss: its share of the reduction's denominator (its tokens,
    or its sequences for the sequence and constant reductions), read on the host: no wait for the device."""
    if loss.reduction == "token":
        return micro.loss_tokens / mini.tokens
    return micro.loss_sequences / mini.sequences


def prepare_step(
    groups: Sequence[TrainingGroup],
    config: MasterConfig,
    pad_token_id: int,
    vocab_size: int,
    max_positions: int | None,
    minibatch_size: int | None,
    plan_rows: Callable[[Batch, torch.Tensor], list[MicroBatch]],
    world: int,
) -> Step:
    """Validate and lay out a step, its advantages (over the whole step) and its minibatches (None: one);
    `plan_rows(rows, advantages)` cuts a minibatch into this rank's micro-batches."""
    if not isinstance(groups, CheckedGroups):  # the servicer checked these already, before any rank saw them
        validate_groups(groups, vocab_size, max_positions)
    batch = build_batch(groups, pad_token_id)
    advantages = trajectory_advantages(batch, config.grpo)
    # Infrastructure failures carry no learning signal: they leave the loss entirely.
    batch.token_mask = batch.token_mask * batch.valid[:, None].float()
    bounds = [slice(0, len(batch))] if minibatch_size is None else minibatch_rows(groups, minibatch_size)
    minibatches = []
    for rows in bounds:
        part = batch.slice(rows.start, rows.stop)
        micro = plan_rows(part, advantages[rows])
        minibatches.append(
            Minibatch(
                micro,
                max_over_ranks(len(micro), world),
                float(part.token_mask.sum().clamp(min=1)),
                float((part.token_mask.sum(-1) > 0).sum().clamp(min=1)),
                rows.start,
            )
        )
    return Step(batch, advantages, minibatches)


def put_kl_in_rewards(step: Step, frozen: list[list[Frozen]], grpo: GRPOConfig, world: int) -> None:
    """REINFORCE++ with `kl_in_reward`: the step's advantages again, each token paying β·(log π_old − log π_ref)
    to the end of its trajectory, from the π_old and π_ref of every micro-batch of every rank; each
    micro-batch's advantages replaced in place (padded rows: the launch rules refuse packing)."""
    kl = torch.zeros_like(step.batch.token_mask)
    for mini, parts in zip(step.minibatches, frozen, strict=True):
        for mb, (old, reference) in zip(mini.micro, parts, strict=True):
            assert reference is not None, "kl_in_reward loads the reference"
            rows = [mini.first_row + r for r in mb.rows]
            width = mb.token_mask.shape[1]
            paid = torch.where(mb.token_mask.bool(), (old - reference).float().cpu(), 0.0)
            kl[rows, :width] = paid
    if world > 1:  # every row is one rank's: the sum is the whole step's
        dist.all_reduce(kl)
    step.advantages = trajectory_advantages(step.batch, grpo, kl)
    for mini in step.minibatches:
        for mb in mini.micro:
            rows = [mini.first_row + r for r in mb.rows]
            mb.advantages = step.advantages[rows, : mb.token_mask.shape[1]].to(mb.advantages.device)


def count(tally: dict[str, float], mb: MicroBatch, old: torch.Tensor, entropy: torch.Tensor | None) -> None:
    """Add one micro-batch of π_old's logprobs (and entropy) to the step's tally."""
    m = mb.token_mask.bool()
    delta = torch.where(m, old - mb.generation_logprobs, 0.0)
    tally["sequence_tokens"] += mb.num_tokens
    tally["abs_delta"] += float(delta.abs().sum())
    tally["kl"] += float((-delta).sum())  # k1 estimate of KL(π_gen ‖ π_train) on π_gen's samples
    tally["nll"] += float(-torch.where(m, old, 0.0).sum())
    if entropy is not None:
        tally["entropy"] += float(torch.where(m, entropy, 0.0).sum())


def step_metrics(
    step: Step, updates: list[dict[str, float]], tally: dict[str, float], world: int, prepare: float, passes: float
) -> dict[str, float]:
    """A trainer step's metrics: loss statistics averaged over its optimizer steps, the rest over the step."""
    batch, first = step.batch, step.batch.first_segment
    values = dict(zip(tally, sum_over_ranks(list(tally.values()), world), strict=True))
    total_tokens = float(batch.token_mask.sum().clamp(min=1))
    valid_rewards = batch.rewards[first & batch.valid]
    mean_abs = values["abs_delta"] / total_tokens
    advantage = step.advantages.abs()
    if advantage.dim() == 2:  # per token: each row's mean over its valid tokens
        advantage = (advantage * batch.token_mask).sum(-1) / batch.token_mask.sum(-1).clamp(min=1)
    return {
        **{key: sum(u[key] for u in updates) / len(updates) for key in updates[0] if key not in RATIO_EXTREMES},
        **({"ratio_min": min(u["ratio_min"] for u in updates)} if "ratio_min" in updates[0] else {}),
        **({"ratio_max": max(u["ratio_max"] for u in updates)} if "ratio_max" in updates[0] else {}),
        # Mean NLL of the sampled tokens: an estimate of the policy's entropy at the sampling temperature.
        "sampled_token_nll": values["nll"] / total_tokens,
        "entropy": values["entropy"] / total_tokens,
        "reward_mean": float(valid_rewards.mean()) if len(valid_rewards) else 0.0,
        "valid_fraction": float(batch.valid[first].float().mean()),
        "advantage_abs_mean": float(advantage[first].mean()),
        "num_trajectories": float(first.sum()),
        "num_segments": float(len(batch)),
        "num_tokens": total_tokens,
        "sequence_tokens": values["sequence_tokens"],
        "num_micro_batches": float(sum(m.count for m in step.minibatches)),
        "num_minibatches": float(len(step.minibatches)),
        "optimizer_steps": float(len(updates)),
        "batch_seconds": prepare,
        "forward_backward_seconds": passes,
        "gen_train_logprob_abs_diff": mean_abs,
        "gen_train_prob_error": math.exp(mean_abs) - 1.0,
        "gen_train_kl": values["kl"] / total_tokens,
    }
