"""The block requantization of an FP8 layer's weight after a load, in one pass over its bf16 bytes (Triton).

    w [rows, cols] bf16 ──one program per 128x128 block: load, amax, scale = amax / 448, e4m3(w / scale)──>
        values [rows, cols] e4m3 (in place), scale [rows / 128, cols / 128] float32 (in place, any strides)

Guarantees: the same values and scales, bit for bit, as fp8.quantize_blocks (the torch reference,
tests/gpu/test_fp8_gpu.py compares them), written into the layer's existing buffers, so a captured
graph that reads them stays valid. Reading the weight once and writing one byte per element, where
the torch reference makes float32 copies of every block: a refit's requantization costs one pass of
memory traffic per layer. CUDA only (imported on first use, never on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.rollout.fp8 import BLOCK, E4M3_MAX, MIN_SCALE


@triton.jit
def _quantize_blocks(
    w_ptr, q_ptr, s_ptr, cols, s_stride_r, s_stride_c, E4M3: tl.constexpr, MIN: tl.constexpr, B: tl.constexpr
):
    r, c = tl.program_id(0), tl.program_id(1)
    rows = r * B + tl.arange(0, B)
    at = rows[:, None] * cols + (c * B + tl.arange(0, B))[None, :]
    w = tl.load(w_ptr + at).to(tl.float32)
    scale = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0) / E4M3, MIN)  # IEEE division, as torch's
    q = tl.minimum(tl.maximum(w / scale, -E4M3), E4M3)
    tl.store(q_ptr + at, q.to(tl.float8e4nv))
    tl.store(s_ptr + r * s_stride_r + c * s_stride_c, scale)


def quantize_blocks_into(w: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> None:
    """fp8.quantize_blocks(w) written into `values` (contiguous, like w) and `scale` ([rows/128, cols/128])."""
    rows, cols = w.shape
    assert w.is_contiguous() and values.is_contiguous() and rows % BLOCK == 0 and cols % BLOCK == 0
    grid = (rows // BLOCK, cols // BLOCK)
    _quantize_blocks[grid](
        w, values, scale, cols, scale.stride(0), scale.stride(1), E4M3=E4M3_MAX, MIN=MIN_SCALE, B=BLOCK, num_warps=8
    )
