"""On an FP8-capable GPU (compute capability 8.9+), the torch engine with precision=fp8 samples from
(nearly) the bf16 policy, and a refit reaches the FP8 weights before the next token.

Run with `make test-gpu` (or `python -m pytest tests/gpu -q`) on an H100/H200-class GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from dockyard.models import build_char_tokenizer
from dockyard.models.build import build_random_model
from services.rollout.decoding import DecodingParams
from services.rollout.fp8 import BLOCK, Fp8Linear, quantize_groups, quantize_weight
from services.rollout.torch_engine import TorchEngine
from services.trainer.logprobs import sampled_logprobs
from tests.conftest import missing

SHAPE = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 512, "initializer_range": 0.1}  # fmt: skip


@pytest.fixture(autouse=True)
def fp8_gpu() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        missing("no CUDA device with FP8 matmuls (compute capability 8.9+)")


@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_fp8_engine_samples_the_bf16_policy_and_follows_a_refit(precision: str) -> None:
    tok = build_char_tokenizer()
    model = build_random_model(SHAPE, len(tok), 0).to(torch.bfloat16).cuda().eval()
    engine = TorchEngine(
        build_random_model(SHAPE, len(tok), 0).to(torch.bfloat16), tok, "cuda", kv_cache="static", precision=precision
    )
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down of each block; the head stays bf16
    assert all(layer.block == (precision == "fp8_block") for layer in layers)  # every size here is a multiple of 128
    decoding = DecodingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=1)
    result = asyncio.run(engine.generate("12+34=", 8, decoding))
    ids = torch.tensor([result.prompt_token_ids + c.token_ids for c in result.completions], device="cuda")
    gen = torch.tensor([c.logprobs for c in result.completions], device="cuda")

    def delta(policy) -> float:  # mean |logprob| gap of the sampled tokens to `policy`'s, teacher-forced
        with torch.no_grad():
            lp, _ = sampled_logprobs(policy, ids, torch.ones_like(ids), None, 1.0, entropy=False)
        return (lp[:, len(result.prompt_token_ids) - 1 :].float() - gen).abs().mean().item()

    other = build_random_model(SHAPE, len(tok), 1).to(torch.bfloat16).cuda().eval()
    # FP8 rounding (3 mantissa bits) moves the logprobs, but the sampler is this policy, not another one.
    assert delta(model) < 0.5 * delta(other)

    # A refit: new bf16 weights copied in under the engine's hold, then the version is set.
    targets = engine.named_weights()
    before = layers[0].weight_fp8.clone()
    with engine.exclusive(), torch.no_grad():
        for name, p in model.named_parameters():
            targets[name].copy_(-p)
        engine.set_weight_version(1)
    assert not torch.equal(layers[0].weight_fp8, before)
    scale = layers[0].weight_scale.reshape(-1, 1)  # fp8: one per output channel
    if precision == "fp8_block":  # [in / 128, out]: one per 128 inputs of each output channel
        scale = layers[0].weight_scale.t().repeat_interleave(BLOCK, 1)
    dequantized = layers[0].weight_fp8.float() * scale
    reference = -model.model.layers[0].self_attn.q_proj.weight.float()
    torch.testing.assert_close(dequantized, reference, rtol=0.07, atol=1e-3)

    # A refit whose transport reports each weight as it lands (the collective one: bytes on NCCL's stream,
    # the requantization on the compute stream meanwhile): each layer holds its new weight's quantization.
    sink, transfer = engine.weight_sink(), torch.cuda.Stream()
    with engine.exclusive(), torch.no_grad():
        transfer.wait_stream(torch.cuda.current_stream())
        for name, p in model.named_parameters():
            with torch.cuda.stream(transfer):
                sink.targets[name].copy_(p)
            torch.cuda.current_stream().wait_event(transfer.record_event())
            sink.landed([name])
        engine.set_weight_version(2)
    for path, layer in engine.model.named_modules():
        if isinstance(layer, Fp8Linear):
            values, scale = quantize_weight(model.get_parameter(f"{path}.weight").detach(), layer.block)
            got, want = layer.weight_fp8.float(), values.float()  # the compiled requantize: see the test below
            assert (got != want).float().mean().item() <= 1e-3, path
            assert ((got - want).abs() <= 0.125 * want.abs()).all(), path
            torch.testing.assert_close(layer.weight_scale, scale, rtol=1e-6, atol=0)
    asyncio.run(engine.close())


def test_a_block_scaled_layer_computes_the_matmul_of_its_dequantized_operands() -> None:
    """The scale layouts are the ones cuBLAS' blockwise kernels read: the FP8 matmul equals the float matmul of
    the dequantized activations and weight (up to bf16 output rounding), bias added."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        linear.weight[:128, :128] *= 50  # outliers in the first 128 inputs of half the channels
    layer = Fp8Linear(linear, block=True)
    x = torch.randn(3, 7, 384, dtype=torch.bfloat16, device="cuda")
    x[..., :128] *= 20  # an outlier group
    xv, xs = quantize_groups(x.reshape(-1, 384))
    wv, ws = quantize_groups(linear.weight.detach())
    x_deq = xv.float() * xs.repeat_interleave(BLOCK, 1)
    w_deq = wv.float() * ws.repeat_interleave(BLOCK, 1)
    expected = (x_deq @ w_deq.t() + linear.bias.float()).reshape(3, 7, 256)
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("block", [False, True])
def test_the_compiled_requantize_writes_what_the_eager_quantization_gives(block: bool) -> None:
    """A refit's requantize (one compiled function on CUDA) fills the layer's own buffers, in place, with exactly
    the eager quantization's values (a fused division may round a rare value to the next e4m3 step), for layers
    of different shapes through one compiled function."""
    torch.manual_seed(0)
    for rows, cols in ((256, 384), (640, 128), (128, 1024)):
        layer = Fp8Linear(torch.nn.Linear(cols, rows, dtype=torch.bfloat16, device="cuda"), block=block)
        values, scale = layer.weight_fp8.data_ptr(), layer.weight_scale.data_ptr()
        with torch.no_grad():
            layer.weight.mul_(torch.randn_like(layer.weight) * 30)
        layer.requantize()
        assert (layer.weight_fp8.data_ptr(), layer.weight_scale.data_ptr()) == (values, scale)
        expected_values, expected_scale = quantize_weight(layer.weight.detach(), block)
        got, want = layer.weight_fp8.float(), expected_values.float()
        assert (got != want).float().mean().item() <= 1e-3
        assert ((got - want).abs() <= 0.125 * want.abs()).all()  # at most one e4m3 step (3 mantissa bits) apart
        torch.testing.assert_close(layer.weight_scale, expected_scale, rtol=1e-6, atol=0)


def _assert_requantized(engine: TorchEngine) -> None:
    """Every FP8 layer holds its bf16 weight's quantization (within one e4m3 step: see the test above)."""
    for path, layer in engine.model.named_modules():
        if isinstance(layer, Fp8Linear):
            values, scale = quantize_weight(layer.weight.detach(), layer.block)
            got, want = layer.weight_fp8.float(), values.float()
            assert (got != want).float().mean().item() <= 1e-3, path
            assert ((got - want).abs() <= 0.125 * want.abs()).all(), path
            torch.testing.assert_close(layer.weight_scale, scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_loads_after_the_first_requantize_every_layer_in_one_graph_that_follows_the_new_weights(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After-load requantization is one captured CUDA graph from the second load on: no layer is requantized one by
    one, and each load's FP8 weights are its own weights' quantization. A layer whose FP8 buffer was replaced (not
    written in place) is something the graph cannot follow: the layers are requantized one by one again."""
    tok = build_char_tokenizer()
    engine = TorchEngine(
        build_random_model(SHAPE, len(tok), 0).to(torch.bfloat16), tok, "cuda", kv_cache="static", precision=precision
    )
    calls: list[Fp8Linear] = []
    requantize = Fp8Linear.requantize
    monkeypatch.setattr(Fp8Linear, "requantize", lambda self: (calls.append(self), requantize(self)))
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    targets = engine.named_weights()
    for version, seed in enumerate((1, 2, 3), start=1):
        other = build_random_model(SHAPE, len(tok), seed).to(torch.bfloat16).cuda()
        calls.clear()
        with engine.exclusive(), torch.no_grad():
            for name, p in other.named_parameters():
                targets[name].copy_(p)
            engine.set_weight_version(version)
        torch.cuda.synchronize()
        # The first load requantizes one by one, then captures the same work (recorded, not run) and checks a replay.
        assert len(calls) == (2 * len(layers) if version == 1 else 0), version
        _assert_requantized(engine)

    layers[3].weight_fp8 = torch.empty_like(layers[3].weight_fp8)  # replaced, not written in place
    calls.clear()
    with engine.exclusive(), torch.no_grad():
        for p in targets.values():
            p.mul_(-1)
        engine.set_weight_version(4)
    assert len(calls) == len(layers)
    _assert_requantized(engine)
    asyncio.run(engine.close())
