"""One job's policy on the trainer: GRPO optimizer steps and checkpoints.

    groups ─build_batch─> advantages (compute_advantages)
                          logprobs of π_θ (and π_ref when kl_penalty > 0), micro-batched
                          clipped_pg_loss ─backward─> clip grad norm ─> AdamW step
                          weight_version += 1

Guarantees: the loss of a step is the configured reduction over the whole
global batch whatever the micro-batch size (each micro-batch's loss is
weighted by its share of tokens or sequences); logprobs are computed from
logits divided by the sampling temperature, as the rollout engine reports
them; no reference model is held when kl_penalty is 0.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from dockyard.algorithms import clipped_pg_loss, compute_advantages
from dockyard.common.v1 import common_pb2
from dockyard.config import MasterConfig
from dockyard.models.load import load_policy
from services.trainer.batch import Batch, build_batch

_LOSS_STATS = ("pg_loss", "kl", "clip_fraction", "dual_clip_fraction", "is_weight_mean", "ratio_mean")


def token_logprobs(model: PreTrainedModel, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, L-1] logprob of each next token under `model`, at the sampling temperature."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


class PolicyTrainer:
    def __init__(self, config: MasterConfig, device: str = "cpu") -> None:
        self.config = config
        self.device = device
        torch.manual_seed(config.policy.seed)
        self.model, self.tokenizer = load_policy(config.policy, device)
        self.model.train()
        self.reference: PreTrainedModel | None = None
        if config.loss_fn.kl_penalty > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        opt = config.policy.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        warmup = opt.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.weight_version = 0

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What the weight sync broadcasts: named_parameters order (tied weights once), as the engine names them."""
        return [(name, p.data) for name, p in self.model.named_parameters()]

    def train_step(self, groups: Sequence[common_pb2.Group]) -> dict[str, float]:
        """One optimizer step on `groups`; the weight version advances by one."""
        start = time.perf_counter()
        metrics = self.accumulate_gradients(groups)
        max_norm = self.config.policy.optimizer.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.weight_version += 1
        seconds = time.perf_counter() - start
        metrics.update(
            grad_norm=float(grad_norm),
            train_seconds=seconds,
            tokens_per_second=metrics["num_tokens"] / seconds,
            weight_version=float(self.weight_version),
        )
        return metrics

    def accumulate_gradients(self, groups: Sequence[common_pb2.Group]) -> dict[str, float]:
        """Zero the gradients, then backpropagate the step's loss over micro-batches; no update."""
        cfg, loss_cfg = self.config, self.config.loss_fn
        temperature = cfg.policy.generation.temperature
        batch = build_batch(groups, self.tokenizer.pad_token_id)
        advantages = compute_advantages(
            batch.rewards,
            batch.group_ids,
            batch.valid,
            leave_one_out=cfg.grpo.advantage.leave_one_out,
            scale=cfg.grpo.advantage.scale,
        )
        # Infrastructure failures carry no learning signal: they leave the loss entirely.
        batch.token_mask = batch.token_mask * batch.valid[:, None].float()
        batch = _to(batch, self.device)
        advantages = advantages.to(self.device)
        total_tokens = float(batch.token_mask.sum().clamp(min=1))
        total_seqs = float((batch.token_mask.sum(-1) > 0).sum().clamp(min=1))

        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", *_LOSS_STATS), 0.0)
        nll = abs_delta = kl = 0.0
        micro = cfg.policy.train_micro_batch_size
        for lo in range(0, len(batch), micro):
            mb, mb_adv = batch.slice(lo, lo + micro), advantages[lo : lo + micro]
            mb_tokens = float(mb.token_mask.sum())
            if mb_tokens == 0:
                continue
            logprobs = token_logprobs(self.model, mb, temperature)
            reference = None
            if self.reference is not None:
                with torch.no_grad():
                    reference = token_logprobs(self.reference, mb, temperature)
            # One optimizer step per batch: the pre-update policy is the current one, so
            # its logprobs are these values, detached (ρ = 1 with the gradient of ρ).
            old = logprobs.detach()
            loss, stats = clipped_pg_loss(
                logprobs,
                old,
                mb_adv,
                mb.token_mask,
                generation_logprobs=mb.generation_logprobs,
                reference_logprobs=reference,
                clip_low=loss_cfg.clip_low,
                clip_high=loss_cfg.clip_high,
                dual_clip_c=loss_cfg.dual_clip_c,
                kl_penalty=loss_cfg.kl_penalty,
                kl_type=loss_cfg.kl_type,
                is_correction=loss_cfg.is_correction,
                is_min=loss_cfg.is_min,
                is_max=loss_cfg.is_max,
                reduction=loss_cfg.reduction,
            )
            # Weight each micro-batch by its share, so the sum is the global-batch reduction.
            if loss_cfg.reduction == "token":
                share = mb_tokens / total_tokens
            else:
                share = float((mb.token_mask.sum(-1) > 0).sum()) / total_seqs
            (loss * share).backward()
            sums["loss"] += float(loss.detach()) * share
            for key in _LOSS_STATS:
                sums[key] += stats[key] * share
            delta = (old - mb.generation_logprobs) * mb.token_mask
            abs_delta += float(delta.abs().sum())
            kl += float((-delta).sum())  # k1 estimate of KL(π_gen ‖ π_train) on π_gen's samples
            nll += float(-(old * mb.token_mask).sum())

        valid_rewards = batch.rewards[batch.valid]
        mean_abs = abs_delta / total_tokens
        return {
            **sums,
            # Mean NLL of the sampled tokens: an estimate of the policy's entropy at the sampling temperature.
            "sampled_token_nll": nll / total_tokens,
            "reward_mean": float(valid_rewards.mean()) if len(valid_rewards) else 0.0,
            "valid_fraction": float(batch.valid.float().mean()),
            "advantage_abs_mean": float(advantages.abs().mean()),
            "num_trajectories": float(len(batch)),
            "num_tokens": total_tokens,
            "gen_train_logprob_abs_diff": mean_abs,
            "gen_train_prob_error": math.exp(mean_abs) - 1.0,
            "gen_train_kl": kl / total_tokens,
        }

    def save(self, folder: Path) -> Path:
        """Write a Hugging Face folder atomically: a temporary name, then one rename."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        return folder


def _to(batch: Batch, device: str) -> Batch:
    return Batch(**{name: value.to(device) for name, value in vars(batch).items()})
