"""Packed and padded rows through the trainer's attention: the same numbers as one sequence at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from services.trainer import packed_attention
from services.trainer.packed_attention import Segments, forward_kwargs

SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 97,
}
LENGTHS = [5, 9, 4]


def _model(config_class=Qwen2Config, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(**SHAPE, **extra), attn_implementation="sdpa").eval()


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen) for n in LENGTHS]


def _packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, positions


@pytest.mark.parametrize("config_class", [Qwen2Config, LlamaConfig], ids=["qwen2", "llama"])
def test_a_packed_row_gives_each_sequence_its_own_logits(config_class) -> None:
    model = _model(config_class)
    assert packed_attention.install(model) and packed_attention.installed(model)
    seqs = _sequences()
    alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    ids, positions = _packed(seqs)
    segments = Segments.of(LENGTHS)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs(segments, ids))
        # Without the segments the all-ones mask lets later sequences see earlier ones: the test can tell.
        leaky = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False)
        # A caller that passes neither gets transformers' packed-sequence mask: slower, but also right.
        plain = model(input_ids=ids, position_ids=positions, use_cache=False)
    torch.testing.assert_close(packed.logits[0], alone.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.logits[0], alone.detach(), rtol=1e-5, atol=1e-5)
    first = LENGTHS[0]
    torch.testing.assert_close(leaky.logits[0, :first], alone[:first].detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky.logits[0, first:], alone[first:].detach(), atol=1e-3)


def test_packed_gradients_equal_the_unpacked_ones() -> None:
    model = _model()
    packed_attention.install(model)
    seqs = _sequences()
    loss = sum(model(input_ids=s[None], use_cache=False).logits.square().mean() * len(s) for s in seqs)
    loss.backward()
    alone = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ids, positions = _packed(seqs)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs(Segments.of(LENGTHS), ids))
    bounds = Segments.of(LENGTHS).cu_seq_lens.tolist()
    sum(out.logits[0, a:b].square().mean() * (b - a) for a, b in zip(bounds, bounds[1:], strict=False)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, alone[name], rtol=1e-4, atol=1e-6, msg=name)


def test_right_padded_rows_run_without_a_mask_and_keep_their_logits() -> None:
    model = _model()
    packed_attention.install(model)
    seqs = _sequences()
    width = max(LENGTHS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    kwargs = {"batch_size": len(seqs), "q_length": width, "kv_length": width, "device": "cpu"}
    assert packed_attention.packed_attention_mask(attention_mask=mask, **kwargs) is None
    left = mask.flip(-1)  # left padding: the mask is needed, and built
    assert packed_attention.packed_attention_mask(attention_mask=left, **kwargs).shape == (len(seqs), 1, width, width)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for row, s in enumerate(seqs):
            alone = model(input_ids=s[None], use_cache=False).logits[0]
            torch.testing.assert_close(padded[row, : len(s)], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: _model(MistralConfig, sliding_window=4), "sliding window"),
        (lambda: AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), attn_implementation="eager"), "eager"),
    ],
    ids=["sliding-window", "not-sdpa"],
)
def test_models_it_would_change_are_left_alone(make, why) -> None:
    model = make()
    before = model.config._attn_implementation
    assert not packed_attention.install(model), why
    assert model.config._attn_implementation == before
    assert not packed_attention.installed(model)
