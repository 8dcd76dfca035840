"""LoRA (policy.lora): only the adapters train, the reference is the base with adapters off, the rollout
and the checkpoint get merged weights under the plain names, and a few steps learn."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.config import ConfigError, load_config_text
from dockyard.models.load import load_policy
from services.trainer.batch import build_batch
from services.trainer.experience import TrainingGroup
from services.trainer.logprobs import token_logprobs
from services.trainer.lora import is_adapter, plain_name
from services.trainer.policy import PolicyTrainer
from tests.unit.trainer.test_policy import CONFIG, _group

LORA = ["policy.lora.enabled=true", "policy.lora.rank=4", "policy.lora.alpha=8", "policy.optimizer.lr=0.01"]


def lora_policy(*overrides: str) -> PolicyTrainer:
    return PolicyTrainer(load_config_text(CONFIG, [*LORA, "loss_fn.kl_penalty=0.1", *overrides]))


def group(policy: PolicyTrainer) -> TrainingGroup:
    return _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def trained() -> PolicyTrainer:
    """Two steps in: the adapters are no longer zero. The tests below only read it."""
    policy = lora_policy()
    for _ in range(2):
        policy.train_step([group(policy)])
    policy.model.eval()
    return policy


def base_model(policy: PolicyTrainer) -> torch.nn.Module:
    """The job's starting policy, loaded afresh (the same seeded random init)."""
    model, _ = load_policy(policy.config.policy)
    return model.eval()


def logits(model: torch.nn.Module, policy: PolicyTrainer) -> torch.Tensor:
    ids = torch.tensor([policy.tokenizer("f(2)=5 f(x)=2*x+1")["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapters_train() -> None:
    policy = lora_policy()
    named = dict(policy.model.named_parameters())
    frozen = {n: p.detach().clone() for n, p in named.items() if not is_adapter(n)}
    adapters = {n for n in named if is_adapter(n)}
    assert adapters and {id(p) for p in policy.optimizer.param_groups[0]["params"]} == {id(named[n]) for n in adapters}
    metrics = policy.train_step([group(policy)])
    for name, before in frozen.items():
        assert named[name].grad is None and torch.equal(named[name], before), name
    # B starts at zero (the step-0 policy is the base); one step moves every B.
    assert all(named[n].abs().sum() > 0 for n in adapters if ".lora_B." in n)
    norm = torch.linalg.vector_norm(torch.cat([named[n].grad.flatten() for n in adapters]))
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)


def test_the_reference_is_the_base_with_adapters_off(trained: PolicyTrainer) -> None:
    policy = trained
    assert policy.reference is None  # no second copy of the model
    batch = build_batch([group(policy)], policy.tokenizer.pad_token_id)
    with policy._reference_model() as reference:
        ref = token_logprobs(reference, batch, 1.0)
    base = token_logprobs(base_model(policy), batch, 1.0)
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    assert not torch.allclose(token_logprobs(policy.model, batch, 1.0), base, atol=1e-3)  # adapters back on


def test_the_rollout_receives_merged_weights_under_the_plain_names(trained: PolicyTrainer) -> None:
    policy = trained
    sent = dict(policy.named_weights())
    receiver = base_model(policy)  # what a rollout replica holds: the plain model
    assert [(n, p.shape) for n, p in receiver.named_parameters()] == [(n, t.shape) for n, t in sent.items()]
    # peft's own merge (on a copy) agrees with the merge computed for the sync.
    merged = copy.deepcopy(policy.peft).merge_and_unload()
    for name, tensor in merged.named_parameters():
        torch.testing.assert_close(sent[name], tensor.detach(), rtol=0, atol=1e-6, msg=name)
    # The training weights were not touched, and the receiver now computes the trained policy.
    frozen = {plain_name(n): p for n, p in policy.model.named_parameters() if not is_adapter(n)}
    for name, tensor in base_model(policy).named_parameters():
        assert torch.equal(frozen[name], tensor), name
    receiver.load_state_dict(sent, strict=False)
    torch.testing.assert_close(logits(receiver, policy), logits(policy.model, policy), rtol=0, atol=1e-5)


def test_checkpoint_holds_the_adapter_and_a_merged_folder(tmp_path: Path, trained: PolicyTrainer) -> None:
    from peft import PeftModel

    policy = trained
    folder = policy.save(tmp_path / "step-2")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (folder / "adapter").iterdir()}
    expected = logits(policy.model, policy)
    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert merged.num_parameters() == base_model(policy).num_parameters() == policy.num_parameters()
    torch.testing.assert_close(logits(merged, policy), expected, rtol=0, atol=1e-5)
    # peft's own loader reads the adapter onto the base.
    adapted = PeftModel.from_pretrained(base_model(policy), str(folder / "adapter")).eval()
    torch.testing.assert_close(logits(adapted, policy), expected, rtol=0, atol=1e-5)


def test_a_few_steps_learn_the_rewarded_completion() -> None:
    policy = lora_policy("loss_fn.kl_penalty=0", "policy.optimizer.lr=0.02")
    batch = build_batch([group(policy)], policy.tokenizer.pad_token_id)

    def sequence_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return (token_logprobs(policy.model, batch, 1.0) * batch.token_mask).sum(-1)

    before = sequence_logprobs()
    for _ in range(5):
        policy.train_step([group(policy)])
    after = sequence_logprobs()
    # Measured +0.95 nats for the rewarded completion and -1.4 for the others together.
    assert after[0] > before[0] + 0.5
    assert after[1:].sum() < before[1:].sum() - 0.5


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("policy.lora.rank=0", ["policy.lora.rank"]),
        ("policy.lora.dropout=1.0", ["policy.lora.dropout"]),
        ("policy.lora.target_modules=[]", ["policy.lora.target_modules"]),
        ("policy.lora.target_modules=['q_proj; rm']", ["policy.lora.target_modules", "not a module name"]),
    ],
)
def test_bad_lora_settings_fail_validation(override: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(CONFIG, [*LORA, override])
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("targets", "words"),
    [
        ("[no_such_layer]", ["no_such_layer", "not found"]),
        ("[embed_tokens]", ["only nn.Linear", "embed_tokens"]),
        ("[q_proj,lm_head]", ["lm_head", "tied"]),  # the tiny model ties lm_head to the embeddings
    ],
)
def test_targets_that_do_not_fit_the_model_are_refused_at_load(targets: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        lora_policy(f"policy.lora.target_modules={targets}")
    assert "policy.lora.target_modules" in str(info.value)
    for word in words:
        assert word in str(info.value)
