"""The `policy` section: which model, its optimizer, its LoRA adapters and its warm start.

Guarantees: a policy names its weights (`model_name`) or an architecture (`model`, with a
model_type); what the JAX backend cannot do is refused here, at parse.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dockyard.config.data import FunctionFamily
from dockyard.config.sampling import GenerationConfig
from dockyard.config.section import MAX_BATCH, MAX_SEED, MAX_STEPS, MAX_TOKENS, Section


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0.0, allow_inf_nan=False, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description=(
            "Linear warmup over this many steps (step s uses lr × s / warmup_steps), then `schedule`; 0 = no warmup."
        ),
    )
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description=(
            "After the warmup: `constant`, or `cosine` decay from lr to `min_lr_ratio × lr` over `decay_steps`."
        ),
    )
    decay_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description=(
            "Cosine: steps from the end of the warmup to the floor; null = `grpo.max_num_steps` "
            "(`sft.max_num_steps` in an SFT job) − `warmup_steps`."
        ),
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Cosine: the final lr as a fraction of `lr`, in [0, 1]."
    )
    max_grad_norm: float | None = Field(
        1.0,
        gt=0.0,
        description="Clip gradients by global norm; null = off (the norm is still reported as `grad_norm`).",
    )


class BootstrapConfig(Section):
    recipe: Literal["tiny_expr", "tiny_agent"] = Field(
        description=(
            "Builder that writes `policy.model_name`: `tiny_expr` (single-turn expressions) or "
            "`tiny_agent` (the multi-turn agent task: trials that call `f` and `submit`)."
        )
    )
    steps: int = Field(300, ge=1, le=MAX_STEPS, description="Supervised warm-start steps.")
    lr: float = Field(3e-3, gt=0.0, description="Warm-start learning rate.")
    batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="Warm-start batch size.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Warm-start seed.")
    num_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "torch threads of the warm start run by the CLI; null keeps torch's default. The services "
            "take theirs from `DOCKYARD_<SERVICE>_NUM_THREADS`."
        ),
    )
    shortcut_rate: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description=(
            "Share of warm-start demonstrations that take a shortcut instead of the reference: "
            "`tiny_expr` answers the line through f(0) and f(1), `tiny_agent` reads `shortcut_reads` and "
            "answers the line through them. An imperfect demonstrator that GRPO must learn to beat."
        ),
    )
    reads: list[Annotated[int, Field(ge=-1000, le=1000)]] = Field(
        default_factory=lambda: [0, 1, 2],
        max_length=8,
        description=(
            "`tiny_agent` only: the points the demonstrator reads f at before it answers the reference "
            "(the task's expression)."
        ),
    )
    shortcut_reads: list[Annotated[int, Field(ge=-1000, le=1000)]] = Field(
        default_factory=lambda: [0, 1],
        max_length=8,
        description=(
            "`tiny_agent` only: the points a shortcut demonstration reads before it answers the line "
            "through them (slope 1 where one point leaves the slope open; `x` when it reads none)."
        ),
    )
    answer: Literal["reference", "values"] = Field(
        "reference",
        description=(
            "How the demonstrator spells its answers: `reference` (the task's expression; a shortcut's "
            "line computed, `2*x+1`) or `values` (spelled with the values of f(0)=y0 and f(1)=y1: "
            "`y0+y1*x-y0*x`, `y0+y1*x*x-y0*x*x` for a quadratic task's full answer; copied, no arithmetic, "
            "and exact on the task's family). `tiny_agent`: the full answer needs `reads` to hold 0 and 1."
        ),
    )
    families: list[FunctionFamily] = Field(
        default_factory=list,
        max_length=4,
        description=(
            "The function families the demonstrations are drawn from; empty: the job's "
            "`data.train.families`. For a job whose tasks dockyard does not draw (env `verifiers`): the "
            "families of the environment's tasks."
        ),
    )
    chat: bool = Field(
        False,
        description=(
            "`tiny_expr` only: each demonstration's prompt rendered as one user turn of the chat template "
            "(`user: <prompt>`, then the generation prompt), as the policy endpoint renders a single-turn "
            "chat trial (env verifiers); `false`: the prompt as it is, as the rollout service completes it."
        ),
    )
    scaffold: Literal["built_in", "mini_swe_agent"] = Field(
        "built_in",
        description=(
            "Whose action format the `tiny_agent` warm start demonstrates: `built_in` (the built-in "
            "scaffold's tool `f` and its answer) or `mini_swe_agent` (mini-swe-agent 2.4.6's bash calls, "
            "the answer written to answer.txt, its submit command), token for token as the endpoint "
            "records that scaffold's sessions."
        ),
    )


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    enabled: bool = Field(
        False,
        description=(
            "Train LoRA adapters on a frozen base instead of every weight. The KL reference is then "
            "the base with its adapters off (no second copy)."
        ),
    )
    rank: int = Field(8, ge=1, le=4096, description="Rank r of each adapter: A is [r, in], B is [out, r]; 1..4096.")
    alpha: float = Field(
        16.0,
        gt=0.0,
        le=1e6,
        allow_inf_nan=False,
        description="Scale of the update: a layer computes W·x + (alpha / rank)·B·A·x.",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on each adapter's input, in [0, 1).")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        max_length=256,
        description=(
            "Names (the last component, e.g. `q_proj`) of the `nn.Linear` layers that get adapters; "
            "the default covers attention and MLP of Llama and Qwen2. A name that matches no layer, a "
            "layer that is not `nn.Linear` (e.g. `embed_tokens`) or one whose weight is tied to "
            "another (`lm_head` with tied embeddings) fails `LoadPolicy` with INVALID_ARGUMENT. A "
            "mixture-of-experts policy takes adapters on attention only (`[q_proj, k_proj, v_proj, "
            "o_proj]`): its experts are fused 3-D weights, and any other name is refused."
        ),
    )

    @model_validator(mode="after")
    def _names(self) -> LoraConfig:
        for name in self.target_modules:
            if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", name):
                raise ValueError(f"policy.lora.target_modules: {name!r} is not a module name")
        return self


class PolicyConfig(Section):
    backend: Literal["torch", "jax"] = Field(
        "torch",
        description=(
            "Trainer backend: `torch` (HF model, FSDP2 across ranks) or `jax` (the Flax NNX decoder "
            "of `services/trainer/jax_model.py`, Llama and Qwen2, on one device; needs the `jax` "
            "extra). Same loss, optimizer, checkpoints, metrics and weight sync; `jax` refuses "
            "`lora.enabled`, `activation_checkpointing`, `compile_layers` (at parse) and more than "
            "one torchrun rank (at `LoadPolicy`). See docs/trainer.md."
        ),
    )
    model_name: str | None = Field(
        None,
        description=(
            "Local Hugging Face folder of the policy (must contain `config.json`); loaded with "
            "`from_pretrained` on trainer and rollout, never downloaded. A missing folder fails "
            "`LoadPolicy` with FAILED_PRECONDITION."
        ),
    )
    model: dict[str, Any] | None = Field(
        None,
        description=(
            "Architecture to build with random weights and the built-in character tokenizer when "
            "`model_name` is null: `model_type` plus config kwargs; `vocab_size` defaults to the "
            "tokenizer's and may be set larger (a real-shaped model for benchmarks). With "
            "`bootstrap`, the architecture the warm start builds. Mixture-of-experts: `qwen3_moe` and "
            "`mixtral` (other MoE families and `router_jitter_noise` > 0 are refused; "
            "[trainer.md](trainer.md#mixture-of-experts-policies))."
        ),
    )
    bootstrap: BootstrapConfig | None = Field(None, description="Writes model_name before the job when it is missing.")
    reasoning: Literal["auto", "think", "none"] = Field(
        "auto",
        description=(
            "Whether the model writes a `<think>...</think>` block before its answer (Qwen3, DeepSeek R1): "
            "`auto` when its chat template handles `<think>` or `reasoning_content`, `think` or `none` to "
            "say so. The policy endpoint returns the block as each API's reasoning field and matches "
            "histories sent back with or without it. [endpoint-api.md](endpoint-api.md#reasoning)"
        ),
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "Compute dtype: `float32` or `bfloat16`. The rollout holds its weights in it and the "
            "weight sync sends them in it."
        ),
    )
    master_weights_fp32: bool = Field(
        True,
        description=(
            "With `dtype: bfloat16`, the trainer keeps fp32 parameters and optimizer state and runs "
            "forward/backward in bf16 (autocast on one rank, FSDP2 mixed precision with fp32 gradient "
            "reduction on several); false = bf16 parameters and optimizer state. No effect with "
            "`float32`."
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each decoder layer's activations in backward (non-reentrant checkpointing): "
            "less memory, about one more forward of compute."
        ),
    )
    compile_layers: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "`torch.compile` each decoder layer (fused kernels; cheap intermediates recomputed in "
            "backward): faster steps and less activation memory on GPUs, after a compile during the "
            "first step. `auto`: on when the torch trainer runs on CUDA, the job does not record "
            "expert routing and a C compiler is on the PATH (Triton needs one), off otherwise (on CPU "
            "the compile costs more than it saves). `true` is "
            "refused by `backend: jax` and with routing recorded. See docs/trainer.md."
        ),
    )
    train_global_batch_size: int = Field(
        64,
        ge=1,
        le=MAX_BATCH,
        description=(
            "Trajectories per optimizer step (a minibatch of whole groups): a trainer step's "
            "`num_prompts_per_step × num_generations_per_prompt` rollouts are trained in minibatches "
            "of this size, one optimizer step each, against the logprobs of the policy that started "
            "the step; must divide the step's rollouts and be a multiple of "
            "`num_generations_per_prompt`. Equal to the step's rollouts: one optimizer step per "
            "trainer step (ρ = 1)."
        ),
    )
    num_epochs: int = Field(
        1,
        ge=1,
        le=100,
        description=(
            "Passes over a step's minibatches, one optimizer step per minibatch each, in [1, 100]; "
            "the weight version and the learning-rate schedule still advance once per trainer step."
        ),
    )
    train_micro_batch_size: int = Field(
        16,
        ge=1,
        le=MAX_BATCH,
        description="Most trajectories per forward/backward; the loss of a step does not depend on it.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description=(
            "Token budget of a micro-batch: rows × padded length (longest rows first, each "
            "micro-batch padded to its own longest row); a row longer than the budget runs alone. "
            "null = rows only. Accepts `${mul:...}` expressions. The loss of a step does not depend "
            "on it."
        ),
    )
    sequence_packing: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Concatenate several sequences into one row of at most `max_tokens_per_micro_batch` "
            "tokens (first fit, longest first; position ids restart per sequence and attention stays "
            "within each sequence, through varlen flash attention on CUDA), so no padding is computed. "
            "Needs `max_tokens_per_micro_batch`, `loss_fn.reduction: token`, no `seq-mask-tis` "
            "correction, a token-ratio loss and no KL in the reward. `auto`: on when all of those hold, "
            "the torch trainer runs on CUDA and the model has the varlen kernel "
            "(services/trainer/packed_attention.py), off otherwise; `true` refuses a job that breaks "
            "one. The trainer logs which it chose."
        ),
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description=(
            "Seed of the trainer's torch RNG and of random initialisation (`policy.model`). "
            "Generation seeds come from `grpo.seed`."
        ),
    )
    tool_call_format: Literal[
        "auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "harmony", "transformers", "none"
    ] = Field(
        "auto",
        description=(
            "How the policy endpoint reads tool calls out of the model's text "
            "(dockyard/agents/tool_formats): `auto` (the tokenizer's `response_template` when it has "
            "one, else the format the chat template renders, else `hermes`, which preflight says), "
            "`hermes`, `qwen3_coder`, `llama3_json`, `mistral`, `deepseek_v3`, `harmony`, "
            "`transformers` (the `response_template`) or `none` (text only). A format the chat "
            "template does not render is a preflight error. "
            "[endpoint-api.md](endpoint-api.md#tool-call-formats)"
        ),
    )
    record_routing: bool = Field(
        False,
        description=(
            "Mixture-of-experts policies: the rollout returns the experts every position was routed to with "
            "its tokens, they travel to the trainer, and each step reports `routing_mismatch_fraction` (the "
            "share of (position, MoE layer) top-k choices where the trainer's router picks another expert set). "
            "Needs `generation.backend: torch`, `backend: torch` and `compile_layers: false`; agent jobs "
            "(`env.tools`, a scaffold) record it through the policy endpoint's sessions. "
            "[moe-routing.md](moe-routing.md)"
        ),
    )
    routing_replay: bool = Field(
        False,
        description=(
            "Routing replay (R3) for mixture-of-experts policies: the trainer's forwards (the logprob "
            "recompute and the training pass) use the experts the engine chose for every recorded position; "
            "the chosen experts' weights come from the trainer's own router logits, so the router still "
            "trains. Implies `record_routing`, with its requirements; refused for a dense policy. "
            "[moe-routing.md](moe-routing.md)"
        ),
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def records_routing(self) -> bool:
        """Whether the job's rollouts return routing (record_routing, or routing_replay which needs it)."""
        return self.record_routing or self.routing_replay

    @model_validator(mode="after")
    def _one_source(self) -> PolicyConfig:
        if self.model_name is None and self.model is None:
            raise ValueError("set policy.model_name (a local model folder) or policy.model (an architecture)")
        if self.model is not None and "model_type" not in self.model:
            raise ValueError("policy.model needs a model_type, e.g. qwen2 or llama")
        if self.backend == "jax":
            unsupported = {
                "lora.enabled": self.lora.enabled,
                "activation_checkpointing": self.activation_checkpointing,
                "compile_layers": self.compile_layers is True,
            }
            for key, on in unsupported.items():
                if on:
                    raise ValueError(f"policy.{key} is not supported with policy.backend=jax: use backend torch")
        return self
