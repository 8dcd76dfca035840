"""RLOO and REINFORCE++ against second implementations written from their papers' equations.

RLOO (Ahmadian et al. 2024, "Back to Basics"): A_i = r_i − 1/(k−1) Σ_{j≠i} r_j. REINFORCE++ (arXiv
2501.03262): the reward at the last token, −β·KL per token, the return to go (γ = 1), normalised
with the batch's mean and std; REINFORCE++-baseline subtracts the group mean first.
"""

from __future__ import annotations

import math

import pytest
import torch

from dockyard.algorithms import compute_advantages, reinforce_pp_advantages, rloo_advantages


def rloo_reference(rewards: list[float], groups: list[int], valid: list[bool]) -> list[float]:
    out = []
    for i, (r, g, v) in enumerate(zip(rewards, groups, valid, strict=True)):
        others = [rewards[j] for j in range(len(rewards)) if j != i and groups[j] == g and valid[j]]
        out.append(r - sum(others) / len(others) if v and others else 0.0)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_rloo_is_the_leave_one_out_mean(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(12, generator=gen).round(decimals=1)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
    valid = torch.rand(12, generator=gen) > 0.2
    got = rloo_advantages(rewards, groups, valid)
    want = rloo_reference(rewards.tolist(), groups.tolist(), valid.tolist())
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)


def test_rloo_is_the_scaled_mean_baseline():
    # With k valid samples, r_i − mean_{j≠i} r_j = k/(k−1) · (r_i − mean_j r_j).
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.zeros(4, dtype=torch.long)
    mean = compute_advantages(rewards, groups, leave_one_out=False, scale="none")
    torch.testing.assert_close(rloo_advantages(rewards, groups), mean * 4 / 3)


def reinforce_pp_reference(rewards, mask, valid, kl=None, beta=0.0, eps=1e-6):
    """G_t = r − β Σ_{s≥t} KL_s over each row's valid tokens, then (G − μ)/(σ + eps) over the batch's tokens."""
    returns = {}
    for i in range(len(rewards)):
        if not valid[i]:
            continue
        tokens = [t for t in range(len(mask[i])) if mask[i][t]]
        for k, t in enumerate(tokens):
            penalty = sum(kl[i][s] for s in tokens[k:]) if kl is not None else 0.0
            returns[i, t] = rewards[i] - beta * penalty
    values = list(returns.values())
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    out = [[0.0] * len(mask[0]) for _ in mask]
    for (i, t), g in returns.items():
        out[i][t] = (g - mean) / (std + eps) if std > 0 else 0.0
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reinforce_pp_is_the_normalised_return_to_go(seed, beta):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(6, generator=gen)
    mask = torch.rand(6, 7, generator=gen) > 0.3
    valid = torch.tensor([True, True, False, True, True, True])
    kl = torch.randn(6, 7, generator=gen) * 0.1
    got = reinforce_pp_advantages(rewards, mask, valid, kl=kl, kl_coef=beta)
    want = reinforce_pp_reference(rewards.tolist(), mask.tolist(), valid.tolist(), kl.tolist(), beta)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)
    tokens = mask & valid[:, None]
    assert got[tokens].mean().abs() < 1e-5
    assert got[tokens].std(unbiased=False) == pytest.approx(1.0, abs=1e-4)
    assert (got[~tokens] == 0).all()


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 3, dtype=torch.bool)
    centred = compute_advantages(rewards, groups, leave_one_out=False, scale="none")
    got = reinforce_pp_advantages(centred, mask)
    want = reinforce_pp_reference(centred.tolist(), mask.tolist(), [True] * 6)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    assert (got[3:] == got[3, 0]).all()  # the flat group: one value, its tokens' normalised 0


def test_reinforce_pp_of_equal_returns_is_exactly_zero():
    got = reinforce_pp_advantages(torch.full((4,), 0.7), torch.ones(4, 5, dtype=torch.bool))
    assert (got == 0).all()
