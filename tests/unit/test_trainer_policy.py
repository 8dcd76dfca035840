"""The trainer's GRPO step: batch layout, micro-batch invariance, learning direction, atomic saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockyard.common.v1 import common_pb2
from dockyard.config import load_config_text
from services.trainer.batch import build_batch
from services.trainer.policy import PolicyTrainer, token_logprobs

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 4
  train_micro_batch_size: 4
  optimizer: {lr: 0.002, max_grad_norm: null}
  generation: {temperature: 1.0}
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4}
"""


def _group(policy: PolicyTrainer, completions: list[str], rewards: list[float], valid=None) -> common_pb2.Group:
    tok = policy.tokenizer
    prompt = tok("f(1)=2 f(x)=")["input_ids"]
    trajectories = []
    for i, (text, reward) in enumerate(zip(completions, rewards, strict=True)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        trajectories.append(
            common_pb2.Trajectory(
                trajectory_id=f"g/{i}",
                prompt_token_ids=prompt,
                completion_token_ids=ids,
                completion_logprobs=[-1.0] * len(ids),
                weight_version=0,
                reward=reward,
                valid=True if valid is None else valid[i],
            )
        )
    return common_pb2.Group(group_id="g", job_id="j", weight_version=0, trajectories=trajectories)


@pytest.fixture
def policy() -> PolicyTrainer:
    return PolicyTrainer(load_config_text(CONFIG))


def test_batch_masks_exactly_the_completion_tokens(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+1"], [1.0, 0.0])
    batch = build_batch([group], policy.tokenizer.pad_token_id)
    prompt_len = len(group.trajectories[0].prompt_token_ids)
    row = batch.token_mask[0]
    assert row[: prompt_len - 1].sum() == 0
    assert row.sum() == 3
    # position t scores token t+1: the masked targets are the completion ids
    targets = batch.input_ids[0, 1:][row.bool()].tolist()
    assert targets == list(group.trajectories[0].completion_token_ids)


def test_micro_batching_does_not_change_the_gradient(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+10", "x", "3*x+1"], [1.0, 0.0, 0.5, 0.25])
    grads = []
    for micro in (4, 1):
        p = PolicyTrainer(load_config_text(CONFIG, [f"policy.train_micro_batch_size={micro}"]))
        p.accumulate_gradients([group])
        grads.append(torch.cat([q.grad.flatten() for q in p.model.parameters() if q.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_a_step_raises_the_likelihood_of_the_rewarded_completion(policy: PolicyTrainer) -> None:
    group = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 0.0])
    batch = build_batch([group], policy.tokenizer.pad_token_id)

    def seq_logprob(row: int) -> float:
        with torch.no_grad():
            lp = token_logprobs(policy.model, batch.slice(row, row + 1), 1.0)
        return float((lp * batch.token_mask[row : row + 1]).sum())

    before = [seq_logprob(i) for i in range(4)]
    metrics = policy.train_step([group])
    after = [seq_logprob(i) for i in range(4)]
    assert after[0] > before[0]
    assert sum(after[1:]) < sum(before[1:])
    assert policy.weight_version == 1 and metrics["weight_version"] == 1.0
    for key in (
        "loss",
        "pg_loss",
        "grad_norm",
        "lr",
        "clip_fraction",
        "gen_train_logprob_abs_diff",
        "tokens_per_second",
    ):
        assert key in metrics


def test_invalid_trajectories_carry_no_gradient(policy: PolicyTrainer) -> None:
    # The invalid sample has a wildly different reward; masking it must leave the step unchanged.
    a = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 0.0], valid=[True, True, True, False])
    b = _group(policy, ["2*x", "x+9", "x*x", "7"], [1.0, 0.0, 0.0, 99.0], valid=[True, True, True, False])
    grads = []
    for group in (a, b):
        p = PolicyTrainer(load_config_text(CONFIG))
        p.accumulate_gradients([group])
        grads.append(torch.cat([q.grad.flatten() for q in p.model.parameters() if q.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_no_reference_model_without_kl(policy: PolicyTrainer) -> None:
    assert policy.reference is None
    with_kl = PolicyTrainer(load_config_text(CONFIG, ["loss_fn.kl_penalty=0.1"]))
    assert with_kl.reference is not None
    assert not any(p.requires_grad for p in with_kl.reference.parameters())


def test_save_writes_a_folder_from_pretrained_loads(policy: PolicyTrainer, tmp_path: Path) -> None:
    out = policy.save(tmp_path / "step-0")
    assert not list(tmp_path.glob(".*tmp*"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(policy.model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
