"""The policy-gradient family against second implementations written from each paper's equations.

Each reference below is a plain loop over sequences and tokens in float64, written from the paper's
objective (GSPO arXiv 2507.18071, CISPO arXiv 2506.13585, SAPO arXiv 2511.20347, Dr.GRPO arXiv
2503.20783); values and gradients of clipped_pg_loss must match it on several shapes and masks. The
documented limits (GSPO is GRPO on one-token sequences, ...) are tests of their own.
"""

from __future__ import annotations

import math

import pytest
import torch

from dockyard.algorithms import clipped_pg_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _case(rows: int, width: int, seed: int, per_token: bool):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2
    # Old logprobs near and far: ratios both inside and outside the clip range.
    old = lp + torch.randn(rows, width, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(rows, width, generator=gen) > 0.35
    mask[0, 0] = True  # at least one valid token
    mask[-1] = False if rows > 2 else mask[-1]  # a row with no valid token
    shape = (rows, width) if per_token else (rows,)
    adv = torch.randn(*shape, generator=gen, dtype=torch.float64)
    lp = lp.masked_fill(~mask, float("nan"))  # padding may hold NaN
    return lp, old, adv, mask


CASES = [(3, 5, 0), (4, 9, 1), (6, 2, 2), (2, 1, 3)]


def _adv(adv: torch.Tensor, i: int, t: int) -> float:
    return float(adv[i, t] if adv.dim() == 2 else adv[i])


def _valid(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def _ours(lp, old, adv, mask, **kwargs):
    x = lp.clone().requires_grad_()
    loss, metrics = clipped_pg_loss(x, old, adv, mask, **kwargs)
    loss.backward()
    return loss.detach(), torch.nan_to_num(x.grad), metrics


def _theirs(objective, lp):
    """Loss and gradient of a reference objective (a function of the valid logprobs), by autograd."""
    x = torch.nan_to_num(lp.clone()).requires_grad_()
    loss = objective(x)
    loss.backward()
    return loss.detach(), x.grad


def _close(ours, theirs, atol=1e-5):
    torch.testing.assert_close(ours[0].double(), theirs[0].double(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(ours[1].double(), theirs[1].double(), atol=atol, rtol=1e-5)


def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.clamp(x, 1 - low, 1 + high)


# ---------------------------------------------------------------- GSPO (arXiv 2507.18071, eq. 5-7 and 10-11)


def gspo_reference(lp, old, adv, mask, low, high):
    """J = 1/G Σ_i min(s_i A_i, clip(s_i) A_i), s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|); loss = −J."""

    def objective(x):
        terms = []
        for i in range(x.shape[0]):
            tokens = _valid(mask, i)
            if not tokens:
                continue
            s = torch.exp(sum(x[i, t] - old[i, t] for t in tokens) / len(tokens))
            a = _adv(adv, i, tokens[0])
            terms.append(torch.minimum(s * a, _clip(s, low, high) * a))
        return -sum(terms) / len(terms)

    return objective


def gspo_token_reference(lp, old, adv, mask, low, high):
    """J = 1/G Σ_i 1/|y_i| Σ_t min(s_it A_it, clip(s_it) A_it), s_it = sg[s_i] π_θ(y_t) / sg[π_θ(y_t)]."""

    def objective(x):
        terms = []
        for i in range(x.shape[0]):
            tokens = _valid(mask, i)
            if not tokens:
                continue
            s = torch.exp(sum(x[i, t] - old[i, t] for t in tokens) / len(tokens)).detach()
            row = []
            for t in tokens:
                s_t = s * torch.exp(x[i, t] - x[i, t].detach())
                a = _adv(adv, i, t)
                row.append(torch.minimum(s_t * a, _clip(s_t, low, high) * a))
            terms.append(sum(row) / len(row))
        return -sum(terms) / len(terms)

    return objective


@pytest.mark.parametrize("rows, width, seed", CASES)
@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.2, 0.28), (0.05, 0.5)])
def test_gspo_is_the_papers_sequence_objective(rows, width, seed, low, high):
    lp, old, adv, mask = _case(rows, width, seed, per_token=False)
    ours = _ours(lp, old, adv, mask, policy_loss="gspo", clip_low=low, clip_high=high, reduction="sequence")
    _close(ours, _theirs(gspo_reference(lp, old, adv, mask, low, high), lp))


@pytest.mark.parametrize("rows, width, seed", CASES)
def test_gspo_token_is_the_papers_token_objective(rows, width, seed):
    lp, old, adv, mask = _case(rows, width, seed, per_token=True)
    ours = _ours(lp, old, adv, mask, policy_loss="gspo-token", clip_low=0.1, clip_high=0.1, reduction="sequence")
    _close(ours, _theirs(gspo_token_reference(lp, old, adv, mask, 0.1, 0.1), lp))


@pytest.mark.parametrize("rows, width, seed", CASES)
def test_gspo_token_equals_gspo_when_each_sequence_has_one_advantage(rows, width, seed):
    lp, old, adv, mask = _case(rows, width, seed, per_token=False)
    options = dict(clip_low=0.1, clip_high=0.1, reduction="sequence")
    _close(
        _ours(lp, old, adv, mask, policy_loss="gspo", **options)[:2],
        _ours(lp, old, adv, mask, policy_loss="gspo-token", **options)[:2],
    )


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_gspo_equals_grpo_when_every_sequence_has_one_token(policy_loss, reduction):
    for seed in range(3):
        lp, old, adv, mask = _case(5, 6, seed, per_token=False)
        one = torch.zeros_like(mask)
        for i in range(5):  # the first valid token of each row, alone
            if mask[i].any():
                one[i, int(mask[i].float().argmax())] = True
        options = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, reduction=reduction)
        gspo = _ours(lp, old, adv, one, policy_loss=policy_loss, **options)
        grpo = _ours(lp, old, adv, one, policy_loss="grpo", **options)
        _close(gspo[:2], grpo[:2], atol=1e-6)
        assert gspo[2]["clip_fraction"] == grpo[2]["clip_fraction"]


def test_gspo_clips_whole_sequences():
    # Row 0: both tokens far off-policy (s = e^0.5), A > 0: clipped, no gradient to either token.
    # Row 1: on-policy, A > 0: gradient −A s / |y| = −1/2 per token.
    lp = torch.zeros(2, 2)
    old = torch.tensor([[-0.5, -0.5], [0.0, 0.0]])
    loss, grad, metrics = _ours(lp, old, torch.ones(2), torch.ones(2, 2), policy_loss="gspo", reduction="sequence")
    assert grad.tolist() == [[0.0, 0.0], [-0.25, -0.25]]  # the sequence mean of 1/2, then the mean over 2 rows
    assert metrics["clip_fraction"] == 0.5 and metrics["gate_mean"] == 0.5
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5)) and metrics["ratio_min"] == 1.0


# ---------------------------------------------------------------- CISPO (arXiv 2506.13585, eq. 4-5)


def cispo_reference(lp, old, adv, mask, low, high):
    """J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_it) A_it log π_θ(o_it), r̂ = clip(r, 1 − ε_low, 1 + ε_high); loss = −J."""

    def objective(x):
        total, count = 0.0, 0
        for i in range(x.shape[0]):
            for t in _valid(mask, i):
                r = torch.exp(x[i, t] - old[i, t]).detach()
                total = total + _clip(r, low, high) * _adv(adv, i, t) * x[i, t]
                count += 1
        return -total / count

    return objective


@pytest.mark.parametrize("rows, width, seed", CASES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("low, high", [(1.0, 0.28), (0.2, 0.2)])
def test_cispo_is_the_papers_objective(rows, width, seed, per_token, low, high):
    lp, old, adv, mask = _case(rows, width, seed, per_token)
    ours = _ours(lp, old, adv, mask, policy_loss="cispo", clip_low=low, clip_high=high)
    _close(ours, _theirs(cispo_reference(lp, old, adv, mask, low, high), lp))


def test_cispo_drops_no_token_from_the_gradient():
    # ρ = e (far above 1 + ε): GRPO's clip silences the token (A > 0), CISPO keeps −(1 + ε_high)·A.
    lp, old, adv, mask = torch.zeros(1, 1), torch.full((1, 1), -1.0), torch.ones(1), torch.ones(1, 1)
    _, grpo_grad, grpo = _ours(lp, old, adv, mask, policy_loss="grpo", clip_high=0.28)
    _, cispo_grad, cispo = _ours(lp, old, adv, mask, policy_loss="cispo", clip_low=1.0, clip_high=0.28)
    assert grpo_grad.item() == 0.0 and grpo["gate_mean"] == 0.0
    assert cispo_grad.item() == pytest.approx(-1.28)
    assert cispo["clip_fraction"] == 1.0 and cispo["gate_mean"] == pytest.approx(1.28 / math.e)


def test_cispo_gradient_is_grpos_on_policy():
    lp, _, adv, mask = _case(4, 6, 5, per_token=True)
    old = torch.nan_to_num(lp)
    cispo_grad = _ours(lp, old, adv, mask, policy_loss="cispo")[1]
    torch.testing.assert_close(cispo_grad, _ours(lp, old, adv, mask, policy_loss="grpo")[1])
    assert cispo_grad.abs().max() > 0


# ---------------------------------------------------------------- SAPO (arXiv 2511.20347)


def sapo_reference(lp, old, adv, mask, tau_pos, tau_neg):
    """J = 1/G Σ_i 1/|y_i| Σ_t f(r_it) A_it, f(r) = (4/τ) σ(τ (r − 1)), τ = τ_pos if A > 0 else τ_neg."""

    def objective(x):
        terms = []
        for i in range(x.shape[0]):
            tokens = _valid(mask, i)
            if not tokens:
                continue
            row = []
            for t in tokens:
                a = _adv(adv, i, t)
                tau = tau_pos if a > 0 else tau_neg
                r = torch.exp(x[i, t] - old[i, t])
                row.append(4 / tau * torch.sigmoid(tau * (r - 1)) * a)
            terms.append(sum(row) / len(row))
        return -sum(terms) / len(terms)

    return objective


@pytest.mark.parametrize("rows, width, seed", CASES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 4.0)])
def test_sapo_is_the_papers_objective(rows, width, seed, per_token, tau_pos, tau_neg):
    lp, old, adv, mask = _case(rows, width, seed, per_token)
    ours = _ours(lp, old, adv, mask, policy_loss="sapo", tau_pos=tau_pos, tau_neg=tau_neg, reduction="sequence")
    _close(ours, _theirs(sapo_reference(lp, old, adv, mask, tau_pos, tau_neg), lp))


def test_sapo_gate_is_one_on_policy_and_decays_off_policy():
    lp, _, adv, mask = _case(4, 6, 7, per_token=True)
    old = torch.nan_to_num(lp)
    # On-policy the gate is 1: SAPO's gradient is the unclipped policy gradient, GRPO's.
    _, sapo_grad, sapo = _ours(lp, old, adv, mask, policy_loss="sapo")
    _, grpo_grad, _ = _ours(lp, old, adv, mask, policy_loss="grpo")
    torch.testing.assert_close(sapo_grad, grpo_grad)
    assert sapo["gate_mean"] == pytest.approx(1.0) and sapo["clip_fraction"] == 0.0
    # Off-policy the gate is 4σ(1 − σ) < 1, and a token GRPO clips still gets a (smaller) gradient.
    far = old - 1.0  # ρ = e
    _, grad, metrics = _ours(lp, far, adv, mask, policy_loss="sapo")
    sigma = 1 / (1 + math.exp(-(math.e - 1)))
    assert metrics["gate_mean"] < 1 and (grad[mask] != 0).all()
    valid = [(i, t) for i in range(4) for t in range(6) if mask[i, t] and adv[i, t] > 0]
    i, t = valid[0]
    n = int(mask.sum())
    assert grad[i, t].item() == pytest.approx(-4 * sigma * (1 - sigma) * math.e * adv[i, t].item() / n, rel=1e-5)


# ---------------------------------------------------------------- Dr.GRPO (arXiv 2503.20783, the constant normaliser)


def dr_grpo_reference(lp, old, adv, mask, length):
    """Σ_i Σ_t min(r A, clip(r) A) / (G · L_max): the token sum, a constant in place of 1/|o_i|; loss = −it."""

    def objective(x):
        total, sequences = 0.0, 0
        for i in range(x.shape[0]):
            tokens = _valid(mask, i)
            sequences += bool(tokens)
            for t in tokens:
                r = torch.exp(x[i, t] - old[i, t])
                a = _adv(adv, i, t)
                total = total + torch.minimum(r * a, _clip(r, EPS_LOW, EPS_HIGH) * a)
        return -total / (sequences * length)

    return objective


@pytest.mark.parametrize("rows, width, seed", CASES)
def test_dr_grpo_constant_normaliser_is_the_papers(rows, width, seed):
    lp, old, adv, mask = _case(rows, width, seed, per_token=False)
    ours = _ours(lp, old, adv, mask, reduction="constant", length_normaliser=16, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    _close(ours, _theirs(dr_grpo_reference(lp, old, adv, mask, 16), lp))


def test_the_constant_normaliser_is_the_mean_when_every_sequence_fills_it():
    lp, old, adv, _ = _case(3, 8, 4, per_token=False)
    lp = torch.nan_to_num(lp)
    full = torch.ones(3, 8, dtype=torch.bool)
    constant = _ours(lp, old, adv, full, reduction="constant", length_normaliser=8)
    for reduction in ("token", "sequence"):
        _close(constant[:2], _ours(lp, old, adv, full, reduction=reduction)[:2], atol=1e-6)


# ---------------------------------------------------------------- GRPO: today's formula, bit for bit


def grpo_as_it_was(lp, old, adv, mask, low, high, c):
    """The clipped surrogate before the family existed (token reduction), vectorised as it was."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32)
    masked = lambda x: torch.where(valid, x.float(), zero)  # noqa: E731
    ratio = torch.exp(masked(lp - old))
    a = masked(adv.unsqueeze(-1).expand(lp.shape) if adv.dim() == 1 else adv)
    per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
    if c is not None:
        cap = -c * a
        per = torch.where((a < 0) & (per > cap), cap, per)
    return masked(per).sum() / valid.float().sum().clamp(min=1)


@pytest.mark.parametrize("rows, width, seed", CASES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dual_clip_c", [None, 2.0])
def test_grpo_is_todays_loss_bit_for_bit(rows, width, seed, per_token, dual_clip_c):
    lp, old, adv, mask = (t.float() if t.is_floating_point() else t for t in _case(rows, width, seed, per_token))
    ours = _ours(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=dual_clip_c)
    named = _ours(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=dual_clip_c, policy_loss="grpo")
    x = lp.clone().requires_grad_()
    before = grpo_as_it_was(x, old, adv, mask, 0.2, 0.28, dual_clip_c)
    before.backward()
    for got in (ours, named):
        assert torch.equal(got[0], before.detach())
        assert torch.equal(got[1], torch.nan_to_num(x.grad))


@pytest.mark.parametrize("policy_loss", ["grpo", "gspo", "gspo-token", "cispo", "sapo"])
def test_every_objective_ignores_padding_and_empty_batches(policy_loss):
    lp, old, adv, mask = _case(4, 5, 9, per_token=True)
    loss, grad, metrics = _ours(lp, old, adv, mask, policy_loss=policy_loss)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())
    loss, grad, metrics = _ours(lp, old, adv, torch.zeros_like(mask), policy_loss=policy_loss)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert metrics["ratio_min"] == metrics["ratio_max"] == 0.0
