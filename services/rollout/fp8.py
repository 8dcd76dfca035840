"""FP8 rollouts on the torch engine (policy.generation.precision=fp8 or fp8_block): the decoder's linear
layers run FP8 matmuls while the trainer stays in bf16.

    refit: bf16 weights (the trainer's, any transport) ──copy_ into each layer's bf16 `weight`──>
           requantize: fp8: per output channel, scale = amax(|w_row|) / 448, w_fp8 = e4m3(w / scale);
                       fp8_block: the same per 128 inputs of each output channel;
                       on CUDA one compiled function per layer (torch.compile: the amax and the scaled cast
                       fused, written straight into the layer's FP8 buffers, without the eager chain's float32
                       temporaries); each layer as soon as its weight has landed, where the transport says so
                       (the collective one: on the compute stream while the next transfers run on NCCL's),
                       else every layer after the load (on CUDA, one replay of a captured CUDA graph)
    forward(x): fp8: per token, x_scale = amax(|x_row|) / 448, x_fp8 = e4m3(x / x_scale);
                fp8_block: the same per group of 128 features of a token
           ──torch._scaled_mm(x_fp8, w_fp8ᵀ, x_scale, w_scale) in bf16 (+ bias)──> y

Block scaling (1 x 128 tiles of weights and activations, as cuBLAS' blockwise kernels take them on Hopper) keeps
one outlier from coarsening a whole row or token; a layer whose dimensions are not multiples of 128 keeps
per-channel scales.

Guarantees: only `nn.Linear` layers inside the decoder blocks become FP8 (embeddings, norms and
the output head stay in the model's dtype, so the sampled distribution's last step is bf16); each
layer keeps its bf16 weight as the target the weight sync loads into (the protocol and names are
unchanged: the rollout cannot tell a bf16 engine from an FP8 one), and every load refreshes each layer's
FP8 copy in place (Fp8Layers), so captured CUDA graphs stay valid. The cost is 1.5x the
weight memory of the linear layers. `convert` refuses a device without FP8 matmuls (CPU, or a GPU
below compute capability 8.9) with Fp8Unavailable, never a silent bf16 fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import structlog
import torch
from torch import nn

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# Below this the scale is clamped, so an all-zero row or token stays zero instead of dividing by 0.
MIN_SCALE = 1e-12
BLOCK = 128  # fp8_block: a scale per BLOCK consecutive inputs of a weight row or features of a token
# Rows of a block-scaled activation are padded to a multiple of this (one row is fine): its column-major scale's
# stride must be 16-byte aligned (on an H100, 2 rows were CUBLAS_STATUS_NOT_SUPPORTED; 1, 4, 8, ... ran).
ROW_ALIGN = 4


log = structlog.get_logger()


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


def check_blockwise(device: torch.device) -> None:
    """Raise Fp8Unavailable unless this GPU and torch build run _scaled_mm with blockwise scales (cuBLAS has
    them for Hopper): one small product tells, rather than a list of what each release supports."""
    x, x_scale = quantize_groups(torch.ones(BLOCK, 2 * BLOCK, device=device))
    w, w_scale = quantize_groups(torch.ones(2 * BLOCK, 2 * BLOCK, device=device))
    try:
        torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        name = torch.cuda.get_device_name(device)
        raise Fp8Unavailable(
            f"policy.generation.precision=fp8_block needs blockwise FP8 matmuls (Hopper, CUDA 12.9+), which "
            f"torch {torch.__version__} on {name} does not run ({str(exc).splitlines()[0]}): use precision fp8"
        ) from None


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row [rows, 1]) with t ≈ values * scale row by row."""
    scale = (t.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per group of BLOCK features of each row) of [rows, features]; the scale is
    [rows, features / BLOCK] stored column-major, as _scaled_mm takes a 1 x 128 blockwise scale of its first
    operand (its transpose is the layout it takes for its second)."""
    m, k = x.shape
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = (groups.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)
    values = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(m, k), scale.t().contiguous().t()


def quantize_weight(weight: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An Fp8Linear's (e4m3 weight, scale): the scale [1, out] per channel, or [in / BLOCK, out] (`block`)."""
    if block:
        values, scale = quantize_groups(weight)
        return values, scale.t()
    values, scale = quantize_rows(weight)
    return values, scale.reshape(1, -1).contiguous()


def requantize_into(weight: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, block: bool) -> None:
    """quantize_weight written into an Fp8Linear's buffers in place (their storage is what captured graphs read)."""
    new_values, new_scale = quantize_weight(weight, block)
    values.copy_(new_values)
    scale.copy_(new_scale)


@functools.cache
def fused_requantize() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]:
    """requantize_into compiled (at its first call; dynamic shapes, so one kernel pair serves every layer's
    shape). Made on first use: importing the compiler costs every engine, FP8 or not, half a second."""
    return torch.compile(requantize_into, dynamic=True, fullgraph=True)


def blockable(linear: nn.Linear) -> bool:
    return linear.in_features % BLOCK == 0 and linear.out_features % BLOCK == 0


class Fp8Linear(nn.Module):
    """A linear layer whose matmul runs in FP8: per-channel weight and per-token activation scales, or (`block`)
    a scale per 128 inputs of each output channel and per 128 features of each token."""

    def __init__(self, linear: nn.Linear, block: bool = False) -> None:
        super().__init__()
        if block and not blockable(linear):
            raise ValueError(f"block scaling needs dimensions that are multiples of {BLOCK}: {linear}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block = block
        self.weight = linear.weight  # bf16: what the weight sync loads into
        self.bias = linear.bias
        values, scale = quantize_weight(self.weight.detach(), block)
        self.register_buffer("weight_fp8", values, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)

    @torch.no_grad()
    def requantize(self) -> None:
        into = fused_requantize() if self.weight.is_cuda else requantize_into
        into(self.weight.detach(), self.weight_fp8, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        count = rows.shape[0]
        if self.block and count > 1 and count % ROW_ALIGN:  # cuBLAS refuses an unaligned 1 x 128 scale stride
            rows = nn.functional.pad(rows, (0, 0, 0, -count % ROW_ALIGN))
        x_fp8, x_scale = (quantize_groups if self.block else quantize_rows)(rows)
        y = torch._scaled_mm(
            x_fp8,
            self.weight_fp8.t(),  # column-major, as _scaled_mm wants its second operand
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=None if self.block else self.bias,  # cuBLAS' blockwise kernels take no bias
            out_dtype=self.weight.dtype,
        )
        if self.block and self.bias is not None:
            y = y + self.bias
        return y[:count].reshape(*shape[:-1], self.out_features)


def convert(model: nn.Module, device: torch.device, block: bool = False) -> Fp8Layers:
    """Replace every nn.Linear of the decoder blocks (model.model.layers) by an Fp8Linear, block-scaled (`block`)
    where its shape allows; returns them, by the name of the bf16 weight each follows."""
    check_device(device)
    if block:
        check_blockwise(device)
    for decoder_layer in model.get_decoder().layers:
        for name, module in list(decoder_layer.named_modules()):
            if isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                parent = decoder_layer.get_submodule(name.rpartition(".")[0]) if "." in name else decoder_layer
                setattr(parent, name.rpartition(".")[2], Fp8Linear(module, block=block and blockable(module)))
    # Named as named_parameters names their bf16 weights, which is how the weight sync reports them landed.
    by_weight = {f"{path}.weight": m for path, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if not by_weight:
        raise Fp8Unavailable("policy.generation.precision=fp8: no decoder linear layer has FP8-compatible shapes")
    return Fp8Layers(by_weight)


class Fp8Layers:
    """An engine's FP8 layers by the name of their bf16 weight (as `named_parameters` gives it), kept in step
    with those weights across loads.

    A load `begin`s; `landed(names)` requantizes the layers of weights that have arrived while later ones are
    still arriving (the weight sync's TensorSink calls it); `finish` requantizes the layers whose weights did
    not land since `begin` (every one, after a transport that reports no landings). A load that fails never
    finishes: the engine's next load begins afresh, and until one succeeds its weights are torn anyway.

    On CUDA, requantizing every layer is one CUDA graph replay, captured after the first such `finish` has
    compiled the requantize for every layer's shape: one launch per layer costs more host time than a small
    layer's requantization takes on the device (a 0.5B model's layers took 14 ms one by one). The graph reads
    and writes the layers' own tensors, so it is replayed only while every one of them is the tensor it
    captured (checked at each replay), and only once one replay has been seen to write what the layers' own
    requantization wrote (`_capture`). Layers whose tensors moved, or a capture that failed either way, are
    requantized one by one from then on."""

    def __init__(self, by_weight: dict[str, Fp8Linear], graphs: bool | None = None) -> None:
        self.by_weight = by_weight
        self._fresh: set[str] = set()
        # Whether to requantize every layer as one captured graph (default: where the layers are on CUDA).
        self._graphs = all(layer.weight.is_cuda for layer in by_weight.values()) if graphs is None else graphs
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: list[int] = []  # the storages the graph reads and writes, layer by layer

    def __len__(self) -> int:
        return len(self.by_weight)

    def begin(self) -> None:
        self._fresh = set()

    def landed(self, names: list[str]) -> None:
        for name in names:
            if (layer := self.by_weight.get(name)) is not None:
                layer.requantize()
                self._fresh.add(name)

    def finish(self) -> None:
        if not self._fresh and self._graphs:
            self._requantize_all()
        else:
            for name, layer in self.by_weight.items():
                if name not in self._fresh:
                    layer.requantize()
        self._fresh = set()

    def _storages(self) -> list[int]:
        return [t.data_ptr() for m in self.by_weight.values() for t in (m.weight, m.weight_fp8, m.weight_scale)]

    @torch.no_grad()
    def _requantize_all(self) -> None:
        if self._graph is not None:
            if self._storages() == self._captured:
                self._graph.replay()
                return
            self._graphs, self._graph = False, None  # tensors that move between loads: no graph can follow them
        for layer in self.by_weight.values():
            layer.requantize()
        if self._graphs:
            self._capture()  # the same work recorded for the next loads (checked by one replay)

    def _capture(self) -> None:
        """Capture the requantization of every layer (its values already in the layers), then check the graph once:
        with every FP8 buffer zeroed, one replay must write back exactly what the layers hold (their fingerprints
        equal). A capture that fails or does not hold leaves the layers requantized one by one."""
        layers = list(self.by_weight.values())
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the engine's other threads may touch CUDA meanwhile (nothing of theirs is captured).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for layer in layers:
                    layer.requantize()
            expected = _fingerprints(layers)
            for layer in layers:
                layer.weight_fp8.zero_()
                layer.weight_scale.zero_()
            graph.replay()
            if not torch.equal(_fingerprints(layers), expected):
                raise RuntimeError("its replay wrote other values than the layers' own requantization")
        except RuntimeError as exc:
            log.warning("fp8 requantize not captured as a CUDA graph: layers requantized one by one", error=str(exc))
            self._graphs = False
            for layer in layers:  # whatever the check left in the buffers
                layer.requantize()
            return
        self._graph, self._captured = graph, self._storages()


def _fingerprints(layers: list[Fp8Linear]) -> torch.Tensor:
    return torch.stack([torch.stack((m.weight_fp8.float().sum(), m.weight_scale.float().sum())) for m in layers])
