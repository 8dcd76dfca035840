"""policy.backend=jax: the Flax NNX trainer takes the torch trainer's step, to 1e-5 in float32 on CPU.

Both backends load the same tiny random-init HF folder (save_pretrained) and train on the same
groups; loss, grad norm, every updated weight (as the weight sync sends it) and the metrics agree.
The JAX loss matches the torch loss option by option; checkpoints resume; bad setups are refused.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from dockyard.algorithms import clipped_pg_loss as torch_loss
from dockyard.config import ConfigError, load_config_text
from dockyard.models.build import build_random_model
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.weights.fingerprint import fingerprint
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.minibatches import loss_options
from services.trainer.policy import PolicyTrainer
from services.trainer.ranks import make_policy
from tests.conftest import missing

if importlib.util.find_spec("flax") is None:
    missing("the jax extra is not installed (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from services.trainer.jax_loss import clipped_pg_loss as jax_loss  # noqa: E402
from services.trainer.jax_policy import JaxPolicyTrainer  # noqa: E402

ARCHITECTURES = {
    # Qwen2: q/k/v biases, grouped-query attention, untied head.
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=1000.0),
    # Llama: tied embeddings, full multi-head attention, another norm eps.
    "llama": dict(num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5),
}

CONFIG = """
policy:
  model_name: {folder}
  train_global_batch_size: {global_batch}
  train_micro_batch_size: 3
  num_epochs: {epochs}
  optimizer: {{lr: 0.002, weight_decay: 0.1, warmup_steps: 2, max_grad_norm: 0.5}}
  generation: {{temperature: 0.8}}
loss_fn: {{kl_penalty: {kl}, is_correction: tis, is_max: 2.0, dual_clip_c: 3.0, reduction: {reduction}}}
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 4}}
"""


def _folder(root: Path, model_type: str) -> Path:
    tokenizer = build_char_tokenizer()
    fields = dict(
        model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, **ARCHITECTURES[model_type],
    )  # fmt: skip
    model = build_random_model(fields, vocab_size=len(tokenizer), seed=0)
    with torch.no_grad():  # random biases, so a dropped bias cannot hide behind zeros
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    folder = root / model_type
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _groups(tokenizer) -> list[TrainingGroup]:
    prompt = tokenizer("f(1)=2 f(x)=")["input_ids"]
    texts = [["2*x", "x+10", "x", "3*x+1"], ["x*x", "7", "x-1+x*2", "1"]]
    rewards = [[1.0, 0.0, 0.5, 0.25], [0.0, 1.0, 0.0, 0.0]]
    groups = []
    for g, (completions, rs) in enumerate(zip(texts, rewards, strict=True)):
        samples = []
        for i, (text, reward) in enumerate(zip(completions, rs, strict=True)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            gen = [-1.0 - 0.1 * k for k in range(len(ids))]
            samples.append(Sample(f"{g}/{i}", list(prompt), ids, gen, reward, valid=(g, i) != (1, 3), weight_version=0))
        groups.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    return groups


def _weights(policy) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy().copy() for name, t in policy.named_weights()}


@pytest.mark.parametrize(
    ("model_type", "global_batch", "epochs", "kl", "reduction"),
    [("qwen2", 8, 1, 0.0, "token"), ("llama", 4, 2, 0.05, "sequence")],
)
def test_one_jax_step_is_the_torch_step(tmp_path, model_type, global_batch, epochs, kl, reduction) -> None:
    folder = _folder(tmp_path, model_type)
    text = CONFIG.format(folder=folder, global_batch=global_batch, epochs=epochs, kl=kl, reduction=reduction)
    config = load_config_text(text)
    reference = PolicyTrainer(config)
    candidate = JaxPolicyTrainer(load_config_text(text + "\n", ["policy.backend=jax"]))
    assert [n for n, _ in candidate.named_weights()] == [n for n, _ in reference.named_weights()]
    assert candidate.num_parameters() == reference.num_parameters()
    # The refit seam: the weight sync's stream (names, order, dtypes, bytes) is the torch backend's.
    assert fingerprint(*(t for _, t in candidate.named_weights())) == fingerprint(
        *(t for _, t in reference.named_weights())
    )
    before = _weights(candidate)
    for name, value in _weights(reference).items():
        np.testing.assert_array_equal(before[name], value, err_msg=name)
    groups = _groups(reference.tokenizer)
    for _ in range(2):  # the second step runs at the warmed-up lr, with Adam's moments in play
        expected, got = reference.train_step(groups), candidate.train_step(groups)
        assert set(got) == set(expected)
        for key in ("loss", "grad_norm", "pg_loss", "kl", "clip_fraction", "ratio_mean", "lr", "entropy"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key
    after = _weights(candidate)
    moved = 0.0
    for name, value in _weights(reference).items():
        np.testing.assert_allclose(after[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
        moved = max(moved, float(np.abs(value - before[name]).max()))
    assert moved > 1e-3  # the steps changed the weights: the comparison is not of two idle models


@pytest.mark.parametrize(
    "options",
    [
        dict(reduction="sequence", dual_clip_c=3.0, is_correction="plain", clip_low=0.1, clip_high=0.3),
        dict(is_correction="tis", is_min=0.5, is_max=1.5, kl_penalty=0.1, kl_type="k1"),
        dict(is_correction="icepop", is_min=0.6, is_max=1.4, kl_penalty=0.1, kl_type="k2", reduction="sequence"),
        dict(is_correction="seq-mask-tis", is_min=0.8, is_max=1.2, kl_penalty=0.1, kl_type="k3", dual_clip_c=2.0),
        # The policy-gradient family (docs/algorithms.md): each objective, with the knobs it reads.
        dict(name="gspo", reduction="sequence", clip_low=0.05, clip_high=0.1, dual_clip_c=3.0, is_correction="plain"),
        dict(name="gspo-token", reduction="token", clip_low=0.05, clip_high=0.1, kl_penalty=0.1),
        dict(name="cispo", clip_low=1.0, clip_high=0.28, is_correction="tis", is_max=2.0, dual_clip_c=None),
        dict(
            name="sapo", reduction="sequence", tau_pos=0.5, tau_neg=2.0, kl_penalty=0.1, kl_type="k2", dual_clip_c=None
        ),
        dict(name="dr-grpo", reduction="constant", length_normaliser=12, clip_high=0.28),
    ],
)
def test_the_jax_loss_and_its_gradient_are_the_torch_ones(options) -> None:
    cfg = load_config_text(CONFIG.format(folder="x", global_batch=8, epochs=1, kl=0.0, reduction="token"))
    cfg = cfg.loss_fn.model_copy(update=options)
    gen = torch.Generator().manual_seed(0)
    lp, old, gen_lp, ref = (-torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3 for _ in range(4))
    adv = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).double()
    mask[4] = 0  # a row with no valid token
    lp[~mask.bool()] = float("nan")  # padding may hold NaN
    kwargs = loss_options(cfg)
    lp_t = lp.float().requires_grad_()
    loss_t, stats_t = torch_loss(
        lp_t, old.float(), adv.float(), mask, generation_logprobs=gen_lp.float(), reference_logprobs=ref.float(),
        **kwargs,
    )  # fmt: skip
    loss_t.backward()

    def f(x):
        return jax_loss(x, *(jnp.asarray(t.float().numpy()) for t in (old, adv, mask, gen_lp, ref)), cfg)

    (loss_j, stats_j), grad_j = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp.float().numpy()))
    assert float(loss_j) == pytest.approx(float(loss_t.detach()), rel=1e-5, abs=1e-6)
    for key, value in stats_j.items():
        assert float(value) == pytest.approx(stats_t[key], rel=1e-5, abs=1e-6), key
    np.testing.assert_allclose(np.asarray(grad_j), lp_t.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert np.abs(lp_t.grad.numpy()).max() > 0


def test_a_jax_checkpoint_resumes_exactly(tmp_path) -> None:
    folder = _folder(tmp_path, "qwen2")
    text = CONFIG.format(folder=folder, global_batch=8, epochs=1, kl=0.0, reduction="token")
    overrides = ["policy.backend=jax", "checkpointing.resume=true", f"checkpointing.checkpoint_dir={tmp_path}"]
    first = JaxPolicyTrainer(load_config_text(text, overrides), checkpoint_dir=tmp_path / "ck")
    groups = _groups(first.tokenizer)
    first.train_step(groups)
    first.save(tmp_path / "ck" / "step-1", data_state="cursor-1")
    expected = first.train_step(groups)
    second = JaxPolicyTrainer(load_config_text(text, overrides), checkpoint_dir=tmp_path / "ck")
    assert (second.weight_version, second.data_state) == (1, "cursor-1")
    # the HF folder is a plain HF checkpoint: transformers loads it under the same names
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "step-1")
    assert {n for n, _ in hf.named_parameters()} == {n for n, _ in second.named_weights()}
    got = second.train_step(groups)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)


def test_the_jax_backend_refuses_what_it_does_not_support(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="policy.lora.enabled is not supported with policy.backend=jax"):
        load_config_text(CONFIG.format(folder="x", global_batch=8, epochs=1, kl=0.0, reduction="token"),
                         ["policy.backend=jax", "policy.lora.enabled=true"])  # fmt: skip
    text = "policy: {backend: jax, model: {model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2}}\n"
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        JaxPolicyTrainer(load_config_text(text))
    # Under torchrun with more than one rank: refused before anything is loaded (no FSDP on this path).
    import services.trainer.jax_policy as jax_policy

    monkeypatch.setattr(jax_policy.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(jax_policy.dist, "get_world_size", lambda: 2)
    with pytest.raises(ConfigError, match="trains on one device; this trainer runs 2 ranks"):
        make_policy(load_config_text(text), "cpu", None)


def test_the_torch_path_never_imports_jax() -> None:
    import subprocess
    import sys

    code = "import sys, services.trainer.servicer; assert 'jax' not in sys.modules and 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
