"""kl_estimate and clipped_pg_loss against hand-computed values, closed-form gradients and gradcheck."""

import math

import pytest
import torch

from dockyard.algorithms import clipped_pg_loss, kl_estimate

E = math.e
INF = float("inf")
NAN = float("nan")


def close(actual, expected, atol=1e-6):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- kl_estimate

LP = torch.zeros(3)
REF = torch.tensor([0.0, 1.0, -1.0])  # log r = ref - lp = [0, 1, -1]


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", [0.0, -1.0, 1.0]),  # -log r
        ("k2", [0.0, 0.5, 0.5]),  # (log r)^2 / 2
        ("k3", [0.0, E - 2, 1 / E]),  # e^x - 1 - x: e - 2 = .7182818, e^-1 - 1 + 1 = .3678794
    ],
)
def test_kl_estimators(kl_type, expected):
    close(kl_estimate(LP, REF, kl_type), expected)


def test_k3_is_the_default():
    close(kl_estimate(LP, REF), [0.0, 0.7182818, 0.3678794])


def test_kl_clamps():
    lp, ref = torch.zeros(1), torch.tensor([30.0])  # log r = 30
    close(kl_estimate(lp, ref, "k1"), [-10.0])  # input clamp -> 20 -> k1 -20 -> output clamp -10
    close(kl_estimate(lp, ref, "k1", output_clamp=None), [-20.0])
    close(kl_estimate(lp, ref, "k1", input_clamp=None, output_clamp=None), [-30.0])
    close(kl_estimate(lp, ref, "k2"), [10.0])  # 20^2 / 2 = 200 -> 10
    close(kl_estimate(lp, ref, "k3"), [10.0])  # e^20 - 21 -> 10
    close(kl_estimate(lp, ref, "k3", input_clamp=2.0, output_clamp=None), [E**2 - 3])  # 4.3890561


def test_kl_gradients_closed_form():
    # d/dlp with x = ref - lp: k1 = lp - ref -> 1; k2 = x^2/2 -> -x; k3 = e^x - 1 - x -> 1 - e^x
    for kl_type, expected in (("k1", [1.0, 1.0, 1.0]), ("k2", [0.0, -1.0, 1.0]), ("k3", [0.0, 1 - E, 1 - 1 / E])):
        lp = torch.zeros(3, requires_grad=True)
        kl_estimate(lp, REF, kl_type).sum().backward()
        close(lp.grad, expected)
    # a clamped token passes no gradient
    lp = torch.zeros(1, requires_grad=True)
    kl_estimate(lp, torch.tensor([30.0]), "k3").sum().backward()
    assert lp.grad.item() == 0.0


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_gradcheck(kl_type):
    generator = torch.Generator().manual_seed(0)
    lp = (torch.rand(2, 4, generator=generator, dtype=torch.float64) - 0.5).requires_grad_()
    ref = torch.rand(2, 4, generator=generator, dtype=torch.float64) - 0.5
    assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, kl_type), (lp,))


def test_unknown_kl_type_raises():
    with pytest.raises(ValueError, match="kl_type"):
        kl_estimate(LP, REF, "k4")


# ---------------------------------------------------------------- clipped_pg_loss: clipping


def basic_case(dtype=torch.float32):
    """Two sequences, old logprobs 0 so that ratio = exp(logprobs); seq 0 has one padded token.

    seq 0, A = +1, ratios [1, 1.5, 0.5, pad]: L = max(-ρ, -clip(ρ, .8, 1.2)) = [-1, -1.2, -0.5]
    seq 1, A = -1, ratios [1, 1.5, 0.5, 2]:   L = max(ρ, clip(ρ, .8, 1.2))   = [1, 1.5, 0.8, 2]
    """
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.0], [1.0, 1.5, 0.5, 2.0]], dtype=torch.float64)
    logprobs = ratios.log()
    logprobs[0, 3] = -INF  # padding may hold anything
    logprobs = logprobs.to(dtype).requires_grad_()
    old = torch.zeros(2, 4, dtype=dtype)
    advantages = torch.tensor([1.0, -1.0], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return logprobs, old, advantages, mask


def test_token_reduction_hand_computed():
    logprobs, old, advantages, mask = basic_case()
    loss, metrics = clipped_pg_loss(logprobs, old, advantages, mask)
    # (-1 - 1.2 - 0.5 + 1 + 1.5 + 0.8 + 2) / 7 valid tokens = 2.6 / 7
    close(loss, 0.3714286)
    close(metrics["pg_loss"], 0.3714286)
    # clip binding at seq 0 ρ=1.5 and seq 1 ρ=0.5: 2 of 7 tokens
    close(metrics["clip_fraction"], 0.2857143)
    close(metrics["ratio_mean"], 1.1428571)  # (1 + 1.5 + .5 + 1 + 1.5 + .5 + 2) / 7 = 8/7
    assert metrics["dual_clip_fraction"] == 0.0
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_oob_fraction"] == 0.0
    assert metrics["kl"] == 0.0
    assert metrics["num_tokens"] == 7.0 and metrics["num_sequences"] == 2.0
    assert loss.dim() == 0 and all(isinstance(v, float) for v in metrics.values())


def test_token_reduction_gradient_closed_form():
    logprobs, old, advantages, mask = basic_case()
    loss, _ = clipped_pg_loss(logprobs, old, advantages, mask)
    loss.backward()
    # d(-Aρ)/dlogprob = -Aρ where the unclipped branch is active, 0 where the clip binds; / 7 tokens
    # seq 0: ρ=1 -> -1/7, ρ=1.5 clipped -> 0, ρ=.5 -> -.5/7, pad -> 0
    # seq 1: ρ=1 -> 1/7, ρ=1.5 -> 1.5/7, ρ=.5 clipped -> 0, ρ=2 -> 2/7
    close(logprobs.grad, [[-0.1428571, 0.0, -0.0714286, 0.0], [0.1428571, 0.2142857, 0.0, 0.2857143]])


def test_sequence_reduction_hand_computed():
    logprobs, old, advantages, mask = basic_case()
    loss, metrics = clipped_pg_loss(logprobs, old, advantages, mask, reduction="sequence")
    # seq 0 mean -2.7/3 = -0.9; seq 1 mean 5.3/4 = 1.325; mean of the two = 0.2125
    close(loss, 0.2125)
    loss.backward()
    # each token's gradient is divided by (2 sequences x its sequence's token count)
    close(logprobs.grad, [[-1 / 6, 0.0, -0.5 / 6, 0.0], [1 / 8, 1.5 / 8, 0.0, 2 / 8]])
    close(metrics["clip_fraction"], 0.2857143)  # metrics stay token means


def test_per_token_advantages_equal_per_sequence_advantages():
    logprobs, old, advantages, mask = basic_case()
    loss_b, _ = clipped_pg_loss(logprobs, old, advantages, mask)
    loss_bt, _ = clipped_pg_loss(logprobs, old, advantages.unsqueeze(-1).expand(2, 4), mask)
    assert loss_b.item() == loss_bt.item()


def test_asymmetric_clip():
    # A=+1, ρ=1.5, clip_high .28: max(-1.5, -1.28) = -1.28
    # A=-1, ρ=0.5, clip_low .1:   max(0.5, 0.9)   = 0.9      -> mean -0.19
    logprobs = torch.tensor([[math.log(1.5)], [math.log(0.5)]])
    loss, metrics = clipped_pg_loss(
        logprobs, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1), clip_low=0.1, clip_high=0.28
    )
    close(loss, -0.19)
    assert metrics["clip_fraction"] == 1.0


def test_dual_clip():
    # per-token A [-1, -1, +1], ρ [5, 2, 5], c = 3
    # t0: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual clip binds); t1: max(2, 1.2) = 2 < 3 stays;
    # t2: A > 0 so no dual clip: max(-5, -1.2) = -1.2 (ordinary clip binds)
    logprobs = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    args = (logprobs, torch.zeros(1, 3), torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3))
    loss, metrics = clipped_pg_loss(*args, dual_clip_c=3.0)
    close(loss, 3.8 / 3)  # 1.2666667
    close(metrics["dual_clip_fraction"], 1 / 3)
    close(metrics["clip_fraction"], 1 / 3)
    loss.backward()
    close(logprobs.grad, [[0.0, 2 / 3, 0.0]])  # only t1 is on the unclipped branch: -Aρ/3 = 2/3
    plain, _ = clipped_pg_loss(*args)
    close(plain, 5.8 / 3)  # without dual clip t0 keeps 5


# ---------------------------------------------------------------- importance-sampling correction


def is_case():
    """ρ = 1 and A = +1 everywhere, so each valid token's loss is -w and the loss is -(mean w).

    generation logprobs are -log w with old logprobs 0, so w = exp(old - generation).
    seq 0: w [0.5, 1, 2, 4]; seq 1: w [1, 1, pad, pad] (padding holds NaN). 6 valid tokens.
    """
    w = torch.tensor([[0.5, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    generation = -w.log()
    generation[1, 2:] = NAN
    logprobs = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    return logprobs, torch.zeros(2, 4), torch.ones(2), mask, generation


@pytest.mark.parametrize(
    "is_correction, is_min, is_max, expected_loss, weight_mean, oob",
    [
        (None, None, None, -1.0, 1.0, 0.0),
        # all weights: (.5 + 1 + 2 + 4 + 1 + 1) / 6 = 9.5 / 6
        ("plain", None, None, -1.5833333, 1.5833333, 0.0),
        # clamp to [0, 2]: .5 1 2 2 1 1 = 7.5 / 6; the 4 is out of bounds
        ("tis", None, 2.0, -1.25, 1.25, 1 / 6),
        # clamp to [.8, 2]: .8 1 2 2 1 1 = 7.8 / 6; .5 and 4 out of bounds
        ("tis", 0.8, 2.0, -1.3, 1.3, 2 / 6),
        # zero outside [.8, 2]: 0 1 2 0 1 1 = 5 / 6
        ("icepop", 0.8, 2.0, -0.8333333, 0.8333333, 2 / 6),
        # seq 0 geometric mean (.5 * 1 * 2 * 4)^(1/4) = 1.4142136 > 1.25: all 4 tokens dropped;
        # seq 1 geometric mean 1 kept: 1 + 1 = 2 / 6
        ("seq-mask-tis", 0.8, 1.25, -0.3333333, 0.3333333, 4 / 6),
        # both sequences inside [.5, 2]: plain weights
        ("seq-mask-tis", 0.5, 2.0, -1.5833333, 1.5833333, 0.0),
    ],
)
def test_is_corrections(is_correction, is_min, is_max, expected_loss, weight_mean, oob):
    logprobs, old, advantages, mask, generation = is_case()
    loss, metrics = clipped_pg_loss(
        logprobs,
        old,
        advantages,
        mask,
        generation_logprobs=generation,
        is_correction=is_correction,
        is_min=is_min,
        is_max=is_max,
    )
    close(loss, expected_loss)
    close(metrics["is_weight_mean"], weight_mean)
    close(metrics["is_oob_fraction"], oob)


def test_seq_mask_tis_averages_over_valid_tokens_only():
    # w [1.5, 1.5, pad, pad]: geometric mean over the 2 valid tokens is 1.5 > 1.3 -> dropped, loss 0.
    # (Averaging over all 4 positions would give sqrt(1.5) = 1.2247 and keep it: loss -1.5.)
    generation = torch.tensor([[-math.log(1.5), -math.log(1.5), 0.0, 0.0]])
    loss, metrics = clipped_pg_loss(
        torch.zeros(1, 4),
        torch.zeros(1, 4),
        torch.ones(1),
        torch.tensor([[1, 1, 0, 0]]),
        generation_logprobs=generation,
        is_correction="seq-mask-tis",
        is_min=0.5,
        is_max=1.3,
    )
    assert loss.item() == 0.0
    assert metrics["is_oob_fraction"] == 1.0


def test_is_weights_multiply_the_gradient_and_reduce_per_sequence():
    logprobs, old, advantages, mask, generation = is_case()
    loss, _ = clipped_pg_loss(logprobs, old, advantages, mask, generation_logprobs=generation, is_correction="plain")
    loss.backward()
    # d(-w ρ)/dlogprob = -w ρ = -w, / 6 tokens; padding 0 despite its NaN generation logprobs
    close(logprobs.grad, [[-0.5 / 6, -1 / 6, -2 / 6, -4 / 6], [-1 / 6, -1 / 6, 0.0, 0.0]])
    loss_seq, _ = clipped_pg_loss(
        logprobs, old, advantages, mask, generation_logprobs=generation, is_correction="plain", reduction="sequence"
    )
    close(loss_seq, -1.4375)  # seq 0: -7.5/4 = -1.875, seq 1: -2/2 = -1, mean -1.4375


def test_constants_receive_no_gradient():
    logprobs, old, advantages, mask, generation = is_case()
    advantages.requires_grad_()
    generation.requires_grad_()
    loss, _ = clipped_pg_loss(logprobs, old, advantages, mask, generation_logprobs=generation, is_correction="plain")
    loss.backward()
    assert advantages.grad is None and generation.grad is None


# ---------------------------------------------------------------- KL term


def test_kl_term_is_added_unweighted():
    # ρ = 1, A = +1, plain IS weight 2 on every token -> pg = -2 per token, pg_loss = -2.
    # k3 with log r [0, 1, -1]: [0, .7182818, .3678794], mean .3620537.
    # loss = -2 + 0.1 * .3620537 = -1.9637946 (an IS-weighted KL would give -1.9275893)
    logprobs = torch.zeros(1, 3, requires_grad=True)
    loss, metrics = clipped_pg_loss(
        logprobs,
        torch.zeros(1, 3),
        torch.ones(1),
        torch.ones(1, 3),
        generation_logprobs=torch.full((1, 3), -math.log(2.0)),
        is_correction="plain",
        reference_logprobs=REF.unsqueeze(0),
        kl_penalty=0.1,
    )
    close(loss, -1.9637946)
    close(metrics["pg_loss"], -2.0)
    close(metrics["kl"], 0.3620537)
    loss.backward()
    # pg: -2/3 each; kl: 0.1 * (1 - e^x) / 3 = [0, -.0572761, .0210707]
    close(logprobs.grad, [[-0.6666667, -0.7239428, -0.6455960]])


def test_kl_metric_without_penalty_and_kl_type_choice():
    logprobs = torch.zeros(1, 3)
    args = (logprobs, torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 3))
    loss, metrics = clipped_pg_loss(*args, reference_logprobs=REF.unsqueeze(0))
    assert loss.item() == 0.0
    close(metrics["kl"], 0.3620537)  # reported, not added
    _, metrics = clipped_pg_loss(*args, reference_logprobs=REF.unsqueeze(0), kl_type="k2")
    close(metrics["kl"], 1 / 3)  # (0 + .5 + .5) / 3


# ---------------------------------------------------------------- masks


def test_empty_rows_are_ignored_by_both_reductions():
    logprobs, old, advantages, mask = basic_case()
    logprobs = torch.cat([logprobs.detach(), torch.full((1, 4), NAN)]).requires_grad_()
    old = torch.cat([old, torch.zeros(1, 4)])
    advantages = torch.cat([advantages, torch.tensor([5.0])])
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=mask.dtype)])
    loss, metrics = clipped_pg_loss(logprobs, old, advantages, mask)
    close(loss, 0.3714286)  # as in test_token_reduction_hand_computed
    assert metrics["num_sequences"] == 2.0
    loss.backward()
    assert torch.equal(logprobs.grad[2], torch.zeros(4))
    loss_seq, _ = clipped_pg_loss(logprobs, old, advantages, mask, reduction="sequence")
    close(loss_seq, 0.2125)  # an empty row counted as 0 would give 0.1416667


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_all_masked_batch_gives_zero_loss_and_finite_gradient(reduction):
    logprobs = torch.full((2, 3), NAN, requires_grad=True)
    loss, metrics = clipped_pg_loss(
        logprobs,
        torch.zeros(2, 3),
        torch.ones(2),
        torch.zeros(2, 3),
        reduction=reduction,
        reference_logprobs=torch.zeros(2, 3),
        kl_penalty=0.1,
        generation_logprobs=torch.zeros(2, 3),
        is_correction="seq-mask-tis",
        is_min=0.5,
        is_max=2.0,
    )
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert all(v == 0.0 for v in metrics.values())


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_mask_dtypes(mask_dtype):
    logprobs, old, advantages, mask = basic_case()
    loss, _ = clipped_pg_loss(logprobs, old, advantages, mask.to(mask_dtype))
    close(loss, 0.3714286)


# ---------------------------------------------------------------- dtypes and gradcheck


def test_bfloat16_inputs():
    logprobs, old, advantages, mask = basic_case(torch.bfloat16)
    loss, _ = clipped_pg_loss(logprobs, old, advantages, mask)
    assert loss.dtype == torch.float32
    # bfloat16 rounds log(1.5) to .40625 (ρ = 1.5011): same value as float32 to ~1e-3
    close(loss, 0.3714286, atol=2e-3)
    loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16
    expected = [[-0.1428571, 0.0, -0.0714286, 0.0], [0.1428571, 0.2142857, 0.0, 0.2857143]]
    close(logprobs.grad.float(), expected, atol=2e-3)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
@pytest.mark.parametrize("is_correction", [None, "plain", "tis", "icepop", "seq-mask-tis"])
def test_gradcheck_float64(reduction, is_correction):
    # Random ratios in [0.5, 1.6] and per-token advantages; kinks (ρ = 1 ± clip, the dual-clip
    # threshold) are measure-zero and not hit by this seed. Row 2 is empty, row 0 partly padded.
    generator = torch.Generator().manual_seed(1)
    shape = (3, 5)
    old = torch.rand(shape, generator=generator, dtype=torch.float64) - 2
    step = torch.empty(shape, dtype=torch.float64).uniform_(-0.7, 0.47, generator=generator)
    logprobs = (old + step).requires_grad_()
    generation = old + torch.empty(shape, dtype=torch.float64).uniform_(-0.5, 0.5, generator=generator)
    reference = old + torch.empty(shape, dtype=torch.float64).uniform_(-0.5, 0.5, generator=generator)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])

    def f(x):
        loss, _ = clipped_pg_loss(
            x,
            old,
            advantages,
            mask,
            generation_logprobs=generation,
            reference_logprobs=reference,
            dual_clip_c=1.5,
            kl_penalty=0.1,
            is_correction=is_correction,
            is_min=0.8,
            is_max=1.3,
            reduction=reduction,
        )
        return loss

    assert torch.autograd.gradcheck(f, (logprobs,))


# ---------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"is_correction": "vtrace", "generation_logprobs": torch.zeros(1, 2)}, "is_correction"),
        ({"is_correction": "tis", "generation_logprobs": torch.zeros(1, 2)}, "is_max"),
        ({"is_correction": "icepop", "is_max": 2.0, "generation_logprobs": torch.zeros(1, 2)}, "is_min"),
        ({"is_correction": "tis", "is_min": 3.0, "is_max": 2.0, "generation_logprobs": torch.zeros(1, 2)}, "is_min"),
        ({"is_correction": "plain"}, "generation_logprobs"),
        ({"kl_penalty": 0.1}, "reference_logprobs"),
        ({"reduction": "sum"}, "reduction"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"reduction": "constant"}, "length_normaliser"),
        ({"policy_loss": "ppo"}, "policy_loss"),
        ({"policy_loss": "cispo", "dual_clip_c": 3.0}, "dual_clip_c"),
        ({"policy_loss": "sapo", "tau_neg": 0.0}, "tau_neg"),
        ({"reference_logprobs": torch.zeros(2, 2)}, "reference_logprobs"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        clipped_pg_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **kwargs)


def test_bad_advantage_shape_raises():
    with pytest.raises(ValueError, match="advantages"):
        clipped_pg_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3), torch.ones(2, 3))
