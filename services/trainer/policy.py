"""One job's policy on the trainer: GRPO optimizer steps and checkpoints, on one rank or many.

    [TrainingGroup] ─validate_groups─> build_batch ─> advantages (compute_advantages)
        ─> this rank's micro-batches (micro_batches.plan)
        ─> logprobs of π_θ, and of π_ref when kl_penalty > 0 (logprobs.py)
        ─> clipped_pg_loss ─backward─> clip grad norm ─> AdamW step ─> scheduler step
        ─> weight_version += 1
    [(prompt ids, completion ids)] ─validate_rows─> build_row_batch ─> the same micro-batches
        ─> NLL of the completion tokens ─backward─> the same update

Guarantees:
- The loss of a step is the configured reduction over the whole global batch,
  whatever the micro-batching, packing or number of ranks: each micro-batch's
  loss is weighted by its share of the global tokens (or sequences), and the
  gradients of the ranks are summed. Every rank runs the same number of
  forward/backward passes (ranks with fewer rows run zero-weight passes), so
  the FSDP collectives stay in step.
- With more than one rank (torch.distributed initialised, e.g. by torchrun)
  the policy is sharded with FSDP2 (sharding.py); every public method is
  collective and must be called on every rank in the same order, with the
  same arguments.
- With dtype bfloat16 and master_weights_fp32, parameters and optimizer state
  stay fp32 and forward/backward run in bf16 (autocast on one rank, FSDP2's
  mixed-precision policy on many, gradients reduced in fp32).
- Logprobs come from logits divided by the sampling temperature, as the rollout
  engine reports them; no reference model is held when kl_penalty is 0; the
  reference is the job's initial policy, also after a resume.
- With policy.lora only the adapters train (lora.py); the reference is the
  base with adapters off, the weights pushed and checkpointed are the merged
  ones under the plain model's names, and the checkpoint adds the adapter.
- `sft_step` (supervised fine-tuning) shares all of the above: the same model,
  micro-batching, sharding, optimizer, schedule, checkpoints and metrics.
- A batch that fails `validate_groups` (`validate_rows` for sft_step) raises
  BatchError before any tensor or collective is touched: nothing is trained on it.
- `save` + a new PolicyTrainer with checkpointing.resume continue bit for bit:
  weights, optimizer and scheduler state, every rank's RNG, the step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from dockyard.algorithms import clipped_pg_loss, compute_advantages
from dockyard.config import AdvantageConfig, MasterConfig
from dockyard.models.load import DTYPES, load_policy
from services.trainer import checkpoint, lora
from services.trainer.batch import Batch, build_batch, build_row_batch, validate_groups, validate_rows
from services.trainer.experience import Row, TrainingGroup
from services.trainer.logprobs import sampled_logprobs
from services.trainer.micro_batches import MicroBatch, plan
from services.trainer.sharding import (
    full_state,
    load_full_optimizer_state,
    max_over_ranks,
    shard,
    sum_over_ranks,
    world,
)

# A policy's weights as the rollout receives them: (name, full tensor), one parameter at a time.
Weights = Iterator[tuple[str, torch.Tensor]]

_LOSS_STATS = ("pg_loss", "kl", "clip_fraction", "dual_clip_fraction", "is_weight_mean", "ratio_mean")


def trajectory_advantages(batch: Batch, advantage: AdvantageConfig) -> torch.Tensor:
    """One advantage per row: its trajectory's, computed once per trajectory (its first row stands
    for it, so a trajectory of several segments counts once in its group's statistics)."""
    first = batch.first_segment
    return compute_advantages(
        batch.rewards[first],
        batch.group_ids[first],
        batch.valid[first],
        leave_one_out=advantage.leave_one_out,
        scale=advantage.scale,
    )[batch.sample_index]


class PolicyTrainer:
    def __init__(self, config: MasterConfig, device: str = "cpu", checkpoint_dir: Path | None = None) -> None:
        self.config = config
        self.device = device
        self.rank, self.world = world()
        self.checkpoint_dir = checkpoint_dir
        pcfg = config.policy
        torch.manual_seed(pcfg.seed)
        resume = None
        if config.checkpointing.resume and checkpoint_dir is not None:
            resume = checkpoint.latest(checkpoint_dir)
        self.compute_dtype = DTYPES[pcfg.dtype]
        master = torch.float32 if pcfg.master_weights_fp32 else self.compute_dtype
        self.sync_dtype = self.compute_dtype
        # With LoRA the base is always the job's own (a checkpoint adds only its adapters to it).
        use_base = resume is None or pcfg.lora.enabled
        source = pcfg if use_base else pcfg.model_copy(update={"model_name": str(resume.path)})
        self.model, self.tokenizer = load_policy(source, device, dtype=master)
        self.model.train()
        if pcfg.activation_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # the newer transformers name
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.peft = None  # the PeftModel that owns the adapters of self.model, with policy.lora
        if pcfg.lora.enabled:
            self.peft = lora.add_adapters(self.model, pcfg.lora)
            if resume is not None:
                lora.load_adapter(self.peft, resume.path / lora.ADAPTER_DIR, pcfg.lora)
        self.reference: torch.nn.Module | None = None
        # With LoRA the reference is the base with its adapters off (_reference_model), no second copy.
        if config.loss_fn.kl_penalty > 0 and self.peft is None:
            # The reference is the job's starting policy, also when resuming from a later checkpoint.
            self.reference, _ = load_policy(pcfg, device, dtype=master)
            self.reference.eval().requires_grad_(False)
        self.autocast = master != self.compute_dtype
        if self.world > 1:
            models = [m for m in (self.model, self.reference) if m is not None]
            shard(models, self.compute_dtype if self.autocast else None)
            self.autocast = False  # FSDP casts the gathered parameters itself
        opt = pcfg.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # all, or the adapters alone
        self.optimizer = torch.optim.AdamW(
            trainable, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.weight_version = 0
        self.data_state = ""
        self.resumed_from: Path | None = None if resume is None else resume.path
        if resume is not None:
            self._restore(resume.path)

    # -- setup -------------------------------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        """lr multiplier before optimizer step `step + 1`: linear warmup, then constant or cosine."""
        opt = self.config.policy.optimizer
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        if opt.schedule == "constant":
            return 1.0
        horizon = opt.decay_steps or max(1, self.config.max_num_steps - opt.warmup_steps)
        progress = min(1.0, (step - opt.warmup_steps) / horizon)
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def num_parameters(self) -> int:
        """Parameters of the policy as the rollout holds it (LoRA adapters not counted: they are merged)."""
        return sum(p.numel() for n, p in self.model.named_parameters() if not lora.is_adapter(n))

    @property
    def uses_reference(self) -> bool:
        return self.config.loss_fn.kl_penalty > 0

    def _reference_model(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """π_ref for the KL term: the frozen copy, or with LoRA the policy's own base with adapters off."""
        return contextlib.nullcontext(self.reference) if self.peft is None else lora.base_only(self.model, self.peft)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    # -- weights -----------------------------------------------------------------------------

    def named_weights(self) -> Weights:
        """(name, full tensor) in named_parameters order (tied weights once), in the rollout's dtype.

        With LoRA: the plain model's names and shapes, each adapted weight merged (W + scale·B·A),
        computed here without touching the trained weights. Collective with more than one rank:
        every rank must drain the iterator. One parameter is gathered at a time, so at most one
        tensor (and one adapter pair) beyond the shards exists.
        """
        params = self.model.named_parameters() if self.peft is None else lora.merged_parameters(self.model, _full)
        for name, tensor in params:
            yield name, _full(tensor).to(self.sync_dtype)

    # -- training ----------------------------------------------------------------------------

    def train_step(self, groups: Sequence[TrainingGroup]) -> dict[str, float]:
        """One GRPO optimizer step on `groups`; the weight version advances by one."""
        start = time.perf_counter()
        metrics = self.accumulate_gradients(groups)
        return self._update(metrics, start)

    def sft_step(self, demonstrations: Sequence[Row]) -> dict[str, float]:
        """One supervised optimizer step on (prompt ids, completion ids) pairs.

        The loss is the mean negative log-likelihood of every completion token of the
        batch (prompt tokens are context only), micro-batched and sharded like GRPO.
        """
        start = time.perf_counter()
        validate_rows(demonstrations, self.model.config.vocab_size, self.max_positions)
        batch = build_row_batch(demonstrations, self.tokenizer.pad_token_id)
        total_tokens = float(batch.token_mask.sum())
        micro_batches = self._plan(batch, torch.zeros(len(batch)))
        count = max_over_ranks(len(micro_batches), self.world)
        t1 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        nll_sum = sequence_tokens = 0.0
        for i in range(count):
            if i >= len(micro_batches):
                self._idle_pass(reference=False)
                continue
            mb = micro_batches[i].to(self.device)
            sequence_tokens += mb.num_tokens
            with self._autocast():
                logprobs, _ = sampled_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.position_ids, 0.0, False)
            nll = -torch.where(mb.token_mask.bool(), logprobs, 0.0).sum()
            (nll * (self.world / total_tokens)).backward()
            nll_sum += float(nll.detach())
        nll_sum, sequence_tokens = sum_over_ranks([nll_sum, sequence_tokens], self.world)
        metrics = {
            "loss": nll_sum / total_tokens,
            "num_trajectories": float(len(batch)),
            "num_tokens": total_tokens,
            "sequence_tokens": sequence_tokens,
            "num_micro_batches": float(count),
            "batch_seconds": t1 - start,
            "forward_backward_seconds": time.perf_counter() - t1,
        }
        return self._update(metrics, start)

    def _update(self, metrics: dict[str, float], start: float) -> dict[str, float]:
        """Clip, optimizer and scheduler step after the gradients of a step; adds the step's metrics."""
        t_backward = time.perf_counter()
        max_norm = self.config.policy.optimizer.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.weight_version += 1
        end = time.perf_counter()
        seconds = end - start
        metrics.update(
            grad_norm=float(grad_norm),
            train_seconds=seconds,
            optimizer_seconds=end - t_backward,
            tokens_per_second=metrics["sequence_tokens"] / seconds,
            weight_version=float(self.weight_version),
        )
        return metrics

    def accumulate_gradients(self, groups: Sequence[TrainingGroup]) -> dict[str, float]:
        """Zero the gradients, then backpropagate the step's loss over micro-batches; no update."""
        t0 = time.perf_counter()
        cfg, loss_cfg = self.config, self.config.loss_fn
        temperature = cfg.policy.generation.temperature
        validate_groups(groups, self.model.config.vocab_size, self.max_positions)
        batch = build_batch(groups, self.tokenizer.pad_token_id)
        first = batch.first_segment
        advantages = trajectory_advantages(batch, cfg.grpo.advantage)
        # Infrastructure failures carry no learning signal: they leave the loss entirely.
        batch.token_mask = batch.token_mask * batch.valid[:, None].float()
        total_tokens = float(batch.token_mask.sum().clamp(min=1))
        total_seqs = float((batch.token_mask.sum(-1) > 0).sum().clamp(min=1))
        micro_batches = self._plan(batch, advantages)
        count = max_over_ranks(len(micro_batches), self.world)
        t1 = time.perf_counter()

        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", *_LOSS_STATS), 0.0)
        tally = dict.fromkeys(("nll", "abs_delta", "kl", "entropy", "sequence_tokens"), 0.0)
        # FSDP averages gradients over ranks; the step's loss is their sum.
        scale = float(self.world)
        for i in range(count):
            if i >= len(micro_batches):
                self._idle_pass()
                continue
            mb = micro_batches[i].to(self.device)
            tally["sequence_tokens"] += mb.num_tokens
            with self._autocast():
                logprobs, entropy = sampled_logprobs(
                    self.model, mb.input_ids, mb.attention_mask, mb.position_ids, temperature, entropy=True
                )
                reference = None
                if self.uses_reference:
                    with torch.no_grad(), self._reference_model() as model:
                        reference, _ = sampled_logprobs(
                            model, mb.input_ids, mb.attention_mask, mb.position_ids, temperature, False
                        )
            mask = mb.token_mask
            mb_tokens = float(mask.sum())
            # One optimizer step per batch: the pre-update policy is the current one, so
            # its logprobs are these values, detached (ρ = 1 with the gradient of ρ).
            old = logprobs.detach()
            loss, stats = clipped_pg_loss(
                logprobs,
                old,
                mb.advantages,
                mask,
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
                share = float((mask.sum(-1) > 0).sum()) / total_seqs
            (loss * (share * scale)).backward()
            sums["loss"] += float(loss.detach()) * share
            for key in _LOSS_STATS:
                sums[key] += stats[key] * share
            m = mask.bool()
            delta = torch.where(m, old - mb.generation_logprobs, 0.0)
            tally["abs_delta"] += float(delta.abs().sum())
            tally["kl"] += float((-delta).sum())  # k1 estimate of KL(π_gen ‖ π_train) on π_gen's samples
            tally["nll"] += float(-torch.where(m, old, 0.0).sum())
            tally["entropy"] += float(torch.where(m, entropy, 0.0).sum())
        keys = [*sums, *tally]
        values = dict(zip(keys, sum_over_ranks([*sums.values(), *tally.values()], self.world), strict=True))
        t2 = time.perf_counter()

        valid_rewards = batch.rewards[first & batch.valid]
        mean_abs = values["abs_delta"] / total_tokens
        return {
            **{key: values[key] for key in sums},
            # Mean NLL of the sampled tokens: an estimate of the policy's entropy at the sampling temperature.
            "sampled_token_nll": values["nll"] / total_tokens,
            "entropy": values["entropy"] / total_tokens,
            "reward_mean": float(valid_rewards.mean()) if len(valid_rewards) else 0.0,
            "valid_fraction": float(batch.valid[first].float().mean()),
            "advantage_abs_mean": float(advantages[first].abs().mean()),
            "num_trajectories": float(first.sum()),
            "num_segments": float(len(batch)),
            "num_tokens": total_tokens,
            "sequence_tokens": values["sequence_tokens"],
            "num_micro_batches": float(count),
            "batch_seconds": t1 - t0,
            "forward_backward_seconds": t2 - t1,
            "gen_train_logprob_abs_diff": mean_abs,
            "gen_train_prob_error": math.exp(mean_abs) - 1.0,
            "gen_train_kl": values["kl"] / total_tokens,
        }

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    def _idle_pass(self, reference: bool = True) -> None:
        """A zero-weight forward/backward, so this rank joins the FSDP collectives of the others.

        `reference`: whether the other ranks' passes also run the reference model.
        """
        ids = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        with self._autocast():
            out = self.model(input_ids=ids, use_cache=False).logits
            if reference and self.uses_reference:
                with torch.no_grad(), self._reference_model() as model:
                    model(input_ids=ids, use_cache=False)
        (out.float().sum() * 0.0).backward()

    def _plan(self, batch: Batch, advantages: torch.Tensor) -> list[MicroBatch]:
        """This rank's micro-batches: its rows of the global batch under the row and token budgets."""
        pcfg = self.config.policy
        return plan(
            batch,
            advantages,
            rank=self.rank,
            world=self.world,
            max_rows=pcfg.train_micro_batch_size,
            max_tokens=pcfg.max_tokens_per_micro_batch,
            packing=pcfg.sequence_packing,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder: Path, metrics: dict[str, float] | None = None, data_state: str = "") -> Path:
        """Write a checkpoint atomically (collective: call on every rank; rank 0 writes)."""
        if data_state:
            self.data_state = data_state
        model_state, optim_state, rng_states = full_state(self.model, self.optimizer, self.world)
        if self.rank == 0:

            def write(tmp: Path) -> None:
                if self.peft is None:
                    self.model.save_pretrained(tmp, state_dict=model_state)
                else:  # the merged model under its plain names, and the adapter in peft's format
                    lora.save(self.model, self.peft, tmp, model_state)
                self.tokenizer.save_pretrained(tmp)
                torch.save(
                    {
                        "optimizer": optim_state,
                        "scheduler": self.scheduler.state_dict(),
                        "rng": rng_states,
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "weight_version": self.weight_version,
                        "data_state": self.data_state,
                        "world_size": self.world,
                    },
                    tmp / checkpoint.STATE_FILE,
                )

            meta = {"step": self.weight_version, "weight_version": self.weight_version, "metrics": metrics or {}}
            checkpoint.write_atomically(folder, write, meta)
        if self.world > 1:
            dist.barrier()
        return folder

    def _restore(self, folder: Path) -> None:
        state = torch.load(folder / checkpoint.STATE_FILE, map_location="cpu", weights_only=False)
        load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weight_version = int(state["weight_version"])
        self.data_state = state.get("data_state", "")
        rng = state["rng"]
        # Same world size: each rank continues its own stream; otherwise rank 0's.
        torch.set_rng_state(rng[self.rank] if len(rng) == self.world else rng[0])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (gathered when sharded: a collective), detached."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
