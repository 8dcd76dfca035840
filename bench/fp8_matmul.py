"""FP8 matmuls of one decoder block's linear layers against bf16 on one GPU: time and error, per scaling.

    layers: q, k, v, o, gate, up, down of a Qwen2.5-0.5B or Qwen2-7B block (--shapes), weights N(0, 0.02)
    x: --tokens rows (a decode step's batch), N(0, 1), and the same with OUTLIERS input channels x30
           (the outlier channels real activations have, which one scale per token must cover)
    time: each path captured in a CUDA graph of --inner calls and replayed (no launch overhead, as the
           engine's compiled decode step runs), best of 5: bf16 F.linear; fp8 channel (quantize_rows of x
           + rowwise _scaled_mm); fp8 block (quantize_groups of x + 1x128 / 128x128 block-scaled _scaled_mm)
    error: max |y - y_fp32| / max |y_fp32| against the float32 matmul of the same bf16 operands
    requantization: fp8_kernels.quantize_blocks_into against fp8.quantize_blocks (bit equality, time)

Prints per shape `fp8_<scaling>_vs_bf16_block_matmul_<shape>: R` (bf16 time / fp8 time, quantization
of x included, over the block's seven layers; above 1 = FP8 faster) and the errors; a scaling this torch
cannot run is printed with the first line of its error instead.

    python bench/fp8_matmul.py                      # one CUDA GPU of compute capability 8.9+
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.generation import QWEN25_05B  # noqa: E402
from bench.weight_sync import QWEN2_7B  # noqa: E402
from services.rollout import fp8  # noqa: E402

SHAPES = {"0.5b": QWEN25_05B, "7b": QWEN2_7B}
OUTLIERS = 8


def layers_of(shape: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of one block."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (i, h), "up": (i, h), "down": (h, i)}


def timed(fn, inner: int) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph of `inner` calls (best of 5)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (cuBLAS workspaces, Triton compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / inner)
    return best


def paths(layer_bf16: torch.nn.Linear) -> dict:
    """name -> (a call of x, or the error that stopped the scaling)."""
    out = {"bf16": lambda x: F.linear(x, layer_bf16.weight)}
    for scaling in fp8.SCALINGS:
        try:
            layer = fp8.Fp8Linear(layer_bf16, scaling)
            layer(torch.randn(4, layer.in_features, device="cuda", dtype=torch.bfloat16))
            out[scaling] = layer
        except RuntimeError as exc:
            out[scaling] = str(exc).splitlines()[0]
    return out


def error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name: str, shape: dict, args: argparse.Namespace) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    totals: dict[str, float] = {}
    errors: dict[str, list[float]] = {}
    for layer_name, (n, k) in layers_of(shape).items():
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0.0, 0.02, generator=gen)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        skewed = x.clone()
        skewed[:, torch.randperm(k, device="cuda", generator=gen)[:OUTLIERS]] *= 30.0
        row = []
        for path, call in paths(linear).items():
            if isinstance(call, str):
                row.append(f"{path}: cannot run ({call})")
                continue
            with torch.no_grad():
                seconds = timed(lambda call=call, x=x: call(x), args.inner)
                for label, data in (("gaussian", x), ("outliers", skewed)):
                    ref = data.float() @ linear.weight.float().t()
                    errors.setdefault(f"{path}_{label}", []).append(error(call(data), ref))
            totals[path] = totals.get(path, 0.0) + seconds
            row.append(f"{path} {seconds * 1e6:7.1f} us")
        print(f"  {name} {layer_name:<4} [{args.tokens} x {k}] @ [{k} x {n}]: " + ", ".join(row), flush=True)
    print(f"{name}: one block, {args.tokens} tokens: " + ", ".join(f"{p} {t * 1e6:.1f} us" for p, t in totals.items()))
    for path in fp8.SCALINGS:
        if path in totals:
            print(f"fp8_{path}_vs_bf16_block_matmul_{name}: {totals['bf16'] / totals[path]:.3f}")
    for key, values in errors.items():
        print(f"{name}_max_rel_error_{key}: {max(values):.3e}")


def bench_requantize(shape: dict) -> None:
    from services.rollout.fp8_kernels import quantize_blocks_into

    n, k = shape["intermediate_size"], shape["hidden_size"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    values = torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn)
    scale = torch.empty(k // fp8.BLOCK, n // fp8.BLOCK, device="cuda").t()  # the layer's layout, transposed
    ref_values, ref_scale = fp8.quantize_blocks(w)
    quantize_blocks_into(w, values, scale)
    same = torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8)) and torch.equal(scale, ref_scale)
    fused = timed(lambda: quantize_blocks_into(w, values, scale), 20)
    reference = timed(lambda: fp8.quantize_blocks(w), 20)
    print(f"requantize [{n} x {k}]: fused {fused * 1e6:.1f} us, torch {reference * 1e6:.1f} us; equal: {same}")
    print(f"fp8_block_requantize_fused_vs_torch: {reference / fused:.3f}")


def probe_layouts() -> None:
    """Which scale layouts this torch's block-scaled _scaled_mm takes (and whether the result is right)."""
    m, k, n = 256, 896, 4864
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, xs = fp8.quantize_groups(x)
    wq, ws = fp8.quantize_blocks(w)  # ws [n / 128, k / 128]
    deq_x = (xq.float().unflatten(1, (-1, fp8.BLOCK)) * xs.unsqueeze(-1)).flatten(1)
    deq_w = wq.float().unflatten(0, (-1, fp8.BLOCK)).unflatten(-1, (-1, fp8.BLOCK)) * ws[:, None, :, None]
    ref = deq_x @ deq_w.flatten(2).flatten(0, 1).t()
    pad = -(-ws.shape[0] // 4) * 4
    a_layouts = {"a col-major": xs.t().contiguous().t(), "a row-major": xs.contiguous()}
    b_layouts = {
        "b row-major": ws.t().contiguous(),
        "b col-major": ws.contiguous().t(),
        "b row-major padded to 4": torch.zeros(k // fp8.BLOCK, pad, device="cuda")[:, : ws.shape[0]].copy_(ws.t()),
    }
    for a_name, sa in a_layouts.items():
        for b_name, sb in b_layouts.items():
            try:
                y = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                print(f"layout probe: {a_name}, {b_name}: runs, error against dequantized {error(y, ref):.2e}")
            except RuntimeError as exc:
                print(f"layout probe: {a_name}, {b_name}: {str(exc).splitlines()[0][:200]}")
    print(f"layout probe: F.scaled_mm present: {hasattr(F, 'scaled_mm')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}", flush=True)
    probe_layouts()
    for name in args.shapes.split(","):
        bench_shape(name, SHAPES[name], args)
    bench_requantize(SHAPES["7b"])


if __name__ == "__main__":
    main()
