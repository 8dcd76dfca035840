"""FP8 rollouts on the torch engine (policy.generation.precision=fp8): the decoder's linear layers run
FP8 matmuls while the trainer stays in bf16.

    refit: bf16 weights (the trainer's, any transport) ──copy_ into each layer's bf16 `weight`──>
           requantize: per output channel, scale = amax(|w_row|) / 448, w_fp8 = e4m3(w / scale)
    forward(x): per token, x_scale = amax(|x_row|) / 448, x_fp8 = e4m3(x / x_scale)
           ──torch._scaled_mm(x_fp8, w_fp8ᵀ, x_scale, w_scale) in bf16 (+ bias)──> y

Guarantees: only `nn.Linear` layers inside the decoder blocks become FP8 (embeddings, norms and
the output head stay in the model's dtype, so the sampled distribution's last step is bf16); each
layer keeps its bf16 weight as the target the weight sync loads into (the protocol and names are
unchanged: the rollout cannot tell a bf16 engine from an FP8 one), and `requantize` refreshes the
FP8 copies in place after every load, so captured CUDA graphs stay valid. The cost is 1.5x the
weight memory of the linear layers. `convert` refuses a device without FP8 matmuls (CPU, or a GPU
below compute capability 8.9) with Fp8Unavailable, never a silent bf16 fallback.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# Below this the scale is clamped, so an all-zero row or token stays zero instead of dividing by 0.
MIN_SCALE = 1e-12


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


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row [rows, 1]) with t ≈ values * scale row by row."""
    scale = (t.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """A linear layer whose matmul runs in FP8 with per-channel weight and per-token activation scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # bf16: what the weight sync loads into
        self.bias = linear.bias
        values, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", values, persistent=False)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous(), persistent=False)

    @torch.no_grad()
    def requantize(self) -> None:
        values, scale = quantize_rows(self.weight.detach())
        self.weight_fp8.copy_(values)
        self.weight_scale.copy_(scale.reshape(1, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_fp8, x_scale = quantize_rows(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(
            x_fp8,
            self.weight_fp8.t(),  # column-major, as _scaled_mm wants its second operand
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=self.weight.dtype,
        )
        return y.reshape(*shape[:-1], self.out_features)


def convert(model: nn.Module, device: torch.device) -> list[Fp8Linear]:
    """Replace every nn.Linear of the decoder blocks (model.model.layers) by an Fp8Linear; returns them."""
    check_device(device)
    layers = model.get_decoder().layers
    converted = []
    for block in layers:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                fp8 = Fp8Linear(module)
                setattr(parent, name.rpartition(".")[2], fp8)
                converted.append(fp8)
    if not converted:
        raise Fp8Unavailable("policy.generation.precision=fp8: no decoder linear layer has FP8-compatible shapes")
    return converted


def requantize(layers: list[Fp8Linear]) -> None:
    for layer in layers:
        layer.requantize()
