"""compute_advantages and opd_advantages against hand-computed values."""

import pytest
import torch

from dockyard.algorithms import compute_advantages, opd_advantages

ONE_GROUP = torch.zeros(4, dtype=torch.long)


def adv(rewards, group_ids=ONE_GROUP, valid=None, **kwargs):
    return compute_advantages(torch.tensor(rewards), group_ids, valid, **kwargs)


def test_leave_one_out_group_std_is_the_default():
    # rewards [1, 0, 0, 0]
    # i=0: others [0, 0, 0] -> b = 0, std 0 -> not divided: A = 1
    # i=1: others [1, 0, 0] -> b = 1/3; deviations 2/3, -1/3, -1/3 -> squares sum 6/9,
    #      Bessel var = (6/9)/2 = 1/3, std = 0.5773503 -> A = -0.3333333 / 0.5773513 = -0.5773493
    expected = torch.tensor([1.0, -0.5773493, -0.5773493, -0.5773493])
    torch.testing.assert_close(adv([1.0, 0.0, 0.0, 0.0]), expected, atol=1e-6, rtol=0)


def test_group_mean_baseline_with_group_std():
    # mean 0.25; deviations .75, -.25 x3 -> squares .5625 + 3 * .0625 = .75; Bessel var .75/3 = .25,
    # std .5 -> A = .75/.500001 = 1.499997, -.25/.500001 = -0.499999
    expected = torch.tensor([1.499997, -0.499999, -0.499999, -0.499999])
    got = adv([1.0, 0.0, 0.0, 0.0], leave_one_out=False)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_scale_none_is_the_plain_difference():
    # Dr.GRPO: no division. LOO baselines 0 and 1/3; group mean .25.
    torch.testing.assert_close(adv([1.0, 0.0, 0.0, 0.0], scale="none"), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    torch.testing.assert_close(
        adv([1.0, 0.0, 0.0, 0.0], scale="none", leave_one_out=False), torch.tensor([0.75, -0.25, -0.25, -0.25])
    )


def test_scale_batch_uses_the_std_of_every_valid_reward():
    # groups [1, 0] and [1, 1]; batch rewards [1, 0, 1, 1]: mean .75, squares of deviations
    # .0625 + .5625 + .0625 + .0625 = .75, Bessel var .25, std .5.
    # group means .5 and 1 -> [.5, -.5, 0, 0] / .500001 = [.999998, -.999998, 0, 0]
    # LOO baselines 0, 1, 1, 1 -> [1, -1, 0, 0] / .500001 = [1.999996, -1.999996, 0, 0]
    groups = torch.tensor([0, 0, 1, 1])
    rewards = [1.0, 0.0, 1.0, 1.0]
    torch.testing.assert_close(
        adv(rewards, groups, scale="batch", leave_one_out=False),
        torch.tensor([0.999998, -0.999998, 0.0, 0.0]),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(
        adv(rewards, groups, scale="batch"), torch.tensor([1.999996, -1.999996, 0.0, 0.0]), atol=1e-6, rtol=0
    )


def test_batch_scale_with_a_constant_batch_does_not_divide():
    # Every valid reward equal: batch std 0, so nothing is divided and every advantage is 0.
    got = adv([2.0, 2.0, 2.0, 2.0], torch.tensor([0, 0, 1, 1]), scale="batch")
    assert torch.equal(got, torch.zeros(4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("value", [0.3, 0.9, 1.0, -3.7])
def test_all_equal_group_is_exactly_zero(scale, leave_one_out, value):
    # In float32 the sum of six or seven 0.3s (or 0.9s) divided by the count is not 0.3 (0.9):
    # a computed mean leaves a rounding residue, which must not survive as an advantage.
    rewards = torch.tensor([value] * 7 + [1.0, 0.0])
    groups = torch.tensor([0] * 7 + [1, 1])
    got = compute_advantages(rewards, groups, scale=scale, leave_one_out=leave_one_out)
    assert torch.equal(got[:7], torch.zeros(7))
    assert (got[7:] != 0).all()


def test_baseline_rewards_all_equal_are_never_divided_by_a_rounding_std():
    # LOO, rewards [0.7, 0.3, 0.3, 0.3]: sample 0's others are all 0.3 -> std 0, A = 0.4 exactly
    # (up to float32 representation), not 0.4 / (rounding noise + 1e-6).
    # samples 1..3: others [0.7, 0.3, 0.3] -> b = 1.3/3 = .4333333, deviations .2666667,
    # -.1333333 x2, squares .0711111 + 2 * .0177778 = .1066667, var .0533333, std .2309401
    # -> A = -.1333333 / .2309411 = -0.5773478
    got = adv([0.7, 0.3, 0.3, 0.3])
    torch.testing.assert_close(got, torch.tensor([0.4, -0.5773478, -0.5773478, -0.5773478]), atol=2e-6, rtol=0)


def test_invalid_samples_are_excluded_and_get_zero_even_with_nan_reward():
    # valid part [1, 0, 0] (sample 2 invalid, reward NaN from a crashed sandbox)
    # i=0: others [0, 0] -> A = 1 undivided; i=1: others [1, 0] -> b .5, Bessel std
    # sqrt(.5/1) = .7071068 -> A = -.5 / .7071078 = -0.7071058; invalid -> 0
    valid = torch.tensor([True, True, False, True])
    got = adv([1.0, 0.0, float("nan"), 0.0], valid=valid)
    torch.testing.assert_close(got, torch.tensor([1.0, -0.7071058, 0.0, -0.7071058]), atol=1e-6, rtol=0)


def test_groups_with_at_most_one_valid_sample_get_zero():
    # group 0: one valid + one invalid; group 1: a single sample; group 2: [1, 0] is untouched.
    rewards = torch.tensor([3.0, 2.0, 5.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 2, 2])
    valid = torch.tensor([True, False, True, True, True])
    for loo in (True, False):
        got = compute_advantages(rewards, groups, valid, leave_one_out=loo, scale="none")
        assert torch.equal(got[:3], torch.zeros(3))
    # LOO on [1, 0]: each baseline is the other reward.
    assert torch.equal(compute_advantages(rewards, groups, valid, scale="none")[3:], torch.tensor([1.0, -1.0]))


def test_leave_one_out_with_two_valid_samples_is_unscaled():
    # Each sample's baseline is one reward, whose std is taken as 0: A = +-(r1 - r2), undivided.
    # Without LOO: mean .5, Bessel std sqrt(.5) = .7071068 -> .5 / .7071078 = 0.7071058
    groups = torch.zeros(2, dtype=torch.long)
    assert torch.equal(adv([1.0, 0.0], groups), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(
        adv([1.0, 0.0], groups, leave_one_out=False), torch.tensor([0.7071058, -0.7071058]), atol=1e-6, rtol=0
    )


def test_interleaved_non_contiguous_group_ids_keep_sample_order():
    # group 7: [1, 0] mean .5 -> [.5, -.5]; group 3: [2, 4] mean 3 -> [-1, 1]
    got = adv([1.0, 2.0, 0.0, 4.0], torch.tensor([7, 3, 7, 3]), scale="none", leave_one_out=False)
    assert torch.equal(got, torch.tensor([0.5, -1.0, -0.5, 1.0]))


def test_unequal_group_sizes():
    # group 0 size 3 [3, 0, 0] LOO none -> [3, -1.5, -1.5]; group 1 size 1 -> [0]
    got = adv([3.0, 0.0, 0.0, 9.0], torch.tensor([0, 0, 0, 1]), scale="none")
    assert torch.equal(got, torch.tensor([3.0, -1.5, -1.5, 0.0]))


def test_eps_is_added_to_the_std():
    # LOO group [1, 0, 0]: sample 1's others [1, 0] have std .7071068; eps .2929932 makes the divisor 1
    got = adv([1.0, 0.0, 0.0], torch.zeros(3, dtype=torch.long), eps=1 - 0.70710678)
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    # [1, 0, 0, 0] is exact in every dtype; results as in test_leave_one_out_group_std_is_the_default.
    got = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=dtype), ONE_GROUP)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(
        got.double(), torch.tensor([1.0, -0.5773493, -0.5773493, -0.5773493], dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_empty_batch():
    got = compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert got.shape == (0,)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale"):
        adv([1.0, 0.0, 0.0, 0.0], scale="global")
    with pytest.raises(ValueError, match="group_ids"):
        adv([1.0, 0.0, 0.0, 0.0], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="valid"):
        adv([1.0, 0.0, 0.0, 0.0], valid=torch.ones(2, dtype=torch.bool))


def test_opd_advantages_is_detached_teacher_minus_student_and_zero_when_masked():
    teacher = torch.tensor([[-1.0, -2.0, float("-inf")]])
    student = torch.tensor([[-1.5, -1.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    got = opd_advantages(teacher, student, mask)
    # -1 - (-1.5) = .5; -2 - (-1) = -1; the padded -inf position is 0, not -inf or NaN
    assert torch.equal(got, torch.tensor([[0.5, -1.0, 0.0]]))
    assert not got.requires_grad


def test_opd_advantages_shape_mismatch_raises():
    with pytest.raises(ValueError):
        opd_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
