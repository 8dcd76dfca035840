"""Minibatches and epochs: π_old is the policy that starts the step, so later updates see ρ ≠ 1 and the clip binds."""

from __future__ import annotations

import copy

import pytest
import torch

from dockyard.config import load_config_text
from services.trainer import policy as policy_module
from services.trainer.batch import minibatch_rows
from services.trainer.experience import Sample, TrainingGroup
from services.trainer.logprobs import sampled_logprobs
from services.trainer.policy import PolicyTrainer

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64}
  train_global_batch_size: 4
  train_micro_batch_size: 4
  optimizer: {lr: 0.05, max_grad_norm: null}
  generation: {temperature: 1.0}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4}
loss_fn: {clip_low: 0.2, clip_high: 0.2}
"""


def _groups() -> list[TrainingGroup]:
    gen = torch.Generator().manual_seed(11)
    groups = []
    for g in range(2):
        prompt = torch.randint(4, 60, (6,), generator=gen).tolist()
        samples = []
        for i in range(4):
            completion = torch.randint(4, 60, (3 + i,), generator=gen).tolist()
            samples.append(
                Sample(
                    trajectory_id=f"g{g}/{i}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    generation_logprobs=(-0.5 - torch.rand(len(completion), generator=gen)).tolist(),
                    reward=float((i + g) % 2),
                    valid=True,
                )
            )
        groups.append(TrainingGroup(group_id=f"g{g}", samples=samples))
    return groups


def _step(overrides: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
    policy = PolicyTrainer(load_config_text(CONFIG, overrides))
    metrics = policy.train_step(_groups())
    return torch.cat([p.detach().flatten() for p in policy.model.parameters()]), metrics


def test_minibatches_hold_whole_groups_in_order() -> None:
    groups = _groups()
    assert minibatch_rows(groups, 4) == [slice(0, 4), slice(4, 8)]
    assert minibatch_rows(groups, 8) == [slice(0, 8)]
    assert minibatch_rows(groups, 2) == [slice(0, 4), slice(4, 8)]  # a group is never split


def test_the_clip_range_changes_the_update_only_with_more_than_one_minibatch() -> None:
    tight = ["loss_fn.clip_low=0.001", "loss_fn.clip_high=0.001"]
    # One minibatch of all 8 trajectories: ρ = 1, so any clip range gives the same update.
    one_wide, one = _step(["policy.train_global_batch_size=8"])
    one_tight, _ = _step(["policy.train_global_batch_size=8", *tight])
    assert torch.equal(one_wide, one_tight)
    assert one["num_minibatches"] == 1 and one["optimizer_steps"] == 1 and one["clip_fraction"] == 0
    # Two minibatches: the second sees ρ ≠ 1 and the clip range matters.
    two_wide, _ = _step([])
    two_tight, two = _step(tight)
    assert not torch.allclose(two_wide, two_tight)
    assert two["num_minibatches"] == 2 and two["optimizer_steps"] == 2
    assert two["clip_fraction"] > 0 and two["weight_version"] == 1


def test_old_logprobs_are_the_starting_policys_and_the_is_weight_uses_generation_logprobs(monkeypatch) -> None:
    policy = PolicyTrainer(
        load_config_text(CONFIG, ["policy.num_epochs=2", "loss_fn.is_correction=plain", "loss_fn.kl_penalty=0.0"])
    )
    start = copy.deepcopy(policy.model)
    seen: list = []
    calls: list[tuple] = []
    take_logprobs, loss_fn = policy._logprobs, policy_module.clipped_pg_loss

    def record_micro_batch(model, mb, entropy):
        seen.append(mb)
        return take_logprobs(model, mb, entropy)

    def record_loss(logprobs, old, advantages, mask, **kwargs):
        loss, stats = loss_fn(logprobs, old, advantages, mask, **kwargs)
        calls.append((seen[-1], logprobs.detach(), old, kwargs["generation_logprobs"], stats))
        return loss, stats

    monkeypatch.setattr(policy, "_logprobs", record_micro_batch)
    monkeypatch.setattr(policy_module, "clipped_pg_loss", record_loss)
    metrics = policy.train_step(_groups())

    assert len(calls) == 4 and metrics["optimizer_steps"] == 4 and policy.weight_version == 1
    for k, (mb, logprobs, old, generation, stats) in enumerate(calls):
        m = mb.token_mask.bool()
        with torch.no_grad():
            fresh, _ = sampled_logprobs(start, mb.input_ids, mb.attention_mask, None, 1.0, False)
        torch.testing.assert_close(old[m], fresh[m], rtol=1e-5, atol=1e-6)
        assert torch.equal(generation, mb.generation_logprobs)
        want = torch.exp(old[m] - generation[m]).mean()
        assert stats["is_weight_mean"] == pytest.approx(float(want), rel=1e-5)
        if k > 0:  # every update after the first trains a policy that moved: ρ ≠ 1
            assert (logprobs[m] - old[m]).abs().max() > 1e-4
        else:
            torch.testing.assert_close(logprobs[m], old[m], rtol=1e-5, atol=1e-6)
