"""Attention for the trainer's micro-batches: packed rows through a varlen kernel, padded rows causal.

    packed row [1, T] (sequences end to end, position ids restarting) + cu_seq_lens [n+1], max_length
        ─forward_kwargs─> model(attention_mask=ones, cu_seq_lens_q/k, max_length_q/k)
        ─each attention layer─> varlen flash attention over the n sequences (CUDA; causal, GQA)
                                │ or SDPA with a block-diagonal causal mask (CPU, or no varlen kernel)
    right-padded rows [B, L] + their 2D mask ─mask─> no mask at all ─> SDPA is_causal (fused kernels)
    any other 2D mask (left padding, holes) ─mask─> transformers' own SDPA mask, as before

Why: transformers' SDPA path turns packed position ids into a dense [T, T] block-diagonal mask,
which SDPA can only run through its math kernel (a packed step took twice an unpacked one), and
it turns any padding mask into a dense mask too, which rules out the flash and cuDNN kernels.
With right padding (batch.py's layout) a causal query never sees a pad key, so the padded rows
need no mask: the pad positions compute values that nothing reads (they are never scored).

Guarantees: `install` switches a model to this attention only where it is the same math as SDPA
(plain softmax attention of the listed model types, no sliding window, SDPA selected) and says
whether it did; otherwise the model is left as it was and packed rows take transformers' path.
With cu_seq_lens a query attends exactly to the keys of its own sequence at or before it;
without, the result is SDPA's on the same mask. The kernel (varlen flash or the masked fallback)
changes only floating-point rounding, which tests bound against the unpacked rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "dockyard_packed"
# Plain causal softmax attention (no soft-capping, sinks or per-layer windows) in transformers' code.
MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the masked fallback serves
    varlen_attn = None

# The varlen API changed between torch releases: causal by flag or by window, GQA by flag or not at all.
_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


@dataclass(frozen=True)
class Segments:
    """Where each sequence of a packed row starts: cu_seq_lens [n+1] (int32) and the longest length."""

    cu_seq_lens: torch.Tensor
    max_length: int

    @classmethod
    def of(cls, lengths: list[int]) -> Segments:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        return cls(torch.tensor(bounds, dtype=torch.int32), max(lengths))

    def to(self, device: str | torch.device) -> Segments:
        return Segments(self.cu_seq_lens.to(device), self.max_length)


def forward_kwargs(segments: Segments, input_ids: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of a model forward over one packed row, for a model `install` switched.

    The all-ones mask keeps transformers from building its dense packed-sequence mask (it looks
    for packing only when no mask is given); the attention reads the sequences from cu_seq_lens.
    """
    return {
        "attention_mask": torch.ones_like(input_ids),
        "cu_seq_lens_q": segments.cu_seq_lens,
        "cu_seq_lens_k": segments.cu_seq_lens,
        "max_length_q": segments.max_length,
        "max_length_k": segments.max_length,
    }


def install(model: torch.nn.Module) -> bool:
    """Switch `model` (a transformers causal LM on SDPA) to this attention; whether it was switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(config, "sliding_window", None) is not None or config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True


def installed(model: torch.nn.Module) -> bool:
    """Whether `model` runs this attention (then its packed rows go with their Segments)."""
    config = getattr(model, "config", None)
    return config is not None and config._attn_implementation == NAME


def varlen_ready(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether packed rows of `model` computed in `dtype` run the varlen kernel (on CUDA), not the
    masked fallback: the attention is installed and the kernel takes the dtype and head size."""
    if not installed(model):
        return False
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return _varlen_fits(dtype, dim**-0.5, dim)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, T, D], key/value [B, H_kv, T, D] -> [B, T, H, D]."""
    if sliding_window is not None:
        raise RuntimeError(f"{NAME} attention has no sliding window; install() refuses such models")
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, length, dim = query.shape
    kind = query.device.type
    if torch.is_autocast_enabled(kind):  # as SDPA runs under autocast (rotary leaves q, k in fp32 there)
        dtype = torch.get_autocast_dtype(kind)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # The sequences run end to end over the flattened rows: [B·T, H, D].
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    scale = dim**-0.5 if scaling is None else scaling
    if query.is_cuda and dropout == 0.0 and _varlen_fits(q.dtype, scale, dim):
        out = _varlen(q, k, v, cu_seq_lens_q, max_length_q or batch * length, scale)
    else:
        out = _masked(q, k, v, cu_seq_lens_q, dropout, scale)
    return out.reshape(batch, length, heads, dim), None


def _varlen_fits(dtype: torch.dtype, scale: float, dim: int) -> bool:
    if varlen_attn is None or dtype not in (torch.float16, torch.bfloat16) or dim > 256:
        return False
    return "scale" in _VARLEN_PARAMS or scale == dim**-0.5


def _varlen(q, k, v, cu_seq_lens, max_length: int, scale: float) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # left unbounded, right 0: causal
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:  # query head h reads KV head h // group, as transformers' repeat_kv pairs them
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = cu_seq_lens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_length, max_length, **kwargs)


def _masked(q, k, v, cu_seq_lens, dropout: float, scale: float) -> torch.Tensor:
    """SDPA over [H, N, D] with a block-diagonal causal mask: exact, dense, for CPU and odd cases."""
    n = q.shape[0]
    positions = torch.arange(n, device=q.device)
    sequence = torch.bucketize(positions, cu_seq_lens[1:].to(q.device), right=True)
    mask = (sequence[:, None] == sequence[None, :]) & (positions[:, None] >= positions[None, :])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def packed_attention_mask(attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, except that right-padded rows (and all-ones masks) get none: causal suffices."""
    if attention_mask is not None and attention_mask.ndim == 2 and _right_padded(attention_mask):
        attention_mask = None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def _right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (one host sync per forward)."""
    mask = mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, packed_attention_mask)
