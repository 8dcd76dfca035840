"""The `policy` section: which model, its optimizer, its LoRA adapters and its warm start.

Guarantees: a policy names its weights (`model_name`) or an architecture (`model`, with a
model_type); what the JAX backend cannot do is refused here, at parse.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from dockyard.config.sampling import GenerationConfig
from dockyard.config.section import MAX_BATCH, MAX_SEED, MAX_STEPS, MAX_TOKENS, Section


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0.0, allow_inf_nan=False, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warmup over this many steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after the warmup.")
    decay_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="Cosine: steps from the end of warmup to min_lr_ratio; "
        "null = the job's max_num_steps (grpo or sft) − warmup_steps.",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine: final lr as a fraction of lr.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip gradients by global norm; null = off.")


class BootstrapConfig(Section):
    recipe: Literal["tiny_expr", "tiny_agent"] = Field(
        description="Builder that writes policy.model_name when missing."
    )
    steps: int = Field(300, ge=1, le=MAX_STEPS, description="Supervised warm-start steps.")
    lr: float = Field(3e-3, gt=0.0, description="Warm-start learning rate.")
    batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="Warm-start batch size.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Warm-start seed.")
    num_threads: int | None = Field(
        None, ge=1, le=1024, description="torch threads of the warm start; null keeps torch's default."
    )
    shortcut_rate: float = Field(
        0.6, ge=0.0, le=1.0, description="Share of demonstrations the line-through-two-points demonstrator answers."
    )


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    enabled: bool = Field(
        False, description="Train low-rank adapters (peft LoRA) on a frozen base instead of every weight."
    )
    rank: int = Field(8, ge=1, le=4096, description="Rank r of each adapter pair A [r, in], B [out, r].")
    alpha: float = Field(
        16.0, gt=0.0, le=1e6, allow_inf_nan=False, description="Scale of the update: W + (alpha / rank) · B·A."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on each adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        max_length=256,
        description="Names (last component) of the linear layers that get adapters; the default fits Llama/Qwen2.",
    )

    @model_validator(mode="after")
    def _names(self) -> LoraConfig:
        for name in self.target_modules:
            if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", name):
                raise ValueError(f"policy.lora.target_modules: {name!r} is not a module name")
        return self


class PolicyConfig(Section):
    backend: Literal["torch", "jax"] = Field(
        "torch", description="Trainer backend: torch (HF + FSDP2) or jax (Flax NNX, one device; the `jax` extra)."
    )
    model_name: str | None = Field(None, description="Local Hugging Face folder of the policy.")
    model: dict[str, Any] | None = Field(
        None,
        description="Architecture to build with random weights when model_name is null: model_type + config kwargs.",
    )
    bootstrap: BootstrapConfig | None = Field(None, description="Writes model_name before the job when it is missing.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of forward/backward, and the dtype the rollout holds."
    )
    master_weights_fp32: bool = Field(
        True, description="With dtype bfloat16, the trainer keeps fp32 parameters and optimizer state."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer: fused kernels, less activation memory; compiles at the "
        "first step.",
    )
    train_global_batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="Trajectories per optimizer step.")
    num_epochs: int = Field(1, ge=1, le=100, description="Passes over a step's minibatches, one optimizer step each.")
    train_micro_batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="Most trajectories per forward/backward.")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Token budget of a micro-batch (padded rows × length); null = rows only."
    )
    sequence_packing: bool = Field(
        False, description="Concatenate several sequences into one row (no padding) up to the token budget."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of random initialisation and of the trainer's RNG.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _one_source(self) -> PolicyConfig:
        if self.model_name is None and self.model is None:
            raise ValueError("set policy.model_name (a local model folder) or policy.model (an architecture)")
        if self.model is not None and "model_type" not in self.model:
            raise ValueError("policy.model needs a model_type, e.g. qwen2 or llama")
        if self.sequence_packing and self.max_tokens_per_micro_batch is None:
            raise ValueError("policy.sequence_packing needs policy.max_tokens_per_micro_batch (the packed row length)")
        if self.backend == "jax":
            unsupported = {
                "lora.enabled": self.lora.enabled,
                "activation_checkpointing": self.activation_checkpointing,
                "compile_layers": self.compile_layers,
            }
            for key, on in unsupported.items():
                if on:
                    raise ValueError(f"policy.{key} is not supported with policy.backend=jax: use backend torch")
        return self
