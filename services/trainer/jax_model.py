"""The Llama/Qwen2 decoder in Flax NNX, with parameters under the Hugging Face names and shapes.

    HF folder (config.json, *.safetensors) ─load─> Decoder (nnx.Param per HF tensor, HF layout [out, in])
    input ids [B, L], attention mask | position ids ─Decoder─> last hidden state [B, L, H]
        ─token_logprobs─> logits of positions 0..L-2 (fp32) / temperature ─> logprob of the next token,
                          entropy (no grad)
    nnx.State ─hf_names─> ("model.layers.0.self_attn.q_proj.weight", array), … in HF's parameter order

Guarantees:
- The forward is HF's LlamaForCausalLM / Qwen2ForCausalLM: RMSNorm in fp32 with the config's eps,
  rotary embeddings with rope_theta (rope_type "default"), grouped-query attention, the softmax in
  fp32, SwiGLU MLP, q/k/v biases where the config has them (Qwen2), tied embeddings when
  tie_word_embeddings; in float32 it agrees with HF's to float32 rounding (checked in a test).
  In bf16, padded rows go through jax.nn.dot_product_attention (cuDNN's fused kernel on GPU).
- Padded rows are right-padded (positions 0..L-1, keys masked by the attention mask); packed rows
  (no attention mask) attend only within their sequence, which restarts where the position id is 0.
- Every parameter's path joined with "." is its HF name and its array has the HF shape, so weights
  leave and checkpoints are written without any renaming table; tied weights exist once.
- A config this decoder does not implement (another architecture, rope scaling, sliding windows)
  raises UnsupportedModel naming the field, before any weight is read.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The trainer shares its GPU with the rollout engine in embedded runs: allocate on demand (read when
# JAX first touches a device, which is after this import).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModel(ValueError):
    """The policy's architecture is one the JAX decoder does not implement."""


def check_config(config) -> None:
    """Refuse what this decoder would compute differently from HF."""
    if config.model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"policy.backend=jax implements {ARCHITECTURES}, not model_type={config.model_type!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UnsupportedModel(f"policy.backend=jax: rope_type {rope.get('rope_type')!r} is not implemented")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModel("policy.backend=jax: use_sliding_window is not implemented")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"policy.backend=jax: hidden_act {config.hidden_act!r} is not implemented")


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class Linear(nnx.Module):
    """y = x·Wᵀ (+ b) with W in HF's [out, in] layout."""

    def __init__(self, out: int, inp: int, bias: bool) -> None:
        self.weight = nnx.Param(jnp.zeros((out, inp), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out,), jnp.float32)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight[...].astype(x.dtype).T
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float) -> None:
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * h.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, size: int) -> None:
        self.weight = nnx.Param(jnp.zeros((vocab, size), jnp.float32))


class Attention(nnx.Module):
    def __init__(self, config) -> None:
        h, self.heads, self.kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        bias = bool(getattr(config, "attention_bias", config.model_type == "qwen2"))
        self.q_proj = Linear(self.heads * self.head_dim, h, bias)
        self.k_proj = Linear(self.kv_heads * self.head_dim, h, bias)
        self.v_proj = Linear(self.kv_heads * self.head_dim, h, bias)
        self.o_proj = Linear(h, self.heads * self.head_dim, bool(getattr(config, "attention_bias", False)))

    def __call__(self, x, cos, sin, mask, lengths=None):
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if lengths is not None:
            # bf16 padded rows: JAX's fused attention (cuDNN flash attention on GPU where it applies,
            # XLA elsewhere), causal with per-row key lengths; no [L, L] scores kept for backward.
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
            return self.o_proj(out.reshape(b, n, self.heads * self.head_dim))
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (self.head_dim**-0.5)
        # A finite minimum, not -inf: a fully masked (padding) query stays finite, as in HF.
        scores = jnp.where(mask[:, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, config) -> None:
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj, self.up_proj, self.down_proj = Linear(i, h, bias), Linear(i, h, bias), Linear(h, i, bias)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nnx.Module):
    def __init__(self, config) -> None:
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, lengths=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, lengths)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nnx.Module):
    def __init__(self, config) -> None:
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nnx.List([Layer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nnx.Module):
    """The causal LM; `model.*` and `lm_head.*` as in HF (no lm_head when the embeddings are tied)."""

    def __init__(self, config) -> None:
        check_config(config)
        self.model = Body(config)
        self.lm_head = None if config.tie_word_embeddings else Embedding(config.vocab_size, config.hidden_size)
        self.theta = rope_theta(config)
        self.head_dim = self.model.layers[0].self_attn.head_dim

    def head_weight(self) -> jax.Array:
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight[...]

    def hidden(self, input_ids, attention_mask, position_ids, dtype=jnp.float32) -> jax.Array:
        """Last hidden state [B, L, H] in `dtype`; attention_mask None means packed rows."""
        b, n = input_ids.shape
        causal = jnp.tril(jnp.ones((n, n), bool))[None]
        if attention_mask is None:
            segment = jnp.cumsum(position_ids == 0, axis=-1)
            mask = causal & (segment[:, :, None] == segment[:, None, :])
        else:
            position_ids = jnp.broadcast_to(jnp.arange(n), (b, n))
            mask = causal & attention_mask.astype(bool)[:, None, :]
        cos, sin = _rope(position_ids, self.head_dim, self.theta, dtype)
        lengths = None
        if attention_mask is not None and dtype != jnp.float32:
            # At least 1: a padding row attends to its first position and stays finite (no NaN reaches
            # the weight gradients through it).
            lengths = jnp.maximum(attention_mask.sum(-1), 1).astype(jnp.int32)
        x = self.model.embed_tokens.weight[...].astype(dtype)[input_ids]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, lengths)
        return self.model.norm(x)


def _rope(position_ids, dim: int, theta: float, dtype):
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    freqs = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, L, 1, dim]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def token_logprobs(model: Decoder, input_ids, attention_mask, position_ids, temperature: float, dtype=jnp.float32):
    """[B, L-1] logprob of each next token at the sampling temperature, and the entropy (no grad), in fp32."""
    h = model.hidden(input_ids, attention_mask, position_ids, dtype)[:, :-1]
    logits = (h @ model.head_weight().astype(dtype).T).astype(jnp.float32)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    stopped = jax.lax.stop_gradient(logp)
    entropy = -jnp.sum(jnp.exp(stopped) * stopped, axis=-1)
    return picked, entropy


# -- Hugging Face folders and names ----------------------------------------------------------------


def hf_names(params: nnx.State) -> list[tuple[str, jax.Array]]:
    """(HF name, array) of every parameter, in HF's named_parameters order."""
    flat = {".".join(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(params)}
    return [(name, flat[name]) for name in sorted(flat, key=_hf_order)]


_LAYER_ORDER = (
    *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
    *(f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")),
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def _hf_order(name: str) -> tuple:
    parts = name.split(".")
    if parts[:2] == ["model", "embed_tokens"]:
        return (0,)
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), _LAYER_ORDER.index(".".join(parts[3:])))
    return (2,) if parts[:2] == ["model", "norm"] else (3,)


def load_arrays(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder's safetensors files, as fp32 numpy arrays by name."""
    from safetensors import safe_open

    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file")
    arrays = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                arrays[name] = np.asarray(f.get_tensor(name).astype(jnp.float32))
    return arrays


def build(config, arrays: dict[str, np.ndarray], dtype=jnp.float32, device=None) -> Decoder:
    """A Decoder holding `arrays` (HF names); a missing or misshapen tensor is an error naming it."""
    model = Decoder(config)
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(k) for k in path)
        if name not in arrays:
            raise UnsupportedModel(f"the checkpoint has no tensor {name!r} that the {config.model_type} decoder needs")
        if arrays[name].shape != var.get_value().shape:
            raise UnsupportedModel(f"{name}: checkpoint shape {arrays[name].shape} != {var.get_value().shape}")
        var.set_value(jax.device_put(jnp.asarray(arrays[name], dtype), device))
    nnx.update(model, state)
    return model


def save_folder(folder: Path, config, params: nnx.State) -> None:
    """config.json + model.safetensors under HF names and shapes, in the parameters' dtype, as
    save_pretrained writes them (torch tensors through DLPack: safetensors' torch writer)."""
    import torch
    from safetensors.torch import save_file

    config.save_pretrained(folder)
    tensors = {name: torch.from_dlpack(jax.device_get(a)).contiguous() for name, a in hf_names(params)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
