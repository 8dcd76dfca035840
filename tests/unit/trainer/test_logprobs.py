"""Chunked logprobs and entropy equal the full-logits computation, values and gradients, without the full logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from services.trainer import logprobs as lp_module
from services.trainer.logprobs import ChunkedHeadLogprobs, full_logits_logprobs, sampled_logprobs


def _model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize(("tied", "temperature"), [(True, 0.7), (False, 1.0)])
def test_chunked_equals_full_logits_in_values_and_gradients(monkeypatch, tied: bool, temperature: float) -> None:
    model = _model(tied)
    # Chunks of 5 positions over 97 tokens of vocabulary: many chunks, the last one partial.
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 5 * 97)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    weights = torch.randn(3, 11, generator=torch.Generator().manual_seed(2))

    results = []
    for compute in (full_logits_logprobs, sampled_logprobs):
        model.zero_grad()
        logprobs, entropy = compute(model, ids, mask, None, temperature, True)
        (logprobs * weights).sum().backward()
        head = model.get_output_embeddings().weight.grad.clone()
        body = model.model.layers[0].mlp.up_proj.weight.grad.clone()
        results.append((logprobs.detach(), entropy, head, body))
    for full, chunked in zip(*results, strict=True):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    assert results[1][1].min() > 0  # a real entropy, not zeros


def test_scored_positions_only_are_computed_and_agree() -> None:
    model = _model(True)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    scored = torch.zeros(2, 9, dtype=torch.bool)
    scored[0, 4:] = True
    scored[1, 2:6] = True
    full, full_ent = full_logits_logprobs(model, ids, None, None, 1.0, True)
    part, part_ent = sampled_logprobs(model, ids, None, None, 1.0, True, scored=scored)
    torch.testing.assert_close(part[scored], full[scored].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_ent[scored], full_ent[scored], rtol=1e-5, atol=1e-6)
    assert (part[~scored] == 0).all()


def test_the_gradients_of_hidden_states_and_head_weight_match_autograd_of_the_plain_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(13, 8, generator=gen, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=gen)
    upstream = torch.randn(13, generator=gen)

    logits = (hidden @ weight.T).float() / 0.5
    reference = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_grads = torch.autograd.grad((reference * upstream).sum(), (hidden, weight))
    probs = torch.softmax(logits, -1)
    ref_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)

    old = lp_module.CHUNK_ELEMENTS
    lp_module.CHUNK_ELEMENTS = 4 * 50  # chunks of 4 positions
    try:
        out, entropy = ChunkedHeadLogprobs.apply(hidden, weight, targets, 0.5, True)
    finally:
        lp_module.CHUNK_ELEMENTS = old
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_full_logits_tensor_is_built(monkeypatch) -> None:
    """The largest float tensor the chunked path allocates is one chunk of logits, not [tokens, vocab]."""
    model = _model(True)
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 4 * 97)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    largest = 0

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                # [positions, vocab] values (the head's weight, [vocab, hidden] or transposed, aside)
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == 97 and 32 not in t.shape:
                    largest = max(largest, t.numel())
            return out

    with Watch():
        logprobs, _ = sampled_logprobs(model, ids, None, None, 1.0, True)
        logprobs.sum().backward()
    assert 0 < largest <= 4 * 97 < 2 * 19 * 97
