"""One job's policy trained in JAX (Flax NNX, `policy.backend: jax`), behind PolicyTrainer's interface.

    [TrainingGroup] ─prepare_step (shared with torch: validation, batch, advantages, minibatches,
        micro-batches)─> each micro-batch to device arrays, padded to a shape bucket
        ─> jit(value_and_grad): jax_model.token_logprobs ─> jax_loss.clipped_pg_loss × share
        ─> gradients summed over the minibatch ─> clip by global norm (torch's formula) ─> optax AdamW
        ─> lr schedule (policy.lr_factor), weight_version += 1 once per trainer step
    named_weights(): nnx.State ─hf_names─> (HF name, torch tensor through DLPack) ─> the weight sync
    save(): HF folder (config.json, model.safetensors under HF names) + trainer_state.pt (optax state)

Guarantees:
- The interface of PolicyTrainer (train_step, sft_step, named_weights, save, weight_version,
  data_state, resumed_from, num_parameters, vocab_size, max_positions, tokenizer, config): the
  servicer, ranks and the weight push cannot tell the backends apart, nor can the rollout the
  weights (same names, shapes, dtype and order; the checksum holds).
- The same step as the torch backend: minibatches and epochs, π_old/π_ref frozen at the start of
  the step when there is more than one update, the loss weighted by each micro-batch's share of
  the minibatch, AdamW (decoupled weight decay) and the schedule; in float32 one step agrees with
  torch's (loss, grad norm, weights) to 1e-5 (tests/unit/trainer/test_jax_policy.py).
- One device, one process: with torch.distributed initialised on more than one rank, or
  policy.lora / activation_checkpointing / compile_layers, it refuses to load (ConfigError), nothing half-made.
- Shapes are padded to buckets (`_bucket`: rows and length rounded up by at most 1/8, the length to
  a multiple of 32) with masked rows and keys, so a run compiles a handful of programs; padding
  changes no result.
- A checkpoint resumes only on this backend (the optimizer state is optax's); a torch
  checkpoint's HF folder still loads as weights.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.distributed as dist
from flax import nnx

from dockyard.config import ConfigError, LossConfig, MasterConfig, OptimizerConfig
from dockyard.experience.trainable import CheckedRows, validate_rows
from dockyard.models.load import load_tokenizer
from services.trainer import checkpoint, jax_model
from services.trainer.batch import Batch, build_row_batch
from services.trainer.experience import Row, TrainingGroup
from services.trainer.jax_loss import clipped_pg_loss
from services.trainer.micro_batches import MicroBatch, plan
from services.trainer.minibatches import LOSS_STATS, TALLY, Minibatch, count, loss_share, prepare_step, step_metrics
from services.trainer.policy import Weights, lr_factor

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def jax_device(device: str):
    """The JAX device of the trainer's `device` setting ("cpu", "cuda", "cuda:N")."""
    kind, _, index = device.partition(":")
    platform = "cpu" if kind == "cpu" else "gpu"
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, IndexError) as exc:
        raise ConfigError(f"policy.backend=jax: JAX has no {device!r} device here ({exc})") from None


class JaxPolicyTrainer:
    def __init__(self, config: MasterConfig, device: str = "cpu", checkpoint_dir: Path | None = None) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"policy.backend=jax trains on one device; this trainer runs {dist.get_world_size()} ranks "
                "(torchrun): start it as one process, or use policy.backend=torch for FSDP across ranks"
            )
        self.config, self.device, self.checkpoint_dir = config, device, checkpoint_dir
        self.rank, self.world = 0, 1
        pcfg = config.policy
        # XLA compiles the whole step (policy.compile_layers is torch's); `auto` packing stays off here,
        # where packed rows were never measured to pay.
        self.compiled, self.packing = False, pcfg.sequence_packing is True
        self.jax_device = jax_device(device)
        resume = checkpoint.latest(checkpoint_dir) if config.checkpointing.resume and checkpoint_dir else None
        self.compute_dtype = DTYPES[pcfg.dtype]
        self.master_dtype = jnp.float32 if pcfg.master_weights_fp32 else self.compute_dtype
        self.tokenizer = load_tokenizer(pcfg)
        source = pcfg if resume is None else pcfg.model_copy(update={"model_name": str(resume.path)})
        self.hf_config, self.graphdef, self.params = self._load(source)
        # The reference is the job's starting policy, also when resuming from a later checkpoint.
        self.reference = self._load(pcfg)[2] if self.uses_reference else None
        self._compile()
        # Every leaf a float32/int32 array committed to the device, as each step leaves it: one step program.
        state = self.tx.init(self.params)
        state.hyperparams["learning_rate"] = jnp.float32(pcfg.optimizer.lr)
        self.opt_state = jax.device_put(state, self.jax_device)
        self.lr_steps = 0  # scheduler steps taken (torch's LambdaLR last_epoch)
        self.weight_version, self.data_state = 0, ""
        self.resumed_from: Path | None = None if resume is None else resume.path
        if resume is not None:
            self._restore(resume.path)

    def _load(self, policy):
        """(HF config, graphdef, params) of a policy source: a local HF folder, or a built architecture."""
        if policy.model_name is not None:
            from transformers import AutoConfig

            folder = Path(policy.model_name)
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"policy.model_name={policy.model_name!r} is not a local model folder")
            hf_config, arrays = AutoConfig.from_pretrained(folder), None
        else:  # the same random initialisation as the torch backend, built once by torch
            from dockyard.models.load import load_policy

            model, _ = load_policy(policy, "cpu", dtype=torch.float32)
            hf_config, arrays = model.config, {n: t.detach().numpy() for n, t in model.state_dict().items()}
        try:
            jax_model.check_config(hf_config)
            if arrays is None:
                arrays = jax_model.load_arrays(Path(policy.model_name))
            decoder = jax_model.build(hf_config, arrays, self.master_dtype, self.jax_device)
        except jax_model.UnsupportedModel as exc:
            raise ConfigError(str(exc)) from None
        graphdef, params = nnx.split(decoder, nnx.Param)
        return hf_config, graphdef, params

    # -- the interface the servicer and ranks use ---------------------------------------------

    @property
    def uses_reference(self) -> bool:
        return self.config.loss_fn.kl_penalty > 0

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_positions(self) -> int | None:
        return getattr(self.hf_config, "max_position_embeddings", None)

    def num_parameters(self) -> int:
        return sum(int(np.prod(a.shape)) for _, a in jax_model.hf_names(self.params))

    def named_weights(self) -> Weights:
        """(HF name, torch tensor) in HF's named_parameters order, tied weights once, in the rollout's
        dtype: zero-copy through DLPack where the dtype already matches (device memory on GPU)."""
        dtype = self.compute_dtype
        for name, array in jax_model.hf_names(self.params):
            out = array if array.dtype == dtype else array.astype(dtype)
            # Done computing before torch (on its own stream) reads the buffer.
            yield name, torch.from_dlpack(out.block_until_ready())

    def _compile(self) -> None:
        pcfg = self.config.policy
        programs = _programs(
            self.graphdef, self.config.loss_fn.model_dump_json(), pcfg.generation.temperature,
            self.compute_dtype, pcfg.optimizer.model_dump_json(), self.jax_device.platform,
        )  # fmt: skip
        self.tx = programs.tx
        self._logprobs, self._pg_grad, self._nll_grad, self._step = programs.jitted

    # -- training -------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[TrainingGroup]) -> dict[str, float]:
        """One GRPO trainer step: one optimizer step per minibatch and epoch; the weight version +1."""
        start = time.perf_counter()
        pcfg = self.config.policy
        step = prepare_step(
            groups, self.config, self.tokenizer.pad_token_id, self.vocab_size, self.max_positions,
            pcfg.train_global_batch_size, self._plan, self.world,
        )  # fmt: skip
        tally = dict.fromkeys(TALLY, 0.0)
        t1 = time.perf_counter()
        frozen: list = [None] * len(step.minibatches)
        if len(step.minibatches) * pcfg.num_epochs > 1:
            # The policy that starts the step is π_old of every minibatch: later ones see ρ ≠ 1.
            frozen = [[self._frozen(mb, tally) for mb in mini.micro] for mini in step.minibatches]
        updates, optimizer_seconds = [], 0.0
        for _ in range(pcfg.num_epochs):
            for mini, old in zip(step.minibatches, frozen, strict=True):
                grads, update = self._gradients(mini, old, tally if old is None else None)
                t_opt = time.perf_counter()
                update["grad_norm"] = self._apply(grads)
                optimizer_seconds += time.perf_counter() - t_opt
                updates.append(update)
        passes = time.perf_counter() - t1 - optimizer_seconds
        metrics = step_metrics(step, updates, tally, self.world, t1 - start, passes)
        metrics["optimizer_seconds"] = optimizer_seconds
        return self._finish(metrics, start)

    def sft_step(self, demonstrations: Sequence[Row]) -> dict[str, float]:
        """One supervised optimizer step: mean NLL of every completion token of the batch."""
        start = time.perf_counter()
        if not isinstance(demonstrations, CheckedRows):  # the servicer's are checked already
            validate_rows(demonstrations, self.vocab_size, self.max_positions)
        batch = build_row_batch(demonstrations, self.tokenizer.pad_token_id)
        total_tokens = float(batch.token_mask.sum())
        micro_batches = self._plan(batch, torch.zeros(len(batch)))
        t1 = time.perf_counter()
        grads, nll_sum = None, 0.0
        for mb in micro_batches:
            (_, total), g = self._nll_grad(self.params, self._arrays(mb), 1.0 / total_tokens)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            nll_sum += float(total)
        metrics = {
            "loss": nll_sum / total_tokens,
            "num_trajectories": float(len(batch)),
            "num_tokens": total_tokens,
            "sequence_tokens": float(sum(mb.num_tokens for mb in micro_batches)),
            "num_micro_batches": float(len(micro_batches)),
            "batch_seconds": t1 - start,
            "forward_backward_seconds": time.perf_counter() - t1,
        }
        t_opt = time.perf_counter()
        metrics["grad_norm"] = self._apply(grads)
        metrics["optimizer_seconds"] = time.perf_counter() - t_opt
        return self._finish(metrics, start)

    def _frozen(self, mb: MicroBatch, tally: dict[str, float]):
        """(π_old, π_ref) of one micro-batch under the policy that starts the step, counted in the tally."""
        b = self._arrays(mb)
        old, entropy = self._logprobs(self.params, b)
        self._count(tally, mb, old, entropy)
        return old, self._reference(b)

    def _reference(self, b):
        return None if self.reference is None else self._logprobs(self.reference, b)[0]

    def _gradients(self, mini: Minibatch, frozen, tally):
        """The summed gradients of one minibatch's loss and its loss statistics."""
        loss_cfg = self.config.loss_fn
        grads, sums = None, dict.fromkeys(("loss", *LOSS_STATS), 0.0)
        low, high = float("inf"), float("-inf")  # the ratio's extremes over the minibatch
        for i, mb in enumerate(mini.micro):
            b = self._arrays(mb)
            old, reference = (None, self._reference(b)) if frozen is None else frozen[i]
            share = loss_share(loss_cfg, mb, mini)
            (_, (loss, stats, old_lp, entropy)), g = self._pg_grad(self.params, b, old, reference, share)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            sums["loss"] += float(loss) * share
            for key in LOSS_STATS:
                sums[key] += float(stats[key]) * share
            if mb.token_mask.any():
                low, high = min(low, float(stats["ratio_min"])), max(high, float(stats["ratio_max"]))
            if tally is not None:
                self._count(tally, mb, old_lp, entropy)
        # No valid token anywhere: the extremes are 0, as in the torch backend.
        return grads, sums | {"ratio_min": low if low <= high else 0.0, "ratio_max": high if low <= high else 0.0}

    def _count(self, tally, mb: MicroBatch, old, entropy) -> None:
        rows, width = mb.token_mask.shape
        count(tally, mb, _torch(old[:rows, :width]), _torch(entropy[:rows, :width]))

    def _apply(self, grads) -> float:
        """Clip by global norm and take one AdamW step at this trainer step's lr; the norm before clipping."""
        lr = self.config.policy.optimizer.lr * lr_factor(self.config, self.lr_steps)
        self.params, self.opt_state, norm = self._step(self.params, self.opt_state, grads, jnp.float32(lr))
        return float(norm)

    def _finish(self, metrics: dict[str, float], start: float) -> dict[str, float]:
        metrics["lr"] = self.config.policy.optimizer.lr * lr_factor(self.config, self.lr_steps)
        self.lr_steps += 1
        self.weight_version += 1
        seconds = time.perf_counter() - start
        metrics.update(
            train_seconds=seconds,
            tokens_per_second=metrics["sequence_tokens"] / seconds,
            weight_version=float(self.weight_version),
        )
        return metrics

    def _plan(self, batch: Batch, advantages: torch.Tensor) -> list[MicroBatch]:
        pcfg = self.config.policy
        return plan(
            batch,
            advantages,
            rank=0,
            world=1,
            max_rows=pcfg.train_micro_batch_size,
            max_tokens=pcfg.max_tokens_per_micro_batch,
            packing=self.packing,
        )

    def _arrays(self, mb: MicroBatch) -> dict:
        """A micro-batch on the JAX device, padded to its shape bucket (masked rows and positions)."""
        rows, length = mb.input_ids.shape
        b_rows, b_len = _bucket(rows, 1), _bucket(length, 32)

        def pad(t: torch.Tensor, width: int, value=0):
            out = np.full((b_rows, width), value, dtype=t.numpy().dtype)
            out[: t.shape[0], : t.shape[1]] = t.numpy()
            return jax.device_put(out, self.jax_device)

        out = {
            "ids": pad(mb.input_ids, b_len, self.tokenizer.pad_token_id),
            "am": None if mb.attention_mask is None else pad(mb.attention_mask, b_len),
            # Packed rows: the padding starts a sequence of its own (position 0), seen by no real token.
            "pos": None if mb.position_ids is None else pad(mb.position_ids, b_len),
            "mask": pad(mb.token_mask, b_len - 1),
            "gen": pad(mb.generation_logprobs, b_len - 1),
            "adv": pad(mb.advantages, b_len - 1),
        }
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, folder: Path, metrics: dict[str, float] | None = None, data_state: str = "") -> Path:
        """Write a checkpoint atomically: the HF folder under HF names, and the optax state beside it."""
        if data_state:
            self.data_state = data_state

        def write(tmp: Path) -> None:
            jax_model.save_folder(tmp, self.hf_config, self.params)
            self.tokenizer.save_pretrained(tmp)
            leaves = [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(self.opt_state)]
            state = {
                "optimizer": {"backend": "jax", "leaves": leaves},
                "scheduler": {"last_epoch": self.lr_steps},
                "weight_version": self.weight_version,
                "data_state": self.data_state,
                "world_size": 1,
            }
            torch.save(state, tmp / checkpoint.STATE_FILE)

        meta = {"step": self.weight_version, "weight_version": self.weight_version, "metrics": metrics or {}}
        checkpoint.write_atomically(folder, write, meta)
        return folder

    def close(self) -> None:
        """Nothing is written in the background on the JAX path (checkpoints are HF folders, written at once)."""

    def _restore(self, folder: Path) -> None:
        state = torch.load(folder / checkpoint.STATE_FILE, map_location="cpu", weights_only=False)
        optimizer = state["optimizer"]
        if not isinstance(optimizer, dict) or optimizer.get("backend") != "jax":
            raise ConfigError(
                f"{folder / checkpoint.STATE_FILE}: written by the torch backend; resume it with "
                "policy.backend=torch (or start a new job from its HF folder with policy.model_name)"
            )
        treedef = jax.tree.structure(self.opt_state)
        leaves = [jax.device_put(x, self.jax_device) for x in optimizer["leaves"]]
        self.opt_state = jax.tree.unflatten(treedef, leaves)
        self.lr_steps = int(state["scheduler"]["last_epoch"])
        self.weight_version = int(state["weight_version"])
        self.data_state = state.get("data_state", "")


def _bucket(n: int, least: int) -> int:
    """n rounded up to a multiple of max(least, its top power of two / 8): at most 1/8 of padding and a
    logarithmic number of shapes, hence of compiled programs."""
    step = max(least, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class _Programs(NamedTuple):
    tx: optax.GradientTransformation
    jitted: tuple


@functools.lru_cache(maxsize=8)
def _programs(graphdef, loss_json: str, temperature: float, dtype, optimizer_json: str, platform: str) -> _Programs:
    """The jitted programs of one architecture and config, shared by every trainer of this process
    (a second job, or a resumed one, reuses the compiled programs)."""
    loss_cfg, opt = LossConfig.model_validate_json(loss_json), OptimizerConfig.model_validate_json(optimizer_json)
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=opt.lr, b1=opt.betas[0], b2=opt.betas[1], eps=opt.eps, weight_decay=opt.weight_decay
    )

    def logprobs(params, b):
        model = nnx.merge(graphdef, params)
        return jax_model.token_logprobs(model, b["ids"], b["am"], b["pos"], temperature, dtype)

    def pg(params, b, old, reference, share):
        lp, entropy = logprobs(params, b)
        old_lp = jax.lax.stop_gradient(lp) if old is None else old
        loss, stats = clipped_pg_loss(lp, old_lp, b["adv"], b["mask"], b["gen"], reference, loss_cfg)
        return loss * share, (loss, stats, old_lp, entropy)

    def nll(params, b, scale):
        lp, _ = jax_model.token_logprobs(nnx.merge(graphdef, params), b["ids"], b["am"], b["pos"], 0.0, dtype)
        total = -jnp.where(b["mask"] > 0, lp, 0.0).sum()
        return total * scale, total

    def step(params, opt_state, grads, lr):
        norm = optax.tree.norm(grads)
        if opt.max_grad_norm is not None:  # torch's clip_grad_norm_: scale by min(1, max / (norm + 1e-6))
            coef = jnp.minimum(opt.max_grad_norm / (norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    # The old parameters and optimizer state are dead after a step: their buffers are reused (not on CPU).
    donate = (0, 1) if platform != "cpu" else ()
    jitted = (
        jax.jit(logprobs),
        jax.jit(jax.value_and_grad(pg, has_aux=True)),
        jax.jit(jax.value_and_grad(nll, has_aux=True)),
        jax.jit(step, donate_argnums=donate),
    )
    return _Programs(tx, jitted)


def _torch(array) -> torch.Tensor:
    return torch.from_numpy(np.array(jax.device_get(array)))
