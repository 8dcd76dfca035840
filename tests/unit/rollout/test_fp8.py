"""FP8 rollouts: the per-row e4m3 quantizer, the FP8 linear layer's numbers (on CPU through torch's
reference _scaled_mm), requantization after a load, and the refusals on hardware without FP8 matmuls."""

from __future__ import annotations

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
    quantize_blocks,
    quantize_groups,
    quantize_rows,
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


def test_block_scales_keep_an_outlier_tile_from_coarsening_its_rows_and_are_laid_out_for_scaled_mm() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    w[:128, :128] *= 1e5  # one tile of outliers, past e4m3's 2^17 range from the rest of their rows
    values, scale = quantize_blocks(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (256, 384)
    assert scale.shape == (3, 2) and scale.is_contiguous()  # [in / 128, out / 128]: wᵀ's 128 x 128 blockwise scale
    back = values.float() * scale.t().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    tiles = (back - w).abs().reshape(2, BLOCK, 3, BLOCK).amax(dim=(1, 3))
    assert (tiles <= 2**-4 * w.abs().reshape(2, BLOCK, 3, BLOCK).amax(dim=(1, 3))).all()  # each within its own range
    rows, row_scale = quantize_rows(w)  # per channel, the outlier sets the scale of rows 0-127 everywhere
    assert (back - w)[:128, 128:].abs().mean() < 0.1 * (rows.float() * row_scale - w)[:128, 128:].abs().mean()
    x = torch.randn(5, 256)
    x[:, 0] *= 1e5
    groups, group_scale = quantize_groups(x)
    assert group_scale.shape == (5, 2) and group_scale.stride() == (1, 5)  # column-major: the 1 x 128 layout
    x_back = groups.float() * group_scale.repeat_interleave(BLOCK, 1)
    assert (x_back - x)[:, 128:].abs().max() <= 2**-4 * x[:, 128:].abs().max()
    with pytest.raises(ValueError, match="multiples of 128"):
        Fp8Linear(nn.Linear(64, 128), block=True)


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
