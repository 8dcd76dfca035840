"""dynamic_sampling_mask: exact group selection, and agreement with compute_advantages."""

import itertools

import torch

from dockyard.algorithms import compute_advantages, dynamic_sampling_mask


def test_keeps_whole_groups_whose_valid_rewards_differ():
    # g0 [1, 1, 1] all equal -> drop
    # g1 [1, 0, 1] differ -> keep (all three)
    # g2 [0, 1*, 0] with the 1 invalid -> valid rewards all equal -> drop
    # g3 [1, 0*] one valid sample -> drop
    # g4 [.5, .5, .7, NaN*] differ, invalid NaN ignored -> keep all four, the invalid one included
    rewards = torch.tensor([1, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 0.5, 0.5, 0.7, float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 4])
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    expected = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert torch.equal(dynamic_sampling_mask(rewards, groups, valid), expected)


def test_without_valid_mask_every_sample_counts():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([5, 5, 2, 2])
    assert torch.equal(dynamic_sampling_mask(rewards, groups), torch.tensor([False, False, True, True]))


def test_bfloat16_and_empty_inputs():
    got = dynamic_sampling_mask(torch.tensor([0.1, 0.1, 0.2], dtype=torch.bfloat16), torch.tensor([0, 0, 0]))
    assert torch.equal(got, torch.tensor([True, True, True]))
    assert dynamic_sampling_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_kept_groups_are_exactly_those_with_a_nonzero_advantage():
    # Every group of 3 over rewards {0, .1, 1} with every validity pattern, under every estimator:
    # dropped groups have only zero advantages, kept groups at least one non-zero.
    values = (0.0, 0.1, 1.0)
    rewards, valid = [], []
    for triple in itertools.product(values, repeat=3):
        for pattern in itertools.product((True, False), repeat=3):
            rewards.extend(triple)
            valid.extend(pattern)
    rewards, valid = torch.tensor(rewards), torch.tensor(valid)
    groups = torch.arange(len(rewards)) // 3
    keep = dynamic_sampling_mask(rewards, groups, valid).view(-1, 3)[:, 0]
    for leave_one_out in (True, False):
        for scale in ("group", "batch", "none"):
            advantages = compute_advantages(rewards, groups, valid, leave_one_out=leave_one_out, scale=scale)
            nonzero = (advantages.view(-1, 3) != 0).any(-1)
            assert torch.equal(keep, nonzero), (leave_one_out, scale)
