"""FP8 rollouts on the torch engine (policy.generation.precision=fp8): the decoder's linear layers run
FP8 matmuls while the trainer stays in bf16.

    refit: bf16 weights (the trainer's, any transport) ──copy_ into each layer's bf16 `weight`──>
           requantize, by policy.generation.fp8_scaling:
             channel: per output channel, scale = amax(|w_row|) / 448, w_fp8 = e4m3(w / scale)
             block:   per 128x128 block of w, the same (fp8_kernels.py: one fused pass per layer on CUDA)
    forward(x): channel: per token, x_scale = amax(|x_row|) / 448; block: per token and group of 128
           input channels; x_fp8 = e4m3(x / x_scale)
           ──torch._scaled_mm(x_fp8, w_fp8ᵀ, x_scale, w_scale) in bf16 (+ bias)──> y

Guarantees: only `nn.Linear` layers inside the decoder blocks become FP8 (embeddings, norms and
the output head stay in the model's dtype, so the sampled distribution's last step is bf16); each
layer keeps its bf16 weight as the target the weight sync loads into (the protocol and names are
unchanged: the rollout cannot tell a bf16 engine from an FP8 one), and `requantize` refreshes the
FP8 copies in place after every load, so captured CUDA graphs stay valid. The cost is 1.5x the
weight memory of the linear layers. `convert` refuses a device without FP8 matmuls (CPU, or a GPU
below compute capability 8.9) with Fp8Unavailable, never a silent bf16 fallback; with block
scaling, a torch or cuBLAS without block-scaled FP8 matmuls is refused the same way, naming what
failed. A layer whose sizes are not multiples of 128 keeps per-channel scales under block scaling.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# Below this the scale is clamped, so an all-zero row or token stays zero instead of dividing by 0.
MIN_SCALE = 1e-12
BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK (what cuBLAS's block scaling takes)
SCALINGS = ("channel", "block")


class Fp8Unavailable(RuntimeError):
    pass


def check_device(device: torch.device) -> None:
    """Raise Fp8Unavailable unless `device` runs FP8 matmuls (CUDA, compute capability 8.9+)."""
    if device.type != "cuda":
        raise Fp8Unavailable(
            f"policy.generation.precision=fp8 needs FP8 matmuls (a CUDA GPU of compute capability 8.9+, e.g. "
            f"L40, H100, H200); this rollout runs on {device}: use precision auto on CPU"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise Fp8Unavailable(
            f"policy.generation.precision=fp8 needs compute capability 8.9+ for FP8 matmuls; {name} has {major}.{minor}"
        )


def _e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / E4M3_MAX).clamp(min=MIN_SCALE)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row [rows, 1]) with t ≈ values * scale row by row."""
    scale = _scale(t.abs().amax(dim=-1, keepdim=True))
    return _e4m3(t, scale), scale


def quantize_groups(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [rows, cols], float32 scale [rows, cols / BLOCK]) per row and group of BLOCK columns.

    The scale comes column-major (stride (1, rows)), the layout cuBLAS's 1x128 block scaling reads."""
    groups = t.unflatten(-1, (-1, BLOCK))
    scale = _scale(groups.abs().amax(dim=-1))
    values = _e4m3(groups, scale.unsqueeze(-1)).flatten(-2)
    return values, scale.t().contiguous().t()


def quantize_blocks(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [rows, cols], float32 scale [rows / BLOCK, cols / BLOCK]) per BLOCK x BLOCK block (reference)."""
    blocks = t.unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK))  # [R, BLOCK, C, BLOCK]
    scale = _scale(blocks.abs().amax(dim=(1, 3)))
    values = _e4m3(blocks, scale[:, None, :, None]).flatten(2).flatten(0, 1)
    return values, scale


def blockable(linear: nn.Linear) -> bool:
    return linear.in_features % BLOCK == 0 and linear.out_features % BLOCK == 0


class Fp8Linear(nn.Module):
    """A linear layer whose matmul runs in FP8: per-channel weight and per-token activation scales, or
    (block) per 128x128 weight block and per token and group of 128 input channels."""

    def __init__(self, linear: nn.Linear, scaling: str = "channel") -> None:
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling is one of {SCALINGS}, not {scaling!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block = scaling == "block" and blockable(linear)
        self.weight = linear.weight  # bf16: what the weight sync loads into
        self.bias = linear.bias
        w = linear.weight.detach()
        values, scale = quantize_blocks(w) if self.block else quantize_rows(w)
        self.register_buffer("weight_fp8", values, persistent=False)
        # The second operand's scale as _scaled_mm takes it: [1, out] per channel; [in / 128, out / 128] per block.
        self.register_buffer("weight_scale", scale.t().contiguous(), persistent=False)

    @torch.no_grad()
    def requantize(self) -> None:
        if self.block and self.weight.is_cuda:
            from services.rollout.fp8_kernels import quantize_blocks_into

            return quantize_blocks_into(self.weight.detach(), self.weight_fp8, self.weight_scale.t())
        values, scale = quantize_blocks(self.weight.detach()) if self.block else quantize_rows(self.weight.detach())
        self.weight_fp8.copy_(values)
        self.weight_scale.copy_(scale.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        x_fp8, x_scale = quantize_groups(flat) if self.block else quantize_rows(flat)
        y = torch._scaled_mm(
            x_fp8,
            self.weight_fp8.t(),  # column-major, as _scaled_mm wants its second operand
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=None if self.block else self.bias,  # cuBLAS's block-scaled kernels take no bias
            out_dtype=self.weight.dtype,
        )
        if self.block and self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def convert(model: nn.Module, device: torch.device, scaling: str = "channel") -> list[Fp8Linear]:
    """Replace every nn.Linear of the decoder blocks (model.model.layers) by an Fp8Linear; returns them."""
    check_device(device)
    layers = model.get_decoder().layers
    converted = []
    for block in layers:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                fp8 = Fp8Linear(module, scaling)
                setattr(parent, name.rpartition(".")[2], fp8)
                converted.append(fp8)
    if not converted:
        raise Fp8Unavailable("policy.generation.precision=fp8: no decoder linear layer has FP8-compatible shapes")
    if scaling == "block":
        check_block_matmul(converted, device)
    return converted


def check_block_matmul(layers: list[Fp8Linear], device: torch.device) -> None:
    """Fp8Unavailable, naming what failed, unless a block-scaled layer runs and agrees with its bf16 matmul."""
    layer = next((m for m in layers if m.block), None)
    if layer is None:
        return
    x = torch.randn(4, layer.in_features, device=device, dtype=layer.weight.dtype)
    try:
        with torch.no_grad():
            got = layer(x).float()
    except RuntimeError as exc:
        raise Fp8Unavailable(
            f"policy.generation.fp8_scaling=block: this torch ({torch.__version__}) cannot run block-scaled FP8 "
            f"matmuls on {torch.cuda.get_device_name(device)}: {str(exc).splitlines()[0]}; use fp8_scaling=channel"
        ) from exc
    want = nn.functional.linear(x, layer.weight, layer.bias).float()
    if not (got - want).abs().max() <= 0.1 * want.abs().max():
        raise Fp8Unavailable("policy.generation.fp8_scaling=block: the block-scaled FP8 matmul disagrees with bf16")


def requantize(layers: list[Fp8Linear]) -> None:
    for layer in layers:
        layer.requantize()
