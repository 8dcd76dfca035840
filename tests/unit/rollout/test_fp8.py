"""FP8 rollouts: the per-row e4m3 quantizer, the FP8 linear layer's numbers (on CPU through torch's
reference _scaled_mm), requantization after a load, and the refusals on hardware without FP8 matmuls."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dockyard.config import ConfigError, load_config_text
from dockyard.models import build_char_tokenizer
from dockyard.models.build import build_random_model
from services.rollout import fp8
from services.rollout.fp8 import (
    BLOCK,
    E4M3_MAX,
    Fp8Linear,
    Fp8Unavailable,
    quantize_groups,
    quantize_rows,
    quantize_weight,
)
from services.rollout.torch_engine import TorchEngine


def test_rows_are_scaled_to_the_e4m3_range_and_come_back_within_its_precision() -> None:
    torch.manual_seed(0)
    t = torch.randn(8, 64) * torch.logspace(-3, 2, 8).unsqueeze(1)  # rows five decades apart
    t[3] = 0.0
    values, scale = quantize_rows(t)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    assert values.float().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6, 7]].eq(E4M3_MAX).all()  # each row uses the range
    back = values.float() * scale
    assert back[3].eq(0).all()  # an all-zero row stays zero (clamped scale, no NaN)
    rel = (back - t).abs() / t.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert rel.max() <= 2**-4  # e4m3 keeps 3 mantissa bits: half an ulp at the top is 1/16


def test_group_scales_keep_an_outlier_from_coarsening_its_row_and_are_laid_out_for_scaled_mm() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    w[:128, :128] *= 1e5  # outliers in the first 128 inputs of rows 0-127, past e4m3's 2^17 range from the rest
    values, scale = quantize_groups(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (256, 384)
    assert scale.shape == (256, 3) and scale.stride() == (1, 256)  # column-major: _scaled_mm's 1 x 128 layout
    back = values.float() * scale.repeat_interleave(BLOCK, 1)
    groups = (back - w).abs().reshape(256, 3, BLOCK).amax(dim=2)
    assert (groups <= 2**-4 * w.abs().reshape(256, 3, BLOCK).amax(dim=2)).all()  # each within its own range
    rows, row_scale = quantize_rows(w)  # per channel, the outlier sets the scale of rows 0-127 everywhere
    assert (back - w)[:128, 128:].abs().mean() < 0.1 * (rows.float() * row_scale - w)[:128, 128:].abs().mean()
    with pytest.raises(ValueError, match="multiples of 128"):
        Fp8Linear(nn.Linear(64, 128), block=True)


@pytest.mark.parametrize("block", [False, True])
def test_conversion_scales_each_layer_as_asked_and_as_its_shape_allows(monkeypatch, block: bool) -> None:
    monkeypatch.setattr(fp8, "check_device", lambda device: None)  # CPU: only the layers' setup is looked at
    monkeypatch.setattr(fp8, "check_blockwise", lambda device: None)
    shape = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 1, "intermediate_size": 512}  # fmt: skip
    layers = fp8.convert(build_random_model(shape, len(build_char_tokenizer()), 0), torch.device("cpu"), block)
    assert len(layers) == 2 * 7
    # Each by the name of the bf16 weight it follows (the weight sync's name for it).
    first = {name.removeprefix("model.layers.0."): layer for name, layer in layers.by_weight.items()}
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    assert set(first) >= {f"{name}.weight" for name in names}
    # k and v project to one head of 64: not a multiple of 128, so they keep per-channel scales.
    assert [first[f"{name}.weight"].block for name in names] == [block, False, False, block, block, block, block]


def _cpu_fp8_engine(monkeypatch) -> TorchEngine:
    monkeypatch.setattr(fp8, "check_device", lambda device: None)  # CPU: torch's reference _scaled_mm
    tok = build_char_tokenizer()
    shape = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip
    return TorchEngine(build_random_model(shape, len(tok), 0), tok, "cpu", kv_cache="dynamic", precision="fp8")


def test_a_load_requantizes_each_layer_once_as_its_weight_lands_and_the_rest_at_its_end(monkeypatch) -> None:
    engine = _cpu_fp8_engine(monkeypatch)
    calls: list[str] = []
    requantize = Fp8Linear.requantize
    by_weight = {f"{path}.weight": m for path, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}
    names = {id(layer): name for name, layer in by_weight.items()}
    monkeypatch.setattr(Fp8Linear, "requantize", lambda self: (calls.append(names[id(self)]), requantize(self)))

    sink = engine.weight_sink()  # a load begins: the collective transport reports each target as it lands
    assert sink.landed is not None
    q = "model.layers.1.self_attn.q_proj.weight"
    with torch.no_grad():
        sink.targets[q].copy_(-sink.targets[q])
    sink.landed([q, "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.bias"])  # not FP8: no work
    assert calls == [q]
    values, scale = quantize_weight(sink.targets[q], block=False)
    layer = by_weight[q]
    assert torch.equal(layer.weight_fp8, values) and torch.equal(layer.weight_scale, scale)  # before the load ends

    engine.set_weight_version(1)  # the load ends: every layer that did not land, once
    assert sorted(calls) == sorted(names.values()) and calls.count(q) == 1
    calls.clear()
    engine.set_weight_version(2)  # a load through a transport that reports no landings: every layer
    assert sorted(calls) == sorted(names.values())
    calls.clear()
    engine.weight_sink().landed([q])  # a load that failed after one landing never ends; the next one begins afresh
    engine.weight_sink()
    engine.set_weight_version(3)
    assert sorted(calls) == sorted([q, *names.values()])


def test_the_fp8_layer_tracks_the_bf16_layer_and_a_reloaded_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    layer = Fp8Linear(linear)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ref = linear(x).float()
    out = layer(x)
    assert out.shape == (2, 5, 32) and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 0.1 * ref.abs().max()
    # A refit loads into the bf16 weight; until requantized the FP8 copy is the old one.
    with torch.no_grad():
        layer.weight.copy_(-layer.weight)
    assert (layer(x).float() - ref).abs().max() <= 0.1 * ref.abs().max()
    layer.requantize()
    flipped = nn.functional.linear(x, layer.weight, layer.bias).float()
    assert (layer(x).float() - flipped).abs().max() <= 0.1 * flipped.abs().max()


def test_fp8_is_refused_without_fp8_matmuls() -> None:
    tok = build_char_tokenizer()
    model = build_random_model({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1}, len(tok), 0)
    with pytest.raises(Fp8Unavailable, match="needs FP8 matmuls .* this rollout runs on cpu"):
        fp8.convert(model, torch.device("cpu"))
    with pytest.raises(Fp8Unavailable, match="precision=fp8"):
        TorchEngine(model, tok, "cpu", precision="fp8")


@pytest.mark.parametrize(
    "overrides",
    [["cluster.device=cpu"], ["cluster.device=cuda", "policy.generation.backend=vllm"]],
    ids=["cpu", "vllm"],
)
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_the_config_refuses_fp8_where_it_cannot_run(overrides: list[str], precision: str) -> None:
    config = f"policy: {{model: {{model_type: qwen2}}, generation: {{precision: {precision}}}}}\n"
    with pytest.raises(ConfigError, match=f"policy.generation.precision: {precision} runs on the torch engine"):
        load_config_text(config, overrides)


class _Graph:
    """A CUDA graph's stand-in on CPU: its capture runs the work (a real capture only records it); a replay
    requantizes the layers in place, as the captured work does, or, where `writes` is off, writes nothing."""

    writes = True
    layers: list[Fp8Linear] = []
    replays = 0

    def replay(self) -> None:
        type(self).replays += 1
        for m in type(self).layers if type(self).writes else []:
            fp8.requantize_into(m.weight.detach(), m.weight_fp8, m.weight_scale, m.block)


def _graph_layers(monkeypatch, writes: bool) -> tuple[fp8.Fp8Layers, list[Fp8Linear], list[Fp8Linear]]:
    """(Fp8Layers capturing graphs through _Graph, its layers, the layers each requantize call was made for)."""
    monkeypatch.setattr(fp8, "check_device", lambda device: None)
    model = build_random_model({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}, 40, 0)
    by_weight = fp8.convert(model, torch.device("cpu")).by_weight
    layers = list(by_weight.values())
    monkeypatch.setattr(_Graph, "writes", writes)
    monkeypatch.setattr(_Graph, "layers", layers)
    monkeypatch.setattr(_Graph, "replays", 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kwargs: contextlib.nullcontext())
    calls: list[Fp8Linear] = []
    requantize = Fp8Linear.requantize
    monkeypatch.setattr(Fp8Linear, "requantize", lambda self: (calls.append(self), requantize(self)))
    return fp8.Fp8Layers(by_weight, graphs=True), layers, calls


def _load(layers: list[Fp8Linear], sign: float) -> None:
    with torch.no_grad():
        for m in layers:
            m.weight.mul_(sign).add_(0.01)


def _assert_quantized(layers: list[Fp8Linear]) -> None:
    for m in layers:
        values, scale = quantize_weight(m.weight.detach(), m.block)
        assert torch.equal(m.weight_fp8, values) and torch.equal(m.weight_scale, scale)


def test_after_the_first_load_every_layer_is_requantized_by_one_replay_while_its_tensors_stay(monkeypatch) -> None:
    group, layers, calls = _graph_layers(monkeypatch, writes=True)
    _load(layers, -1.0)
    group.begin()
    group.finish()  # one by one, then the capture (it records the same work) and one checking replay
    assert len(calls) == 2 * len(layers) and _Graph.replays == 1
    _assert_quantized(layers)
    for load in range(2):
        calls.clear()
        _load(layers, 2.0)
        group.begin()
        group.finish()
        assert calls == [] and _Graph.replays == 2 + load  # no layer one by one: the graph's replay
        _assert_quantized(layers)
    layers[3].weight_fp8 = torch.empty_like(layers[3].weight_fp8)  # replaced, not written in place
    calls.clear()
    _load(layers, -1.0)
    group.finish()
    assert len(calls) == len(layers) and _Graph.replays == 3  # a graph cannot follow tensors that moved
    _assert_quantized(layers)


def test_a_captured_graph_whose_replay_does_not_write_the_layers_requantization_is_never_used(monkeypatch) -> None:
    group, layers, calls = _graph_layers(monkeypatch, writes=False)
    _load(layers, -1.0)
    group.finish()  # one by one, the capture, its checking replay (which writes nothing), then one by one again
    assert len(calls) == 3 * len(layers) and _Graph.replays == 1
    _assert_quantized(layers)  # nothing the check zeroed is left behind
    calls.clear()
    _load(layers, 2.0)
    group.finish()
    assert len(calls) == len(layers) and _Graph.replays == 1
    _assert_quantized(layers)
