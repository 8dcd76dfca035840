"""On CUDA: packed rows through the varlen flash kernel equal the rows run one at a time (bf16)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from services.trainer import packed_attention
from services.trainer.packed_attention import Segments, forward_kwargs

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": 1000,
}


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-weights", "fp32-weights-bf16-autocast"])
def test_varlen_packed_row_matches_the_sequences_alone(autocast: bool) -> None:
    assert torch.cuda.is_available()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), attn_implementation="sdpa")
    model = model.to("cuda", torch.float32 if autocast else torch.bfloat16)
    assert packed_attention.install(model)
    context = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        _compare(model)


def _compare(model) -> None:
    lengths = [300, 17, 513, 128]
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), device="cuda") for n in lengths]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    segments = Segments.of(lengths).to("cuda")
    assert packed_attention.varlen_attn is not None
    calls = []
    kernel = packed_attention.varlen_attn

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    packed_attention.varlen_attn = counted
    try:
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs(segments, ids))
    finally:
        packed_attention.varlen_attn = kernel
    assert len(calls) == SHAPE["num_hidden_layers"]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]).float()
    packed = out.logits[0].float()
    # bf16 rounding of two kernels (varlen flash against SDPA's causal kernel): small against the logits' scale.
    err = (packed - alone).abs().max() / alone.abs().max()
    assert err < 2e-2, float(err)
    out.logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_a_default_bf16_job_on_cuda_trains_compiled_and_packed() -> None:
    """`auto` compile and packing (services/trainer/auto_settings.py) turn on for a CUDA bf16 trainer with
    a token budget, and its step equals the eager padded step's to bf16 rounding."""
    from dockyard.config import load_config_text
    from services.trainer.experience import Sample, TrainingGroup
    from services.trainer.policy import PolicyTrainer

    fields = ", ".join(f"{k}: {v}" for k, v in SHAPE.items())
    text = f"""
policy:
  model: {{model_type: qwen2, {fields}}}
  dtype: bfloat16
  train_global_batch_size: 8
  train_micro_batch_size: 8
  max_tokens_per_micro_batch: 1024
  optimizer: {{lr: 1.0e-5, max_grad_norm: null}}
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 4}}
"""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        prompt = torch.randint(4, 1000, (40 + 30 * g,), generator=gen).tolist()
        samples = []
        for i in range(4):
            n = int(torch.randint(20, 200, (), generator=gen))
            samples.append(
                Sample(
                    trajectory_id=f"g{g}/{i}",
                    prompt_ids=prompt,
                    completion_ids=torch.randint(4, 1000, (n,), generator=gen).tolist(),
                    generation_logprobs=(-torch.rand(n, generator=gen) * 4).tolist(),
                    reward=float(i % 2),
                    valid=True,
                )
            )
        groups.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    torch.manual_seed(0)
    auto = PolicyTrainer(load_config_text(text), "cuda")
    assert auto.compiled and auto.packing
    torch.manual_seed(0)
    plain = PolicyTrainer(
        load_config_text(text, ["policy.compile_layers=false", "policy.sequence_packing=false"]), "cuda"
    )
    assert not plain.compiled and not plain.packing
    got, want = auto.train_step(groups), plain.train_step(groups)
    # The π_old pass of both (the entropy, the gap to the recorded logprobs) agrees to bf16 rounding.
    for key in ("entropy", "gen_train_logprob_abs_diff"):
        assert got[key] == pytest.approx(want[key], rel=2e-2), key
