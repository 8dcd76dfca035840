"""Reward shaping helpers against hand-computed values."""

import pytest
import torch

from dockyard.algorithms import apply_integrity, invalid_action_penalty, overlong_penalty, scale_rewards

LENGTHS = torch.tensor([0, 6, 7, 8, 10, 11, 100])


def test_overlong_penalty_is_linear_across_the_buffer():
    # max 10, buffer 4 -> the buffer starts after 6 tokens:
    # 0 and 6 -> 0; 7 -> -1/4; 8 -> -2/4; 10 -> -4/4; beyond max -> -1
    got = overlong_penalty(LENGTHS, max_response_length=10, buffer_length=4)
    assert torch.equal(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))


def test_overlong_penalty_scales_with_penalty():
    got = overlong_penalty(LENGTHS, 10, 4, penalty=0.5)
    assert torch.equal(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5]))


def test_overlong_penalty_without_buffer_is_a_step_past_max():
    got = overlong_penalty(LENGTHS, 10, 0)
    assert torch.equal(got, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]))


def test_overlong_penalty_full_buffer_starts_at_zero_length():
    # buffer = max = 4: 1 -> -1/4, 2 -> -2/4
    got = overlong_penalty(torch.tensor([0, 1, 2, 4]), 4, 4)
    assert torch.equal(got, torch.tensor([0.0, -0.25, -0.5, -1.0]))


@pytest.mark.parametrize("max_len, buffer, penalty", [(10, 11, 1.0), (10, -1, 1.0), (0, 0, 1.0), (10, 4, -1.0)])
def test_overlong_penalty_bad_arguments(max_len, buffer, penalty):
    with pytest.raises(ValueError):
        overlong_penalty(LENGTHS, max_len, buffer, penalty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_integrity_zeroes_touched_samples_whatever_their_reward(dtype):
    rewards = torch.tensor([1.0, 0.5, -1.0, 1.0], dtype=dtype)
    touched = torch.tensor([True, False, True, False])
    got = apply_integrity(rewards, touched)
    assert got.dtype == dtype
    assert torch.equal(got, torch.tensor([0.0, 0.5, 0.0, 1.0], dtype=dtype))
    assert rewards[0] == 1.0  # input untouched


def test_invalid_action_penalty_subtracts_from_invalid_samples_only():
    # 1 stays; 0 - .5 = -.5; .5 - .5 = 0
    got = invalid_action_penalty(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 1, 1]), 0.5)
    assert torch.equal(got, torch.tensor([1.0, -0.5, 0.0]))


def test_shaping_order_keeps_cheaters_below_honest_failures():
    # verdict 1 but touched a protected test, and overlong by half the buffer:
    # integrity -> 0, then overlong -.5 -> -.5; an honest failure of normal length stays 0.
    rewards = apply_integrity(torch.tensor([1.0, 0.0]), torch.tensor([True, False]))
    rewards = rewards + overlong_penalty(torch.tensor([8, 3]), 10, 4)
    assert torch.equal(rewards, torch.tensor([-0.5, 0.0]))


def test_scale_rewards_clamps_then_maps_linearly():
    # source [0, 1] -> target [-1, 1]: clamp [-.5, 0, .25, 1, 2] to [0, 0, .25, 1, 1],
    # then -1 + 2r: [-1, -1, -.5, 1, 1]
    got = scale_rewards(torch.tensor([-0.5, 0.0, 0.25, 1.0, 2.0]), 0.0, 1.0, -1.0, 1.0)
    assert torch.equal(got, torch.tensor([-1.0, -1.0, -0.5, 1.0, 1.0]))


def test_scale_rewards_non_unit_source():
    # source [2, 6] -> target [0, 1]: (r - 2) / 4 -> 3 -> .25, 5 -> .75
    got = scale_rewards(torch.tensor([3.0, 5.0]), 2.0, 6.0, 0.0, 1.0)
    assert torch.equal(got, torch.tensor([0.25, 0.75]))


def test_scale_rewards_empty_source_range_raises():
    with pytest.raises(ValueError, match="source_max"):
        scale_rewards(torch.zeros(2), 1.0, 1.0, 0.0, 1.0)


def test_shape_mismatches_raise():
    with pytest.raises(ValueError):
        apply_integrity(torch.zeros(3), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError):
        invalid_action_penalty(torch.zeros(3), torch.zeros(2, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError):
        invalid_action_penalty(torch.zeros(3), torch.zeros(3, dtype=torch.bool), -1.0)
