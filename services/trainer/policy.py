"""One job's policy on the trainer: GRPO trainer steps and checkpoints, on one rank or many.

    [TrainingGroup] ─validate_groups (unless CheckedGroups)─> build_batch ─> advantages over the whole step
        ─> minibatches of whole groups, train_global_batch_size trajectories each (minibatches.py)
        ─> each minibatch: this rank's micro-batches (micro_batches.plan)
        ─(more than one minibatch or epoch)─> π_old (and π_ref) logprobs of every micro-batch, no grad,
                                              by the policy that starts the step
        ─> per epoch, per minibatch: logprobs of π_θ (logprobs.py) ─> clipped_pg_loss (loss_fn.name's
           objective) ─backward─>
           clip grad norm ─> AdamW step
        ─> scheduler step, weight_version += 1 (once per trainer step)
    [(prompt ids, completion ids)] ─validate_rows─> build_row_batch ─> the same micro-batches
        ─> NLL of the completion tokens ─backward─> one update

Guarantees:
- A trainer step takes one optimizer step per minibatch per epoch
  (`policy.num_epochs`), and advances the weight version and the learning-rate
  schedule once. With one minibatch and one epoch π_old is the current policy
  (ρ = 1); otherwise π_old is the policy that starts the step, computed once,
  so later updates see ρ ≠ 1 and the clip binds. The IS weight always compares
  π_old with the generation logprobs.
- The loss of an optimizer step is the configured reduction over its minibatch,
  whatever the micro-batching, packing or number of ranks: each micro-batch's
  loss is weighted by its share of the minibatch's tokens (or sequences), and the
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
  engine reports them; no reference model is held when kl_penalty and
  grpo.adv_estimator.kl_in_reward are 0 (the latter: REINFORCE++'s KL in the
  reward, with π_old and π_ref of the whole step taken before its first update); the
  reference is the job's initial policy, also after a resume.
- With on-policy distillation (teachers.py) the advantage of every token is
  sg[log π_teacher − log π_old] on the student's own rollout, in place of the
  group advantage; the teacher is frozen like the reference (no optimizer, no
  gradient) and its logprobs use the same temperature. This is the token-level
  estimator on the sampled token, not a full-vocabulary KL.
- With policy.lora only the adapters train (lora.py); the reference is the
  base with adapters off, the weights pushed and checkpointed are the merged
  ones under the plain model's names, and the checkpoint adds the adapter.
- `sft_step` (supervised fine-tuning) shares all of the above: the same model,
  micro-batching, sharding, optimizer, schedule, checkpoints and metrics.
- A batch that fails `validate_groups` (`validate_rows` for sft_step) raises
  BatchError before any tensor or collective is touched: nothing is trained on it.
  CheckedGroups (the servicer's, already validated on rank 0) are not checked again.
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

from dockyard.algorithms import clipped_pg_loss, opd_advantages
from dockyard.config import ConfigError, MasterConfig
from dockyard.experience.trainable import CheckedRows, validate_rows
from dockyard.export.hf_export import is_sharded
from dockyard.models.load import DTYPES, load_policy
from dockyard.models.routing import RoutingReplay, routers
from dockyard.weights import arena
from services.trainer import checkpoint, lora, packed_attention, teachers
from services.trainer.auto_settings import compiles_layers, packs_rows
from services.trainer.batch import Batch, build_row_batch
from services.trainer.compiled_layers import compile_decoder_layers, decoder_layers
from services.trainer.experience import Row, TrainingGroup
from services.trainer.logprobs import sampled_logprobs
from services.trainer.micro_batches import MicroBatch, plan
from services.trainer.minibatches import (
    LOSS_STATS,
    TALLY,
    Frozen,
    Minibatch,
    Step,
    count,
    loss_options,
    loss_share,
    prepare_step,
    put_kl_in_rewards,
    step_metrics,
)
from services.trainer.sharded_checkpoint import ShardedCheckpoints
from services.trainer.sharding import (
    extremes_over_ranks,
    full_state,
    load_full_optimizer_state,
    max_over_ranks,
    rng_states,
    shard,
    sum_over_ranks,
    world,
)

# A policy's weights as the rollout receives them: (name, full tensor), one parameter at a time.
Weights = Iterator[tuple[str, torch.Tensor]]


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
        # A sharded checkpoint holds no HF weights: the base is loaded, then every rank reads its shards.
        use_base = resume is None or pcfg.lora.enabled or is_sharded(resume.path)
        source = pcfg if use_base else pcfg.model_copy(update={"model_name": str(resume.path)})
        self.model, self.tokenizer = load_policy(source, device, dtype=master)
        self.model.train()
        # Packed rows through a varlen kernel and padded rows without a mask, where the model allows.
        packed_attention.install(self.model)
        self.packing = packs_rows(config, device, packed_attention.varlen_ready(self.model, self.compute_dtype))
        self.aliases: arena.Aliases | None = None  # what the sync sends, when the parameters go as they are
        if self._sends_parameters_as_they_are(config, master):
            # One arena, before anything holds the parameters: a replica packed alike refits in one memcpy.
            arena.pack(self.model)
            self.aliases = arena.Aliases(self.model)
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
        self.compiled = compiles_layers(pcfg, device, bool(decoder_layers(self.model)))
        if self.compiled:  # after the adapters and checkpointing wrap the layers, before FSDP shards them
            compile_decoder_layers(self.model)
        self.reference: torch.nn.Module | None = None
        # With LoRA the reference is the base with its adapters off (_reference_model), no second copy.
        if self.uses_reference and self.peft is None:
            # The reference is the job's starting policy, also when resuming from a later checkpoint.
            self.reference, _ = load_policy(pcfg, device, dtype=master)
            self.reference.eval().requires_grad_(False)
            packed_attention.install(self.reference)
        # On-policy distillation: the teacher of this job's rollouts, frozen like the reference, no optimizer.
        self.teacher = teachers.load_teacher(config, device, master, self.model.config.vocab_size)
        if self.teacher is not None:
            packed_attention.install(self.teacher)
        self.autocast = master != self.compute_dtype
        # A mixture-of-experts policy: recorded routing is compared (and with routing_replay, replayed).
        self.routing = RoutingReplay(self.model) if routers(self.model) else None
        if pcfg.records_routing and self.routing is None:
            field = "policy.routing_replay" if pcfg.routing_replay else "policy.record_routing"
            raise ConfigError(f"{field}: the policy is a dense model (no mixture-of-experts router): turn it off")
        if self.world > 1:
            models = [m for m in (self.model, self.reference, self.teacher) if m is not None]
            shard(models, self.compute_dtype if self.autocast else None)
            self.autocast = False  # FSDP casts the gathered parameters itself
        opt = pcfg.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # all, or the adapters alone
        # One fused kernel for the whole update on one GPU (a foreach chain of kernels otherwise).
        fused = torch.device(device).type == "cuda" and self.world == 1
        self.optimizer = torch.optim.AdamW(
            trainable, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=fused or None
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        ck = config.checkpointing
        self.sharded = ShardedCheckpoints(self.rank, self.world, ck.async_save) if ck.format == "sharded" else None
        self.weight_version = 0
        self.data_state = ""
        self.resumed_from: Path | None = None if resume is None else resume.path
        if resume is not None:
            self._restore(resume.path)

    # -- setup -------------------------------------------------------------------------------

    def _sends_parameters_as_they_are(self, config: MasterConfig, master: torch.dtype) -> bool:
        """Colocated with the replicas, one rank, no adapters to merge, no cast: the sync reads the parameters."""
        colocated = config.cluster.weight_sync_transport == "colocated"
        return colocated and self.world == 1 and not config.policy.lora.enabled and master == self.sync_dtype

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.config, step)

    def num_parameters(self) -> int:
        """Parameters of the policy as the rollout holds it (LoRA adapters not counted: they are merged)."""
        return sum(p.numel() for n, p in self.model.named_parameters() if not lora.is_adapter(n))

    @property
    def uses_reference(self) -> bool:
        """The KL in the loss, or REINFORCE++'s KL in the reward, needs π_ref."""
        return self.config.loss_fn.kl_penalty > 0 or self.config.grpo.adv_estimator.kl_in_reward > 0

    def _reference_model(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """π_ref for the KL term: the frozen copy, or with LoRA the policy's own base with adapters off."""
        return contextlib.nullcontext(self.reference) if self.peft is None else lora.base_only(self.model, self.peft)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # -- weights -----------------------------------------------------------------------------

    def named_weights(self) -> Weights:
        """(name, full tensor) in named_parameters order (tied weights once), in the rollout's dtype.

        With LoRA: the plain model's names and shapes, each adapted weight merged (W + scale·B·A),
        computed here without touching the trained weights. Collective with more than one rank:
        every rank must drain the iterator. One parameter is gathered at a time, so at most one
        tensor (and one adapter pair) beyond the shards exists.
        """
        if self.aliases is not None:  # one rank, no adapters, no cast: the same alias objects every sync
            yield from self.aliases.get()
            return
        params = self.model.named_parameters() if self.peft is None else lora.merged_parameters(self.model, _full)
        for name, tensor in params:
            tensor = _full(tensor)
            yield name, tensor if tensor.dtype == self.sync_dtype else tensor.to(self.sync_dtype)

    # -- training ----------------------------------------------------------------------------

    def train_step(self, groups: Sequence[TrainingGroup]) -> dict[str, float]:
        """One GRPO trainer step on `groups`: one optimizer step per minibatch and epoch; the weight version +1."""
        start = time.perf_counter()
        pcfg = self.config.policy
        step = self._prepare(groups, pcfg.train_global_batch_size)
        tally = dict.fromkeys(TALLY, 0.0)
        t1 = time.perf_counter()
        frozen: list[list[Frozen]] | list[None] = [None]
        kl_in_reward = self.config.grpo.adv_estimator.kl_in_reward > 0
        if len(step.minibatches) * pcfg.num_epochs > 1 or kl_in_reward:
            # The policy that starts the step is π_old of every minibatch: later ones see ρ ≠ 1.
            frozen = self._old_logprobs(step.minibatches, tally)
        if kl_in_reward:  # REINFORCE++: the advantages need π_old and π_ref of the whole step first
            put_kl_in_rewards(step, frozen, self.config.grpo, self.world)
        updates: list[dict[str, float]] = []
        optimizer_seconds = 0.0
        for _ in range(pcfg.num_epochs):
            for mini, old in zip(step.minibatches, frozen, strict=True):
                updates.append(self._gradients(mini, old, tally if old is None else None))
                t_opt = time.perf_counter()
                updates[-1]["grad_norm"] = self._clip_and_step()
                optimizer_seconds += time.perf_counter() - t_opt
        passes = time.perf_counter() - t1 - optimizer_seconds
        metrics = step_metrics(step, updates, tally, self.world, t1 - start, passes)
        metrics["optimizer_seconds"] = optimizer_seconds
        self._routing_metrics(metrics)
        return self._finish(metrics, start)

    def sft_step(self, demonstrations: Sequence[Row]) -> dict[str, float]:
        """One supervised optimizer step on (prompt ids, completion ids) pairs.

        The loss is the mean negative log-likelihood of every completion token of the
        batch (prompt tokens are context only), micro-batched and sharded like GRPO.
        """
        start = time.perf_counter()
        if not isinstance(demonstrations, CheckedRows):  # the servicer's are checked already
            validate_rows(demonstrations, self.vocab_size, self.max_positions)
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
                logprobs, _ = self._logprobs(self.model, mb, entropy=False, temperature=0.0)
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
        t_opt = time.perf_counter()
        metrics["grad_norm"] = self._clip_and_step()
        metrics["optimizer_seconds"] = time.perf_counter() - t_opt
        return self._finish(metrics, start)

    def _clip_and_step(self) -> float:
        """Clip the gradients by global norm and take one optimizer step; the norm before clipping."""
        max_norm = self.config.policy.optimizer.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        return float(grad_norm)

    def _finish(self, metrics: dict[str, float], start: float) -> dict[str, float]:
        """The end of a trainer step: the scheduler steps and the weight version advances, once each."""
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.weight_version += 1
        seconds = time.perf_counter() - start
        metrics.update(
            train_seconds=seconds,
            tokens_per_second=metrics["sequence_tokens"] / seconds,
            weight_version=float(self.weight_version),
        )
        return metrics

    def accumulate_gradients(self, groups: Sequence[TrainingGroup]) -> dict[str, float]:
        """Zero the gradients, then backpropagate the loss of `groups` as one minibatch; no update."""
        start = time.perf_counter()
        step = self._prepare(groups, None)
        tally = dict.fromkeys(TALLY, 0.0)
        t1 = time.perf_counter()
        update = self._gradients(step.minibatches[0], None, tally)
        metrics = step_metrics(step, [update], tally, self.world, t1 - start, time.perf_counter() - t1)
        self._routing_metrics(metrics)
        return metrics

    def _prepare(self, groups: Sequence[TrainingGroup], minibatch_size: int | None) -> Step:
        """Validate and lay out a step, its advantages (over the whole step) and its minibatches (None: one)."""
        return prepare_step(
            groups,
            self.config,
            self.tokenizer.pad_token_id,
            self.vocab_size,
            self.max_positions,
            minibatch_size,
            self._plan,
            self.world,
        )

    @torch.no_grad()
    def _old_logprobs(self, minibatches: list[Minibatch], tally: dict[str, float]) -> list[list[Frozen]]:
        """Per minibatch and micro-batch: (π_old, π_ref) logprobs of the policy as it starts the step."""
        frozen: list[list[Frozen]] = []
        for mini in minibatches:
            frozen.append([])
            for i in range(mini.count):
                if i >= len(mini.micro):
                    self._idle_pass(grad=False)
                    continue
                mb = mini.micro[i].to(self.device)
                with self._autocast(), self._routed(mb):
                    old, entropy = self._logprobs(self.model, mb, entropy=True)
                    reference = self._reference_logprobs(mb)
                count(tally, mb, old, entropy)
                frozen[-1].append((old, reference))
        return frozen

    def _gradients(self, mini: Minibatch, frozen: list[Frozen] | None, tally: dict | None) -> dict[str, float]:
        """Zero the gradients, backpropagate one minibatch's loss; its loss statistics (summed over ranks).

        `frozen`: (π_old, π_ref) per micro-batch from `_old_logprobs`; None: the current policy is
        π_old (ρ = 1 with the gradient of ρ), and `tally` collects the step's statistics.
        """
        loss_cfg = self.config.loss_fn
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", *LOSS_STATS, *(("teacher_kl",) if self.teacher is not None else ())), 0.0)
        scale = float(self.world)  # FSDP averages gradients over ranks; the step's loss is their sum.
        low, high = float("inf"), float("-inf")  # the ratio's extremes over the minibatch
        for i in range(mini.count):
            if i >= len(mini.micro):
                self._idle_pass(reference=frozen is None, teacher=True)
                continue
            share = loss_share(loss_cfg, mini.micro[i], mini)
            mb = mini.micro[i].to(self.device)
            # Held until this micro-batch's backward ran: forwards recomputed there (activation
            # checkpointing) see the same routing.
            with self._routed(mb):
                with self._autocast():
                    logprobs, entropy = self._logprobs(self.model, mb, entropy=tally is not None)
                    if frozen is None:
                        old, reference = logprobs.detach(), self._reference_logprobs(mb)
                    else:
                        old, reference = frozen[i]
                mask = mb.token_mask
                advantages = mb.advantages
                if self.teacher is not None:
                    # The student's logprobs are π_old's (the previous logprobs), as the IS weight compares them.
                    with torch.no_grad(), self._autocast():
                        teacher = self._logprobs(self.teacher, mb, entropy=False)[0]
                    advantages = opd_advantages(teacher, old, mask)
                    # k1 estimate of KL(π_student ‖ π_teacher) on the student's own tokens: what OPD drives down.
                    sums["teacher_kl"] += float(torch.where(mask.bool(), old - teacher, 0.0).sum()) / mini.tokens
                loss, stats = clipped_pg_loss(
                    logprobs,
                    old,
                    advantages,
                    mask,
                    generation_logprobs=mb.generation_logprobs,
                    reference_logprobs=reference,
                    **loss_options(loss_cfg),
                )
                # Weight each micro-batch by its share, so the sum is the minibatch's reduction.
                (loss * (share * scale)).backward()
            sums["loss"] += float(loss.detach()) * share
            for key in LOSS_STATS:
                sums[key] += stats[key] * share
            if stats["num_tokens"] > 0:
                low, high = min(low, stats["ratio_min"]), max(high, stats["ratio_max"])
            if tally is not None:
                count(tally, mb, old, entropy)
        totals = dict(zip(sums, sum_over_ranks(list(sums.values()), self.world), strict=True))
        low, high = extremes_over_ranks(low, high, self.world)
        # No valid token anywhere (every row masked): the extremes are 0, as in clipped_pg_loss.
        return totals | {"ratio_min": low if low <= high else 0.0, "ratio_max": high if low <= high else 0.0}

    def _routed(self, mb: MicroBatch) -> contextlib.AbstractContextManager[None]:
        """The micro-batch's recorded routing, on the policy's routers (replayed with policy.routing_replay)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.applied(mb.routing, replay=self.config.policy.routing_replay)

    def _routing_metrics(self, metrics: dict[str, float]) -> None:
        """`routing_mismatch_fraction` of the step's forwards (summed over ranks), where routing was recorded."""
        if self.routing is None:
            return
        mismatched, decisions = sum_over_ranks([float(n) for n in self.routing.take_counts()], self.world)
        if decisions:
            metrics["routing_mismatch_fraction"] = mismatched / decisions

    def _logprobs(self, model: torch.nn.Module, mb: MicroBatch, entropy: bool, temperature: float | None = None):
        """Logprobs (and entropy) of `mb` under `model` at `temperature` (default: the sampling one)."""
        if temperature is None:
            temperature = self.config.policy.generation.temperature
        mask, segments = mb.attention_mask, None
        if packed_attention.installed(model):
            # Packed rows by their segments; padded rows are right-padded (batch.py), so causal needs no mask.
            mask, segments = None, mb.segments
        return sampled_logprobs(
            model,
            mb.input_ids,
            mask,
            mb.position_ids,
            temperature,
            entropy,
            scored=mb.token_mask,
            segments=segments,
        )

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        """π_ref's logprobs: the frozen reference copy, or with LoRA the policy's base with adapters off."""
        if not self.uses_reference:
            return None
        with torch.no_grad(), self._reference_model() as model:
            return self._logprobs(model, mb, entropy=False)[0]

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype)

    def _idle_pass(self, reference: bool = True, grad: bool = True, teacher: bool = False) -> None:
        """A zero-weight forward (and backward), so this rank joins the FSDP collectives of the others.

        `reference`: whether the other ranks' passes also run the reference model (`teacher`: the
        teacher model); `grad`: whether they run a backward.
        """
        ids = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        with self._autocast(), torch.set_grad_enabled(grad):
            out = self.model(input_ids=ids, use_cache=False).logits
            if reference and self.uses_reference:
                with torch.no_grad(), self._reference_model() as model:
                    model(input_ids=ids, use_cache=False)
            if teacher and self.teacher is not None:
                with torch.no_grad():
                    self.teacher(input_ids=ids, use_cache=False)
        if grad:
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
            packing=self.packing,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder: Path, metrics: dict[str, float] | None = None, data_state: str = "") -> Path:
        """Write a checkpoint atomically (collective: call on every rank; rank 0 writes)."""
        if data_state:
            self.data_state = data_state
        meta = {"step": self.weight_version, "weight_version": self.weight_version, "metrics": metrics or {}}
        if self.sharded is not None:
            return self._save_sharded(folder, meta)
        model_state, optim_state, rngs = full_state(self.model, self.optimizer, self.world)
        if self.rank == 0:

            def write(tmp: Path) -> None:
                if self.peft is None:
                    self.model.save_pretrained(tmp, state_dict=model_state)
                else:  # the merged model under its plain names, and the adapter in peft's format
                    lora.save(self.model, self.peft, tmp, model_state)
                self.tokenizer.save_pretrained(tmp)
                torch.save({"optimizer": optim_state, **self._loop_state(rngs)}, tmp / checkpoint.STATE_FILE)

            checkpoint.write_atomically(folder, write, meta)
        if self.world > 1:
            dist.barrier()
        return folder

    def _loop_state(self, rngs: list) -> dict:
        """What a resume needs besides weights and optimizer: schedule, RNG, versions, data position."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "rng": rngs,
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "weight_version": self.weight_version,
            "data_state": self.data_state,
            "world_size": self.world,
        }

    def _save_sharded(self, folder: Path, meta: dict) -> Path:
        rngs = rng_states(self.world)

        def write_rest(tmp: Path) -> None:  # rank 0: what `dockyard export hf` and a resume read besides shards
            self.model.config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            torch.save(self._loop_state(rngs), tmp / checkpoint.STATE_FILE)

        return self.sharded.save(folder, self.model, self.optimizer, write_rest, meta)

    def close(self) -> None:
        """Finish a checkpoint still being written (sharded, asynchronous)."""
        if self.sharded is not None:
            self.sharded.close()

    def _restore(self, folder: Path) -> None:
        state = torch.load(folder / checkpoint.STATE_FILE, map_location="cpu", weights_only=False)
        if is_sharded(folder):
            (self.sharded or ShardedCheckpoints(self.rank, self.world, False)).load(folder, self.model, self.optimizer)
        else:
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weight_version = int(state["weight_version"])
        self.data_state = state.get("data_state", "")
        rng = state["rng"]
        # Same world size: each rank continues its own stream; otherwise rank 0's.
        torch.set_rng_state(rng[self.rank] if len(rng) == self.world else rng[0])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])


def lr_factor(config: MasterConfig, step: int) -> float:
    """lr multiplier before optimizer step `step + 1`: linear warmup, then constant or cosine."""
    opt = config.policy.optimizer
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return 1.0
    horizon = opt.decay_steps or max(1, config.max_num_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / horizon)
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (gathered when sharded: a collective), detached."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
