"""policy.compile_layers: every decoder layer runs compiled, and a training step equals the eager one."""

from __future__ import annotations

import pytest
import torch

from dockyard.config import ConfigError, load_config_text
from services.trainer.compiled_layers import compile_decoder_layers
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.policy import PolicyTrainer

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  optimizer: {lr: 0.05, max_grad_norm: null}
  generation: {temperature: 1.0}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4}
"""


def _groups() -> list[TrainingGroup]:
    gen = torch.Generator().manual_seed(3)
    groups = []
    for g in range(2):
        prompt = torch.randint(4, 60, (5 + g,), generator=gen).tolist()
        samples = [
            Sample(
                trajectory_id=f"g{g}/{i}",
                prompt_ids=prompt,
                completion_ids=torch.randint(4, 60, (2 + i,), generator=gen).tolist(),
                generation_logprobs=(-0.5 - torch.rand(2 + i, generator=gen)).tolist(),
                reward=float((i + g) % 2),
                valid=True,
            )
            for i in range(4)
        ]
        groups.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    return groups


def _step(overrides: list[str]) -> tuple[PolicyTrainer, dict[str, float]]:
    policy = PolicyTrainer(load_config_text(CONFIG, overrides))
    # Two minibatches (two optimizer steps, so the second sees ρ ≠ 1), micro-batches of different shapes.
    return policy, policy.train_step(_groups())


def test_compiled_layers_train_as_the_eager_ones() -> None:
    torch._dynamo.reset()
    compiled, got = _step(["policy.compile_layers=true"])
    eager, want = _step([])
    layers = compiled.model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in eager.model.model.layers)
    # Names are the eager model's (no _orig_mod): checkpoints and the weight sync see no difference.
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    # Fused kernels round differently in the last bits (fp32); Adam's first updates are near ±lr whatever
    # a gradient's size, so the weights agree to well below lr (0.05) unless a gradient's sign flipped.
    for key in ("loss", "grad_norm", "clip_fraction", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # k_proj's bias is left out: it adds q·b to every score of a query, which softmax cancels, so its true
    # gradient is zero and what Adam scales up to ±lr is each kernel's rounding noise.
    for (name, a), b in zip(compiled.model.named_parameters(), eager.model.parameters(), strict=True):
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)
    # The step moved the weights: equality above is not two untouched copies of the init.
    start = PolicyTrainer(load_config_text(CONFIG, []))
    assert not torch.equal(next(start.model.parameters()), next(eager.model.parameters()))


def test_a_model_without_a_declared_layer_class_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="compile_layers"):
        compile_decoder_layers(model)


def test_the_jax_backend_refuses_it() -> None:
    with pytest.raises(Exception, match="compile_layers"):
        load_config_text(CONFIG, ["policy.backend=jax", "policy.compile_layers=true"])


def test_compiled_layers_with_lora_adapters_train_as_the_eager_ones() -> None:
    """`auto` compiles a LoRA job's layers on CUDA: the adapters inside compiled layers train as eager ones."""
    torch._dynamo.reset()
    lora = ["policy.lora.enabled=true", "policy.lora.rank=4"]
    compiled, got = _step(["policy.compile_layers=true", *lora])
    _, want = _step(["policy.compile_layers=false", *lora])
    layers = [m for m in compiled.model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(layers) == 2  # the decoder layers, adapters inside them
    for key in ("loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
