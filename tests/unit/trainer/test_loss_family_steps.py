"""Trainer steps under every loss_fn.name and advantage estimator: the gradient does not depend on how the
minibatch is cut into micro-batches (or packed), and the step reports gate and ratio statistics."""

from __future__ import annotations

import math

import pytest
import torch

from dockyard.config import load_config_text
from dockyard.config.choices import LOSS_NAMES
from services.trainer.policy import PolicyTrainer
from tests.unit.trainer.test_minibatches import CONFIG, _groups

# The shared tiny setup without its loss_fn line, so each preset fills its own knobs.
BARE = CONFIG.replace("loss_fn: {clip_low: 0.2, clip_high: 0.2}\n", "")
# Every objective and preset, and the per-token advantages of REINFORCE++ (RLOO's are per row, as GRPO's).
CASES = [[f"loss_fn.name={name}"] for name in LOSS_NAMES] + [["grpo.adv_estimator.name=reinforce++"]]
# The objectives (dapo and dr-grpo compute GRPO's), for the off-policy statistics.
OBJECTIVES = [case for case in CASES if case[0].split("=")[1] not in ("dapo", "dr-grpo")]
PACKED = ["policy.sequence_packing=true", "policy.max_tokens_per_micro_batch=40"]


def _gradient(overrides: list[str]) -> torch.Tensor:
    """The gradient of one minibatch of all 8 trajectories (no update)."""
    policy = PolicyTrainer(load_config_text(BARE, ["policy.train_global_batch_size=8", *overrides]))
    policy.accumulate_gradients(_groups())
    return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])


def _ids(overrides: list[str]) -> str:
    return overrides[0].split("=")[1]


@pytest.mark.parametrize("overrides", CASES, ids=_ids)
def test_micro_batching_leaves_the_gradient_unchanged(overrides) -> None:
    whole = _gradient(overrides)
    torch.testing.assert_close(_gradient([*overrides, "policy.train_micro_batch_size=1"]), whole, rtol=1e-4, atol=1e-7)
    assert whole.abs().max() > 1e-4


@pytest.mark.parametrize("overrides", [["loss_fn.name=cispo"], ["grpo.adv_estimator.name=reinforce++"]], ids=_ids)
def test_packed_rows_give_the_padded_gradient(overrides) -> None:
    torch.testing.assert_close(_gradient([*overrides, *PACKED]), _gradient(overrides), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("overrides", OBJECTIVES, ids=_ids)
def test_an_off_policy_step_reports_gate_and_ratio_statistics(overrides) -> None:
    # Two minibatches: the second sees ρ ≠ 1, so clips and gates act.
    metrics = PolicyTrainer(load_config_text(BARE, overrides)).train_step(_groups())
    assert math.isfinite(metrics["loss"]) and metrics["optimizer_steps"] == 2
    assert 0 <= metrics["gate_mean"] <= 1
    assert 0 < metrics["ratio_min"] < metrics["ratio_max"]
    assert metrics["ratio_min"] <= metrics["ratio_mean"] <= metrics["ratio_max"]


def _weights_after(overrides: list[str], steps: int) -> torch.Tensor:
    policy = PolicyTrainer(load_config_text(BARE, ["policy.optimizer.lr=0.01", *overrides]))
    for _ in range(steps):
        policy.train_step(_groups())
    return torch.cat([p.detach().flatten() for p in policy.model.parameters()])


def test_the_kl_in_reward_acts_once_the_policy_left_the_reference() -> None:
    kl = ["grpo.adv_estimator.name=reinforce++", "grpo.adv_estimator.kl_in_reward=2.0"]
    plain = kl[:1]
    # Step 1: π_old is π_ref, every KL is 0, the update is REINFORCE++'s without it.
    torch.testing.assert_close(_weights_after(kl, 1), _weights_after(plain, 1), rtol=1e-5, atol=1e-7)
    # Step 2: the policy moved, the tokens pay their KL and the update differs.
    assert not torch.allclose(_weights_after(kl, 2), _weights_after(plain, 2), rtol=1e-4, atol=1e-6)
