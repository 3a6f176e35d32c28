"""The policy losses: hand-computed cases, gradient identities, clipping sides, padding."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from gspo_api.spec import LossLevel
from gspo_trainer.logprobs import token_logprobs_from_hidden
from gspo_trainer.loss import LEVEL_OF, POLICY_LOSSES, policy_loss

LEVELS = ("sequence", "sequence_token", "token")
NAN = float("nan")


def hand_case():
    """Two responses: log-ratios [0.1, 0.2 | pad] with A = +1, [-0.3] * 3 with A = -2."""
    old = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -0.7, -0.9]])
    logp = old + torch.tensor([[0.1, 0.2, NAN], [-0.3, -0.3, -0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp.requires_grad_(True), old, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_hand_computed(level: str) -> None:
    logp, old, adv, mask = hand_case()
    loss, stats = policy_loss(logp, old, adv, mask, level=level, clip_low=0.2, clip_high=0.27)
    s0, s1 = math.exp(0.15), math.exp(-0.3)  # s_i = exp(mean log-ratio)
    # Response 0: s0 = 1.162 < 1.27, unclipped: -s0 * 1. Response 1: s1 = 0.741 < 0.8 with
    # A < 0, so min(s1 * -2, 0.8 * -2) = -1.6 and its loss is +1.6.
    assert loss.item() == pytest.approx((-s0 + 1.6) / 2, rel=1e-6)
    assert float(stats["clip_fraction_low"]) == 0.5
    assert float(stats["clip_fraction_high"]) == 0.0
    assert float(stats["ratio_min"]) == pytest.approx(s1, rel=1e-6)
    assert float(stats["ratio_max"]) == pytest.approx(s0, rel=1e-6)
    assert float(stats["ratio_mean"]) == pytest.approx((s0 + s1) / 2, rel=1e-6)
    assert float(stats["log_ratio_abs"]) == pytest.approx((0.15 + 0.3) / 2, rel=1e-5)
    loss.backward()
    # Only response 0 carries gradient: d(-s0/2)/dlogp_t = -s0 / (2 * 2) per token.
    want = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, want)


def test_grpo_hand_computed() -> None:
    logp, old, adv, mask = hand_case()
    loss, stats = policy_loss(logp, old, adv, mask, level="token", clip_low=0.2, clip_high=0.27)
    r1, r2 = math.exp(0.1), math.exp(0.2)  # both inside [0.8, 1.27]
    # Response 0: mean of -r over its two tokens; response 1: each token clipped at 0.8 -> +1.6.
    assert loss.item() == pytest.approx((-(r1 + r2) / 2 + 1.6) / 2, rel=1e-6)
    assert float(stats["clip_fraction_low"]) == pytest.approx(3 / 5)  # 3 of 5 response tokens
    assert float(stats["ratio_max"]) == pytest.approx(r2, rel=1e-6)
    assert float(stats["ratio_min"]) == pytest.approx(math.exp(-0.3), rel=1e-6)
    loss.backward()
    want = torch.tensor([[-r1 / 4, -r2 / 4, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, want)


def test_k3_kl_hand_computed() -> None:
    logp, old, adv, mask = hand_case()
    ref = logp.detach() + torch.tensor([[0.5, 0.0, NAN], [-1.0, 0.0, 0.0]])
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    kl_seq = [(k3(0.5) + 0) / 2, (k3(-1.0) + 0 + 0) / 3]
    base, _ = policy_loss(logp, old, adv, mask, level="sequence", clip_low=0.2, clip_high=0.27)
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        level="sequence",
        clip_low=0.2,
        clip_high=0.27,
        ref_logprobs=ref,
        kl_coef=0.1,
    )
    assert float(stats["kl"]) == pytest.approx(sum(kl_seq) / 2, rel=1e-6)
    assert (loss - base).item() == pytest.approx(0.1 * sum(kl_seq) / 2, rel=1e-5)
    _, stats0 = policy_loss(
        logp, old, adv, mask, level="token", clip_low=0.2, clip_high=0.27, ref_logprobs=ref
    )
    assert float(stats0["kl"]) == pytest.approx(sum(kl_seq) / 2, rel=1e-6)  # reported at 0 too


def random_batch(seed: int, B: int = 6, T: int = 9, spread: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + spread * torch.randn(B, T, generator=g)).requires_grad_(True)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.27), (1e-2, 1e-2)])
def test_gspo_and_gspo_token_same_value_and_gradient(seed: int, clip) -> None:
    logp, old, adv, mask = random_batch(seed)
    results = []
    for level in ("sequence", "sequence_token"):
        loss, stats = policy_loss(
            logp, old, adv, mask, level=level, clip_low=clip[0], clip_high=clip[1]
        )
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, grad, stats))
    (l1, g1, s1), (l2, g2, s2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)
    assert float(s1["clip_fraction_low"]) == float(s2["clip_fraction_low"])
    assert float(s1["clip_fraction_high"]) == float(s2["clip_fraction_high"])
    assert g1.abs().sum() > 0 or (s1["clip_fraction_low"] + s1["clip_fraction_high"]) == 1


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gradient_at_s_equal_one_is_advantage_times_mean_grad_logp(level: str) -> None:
    """At pi = pi_old: grad loss = -(1/B) sum_i A_i mean_t grad log pi(y_i,t), Eq. (11), s=1."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 5, 6, 8, 13
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([6, 1, 3, 4, 2])[:, None]
    adv = torch.randn(B, generator=g)
    logp = token_logprobs_from_hidden(hidden, weight, tokens, 4, mask=mask).logp
    loss, stats = policy_loss(
        logp, logp.detach(), adv, mask, level=level, clip_low=3e-4, clip_high=4e-4
    )
    assert float(stats["ratio_min"]) == float(stats["ratio_max"]) == 1.0
    (got,) = torch.autograd.grad(loss, weight, retain_graph=True)
    lengths = mask.sum(-1)
    per_seq_mean = (logp * mask).sum(-1) / lengths
    (want,) = torch.autograd.grad(-(adv * per_seq_mean).sum() / B, weight)
    torch.testing.assert_close(got, want)


def one_token_per_row(log_ratios: list[float], advantages: list[float]):
    d = torch.tensor(log_ratios)[:, None]
    old = torch.full_like(d, -1.0)
    return (old + d).requires_grad_(True), old, torch.tensor(advantages), torch.ones_like(d)


@pytest.mark.parametrize("level", LEVELS)
def test_clip_removes_gradient_only_on_the_clipped_side(level: str) -> None:
    lo, hi = 0.2, 0.27
    big, small, inside = math.log(1.5), math.log(0.5), math.log(1.1)
    # rows: (A>0, s>1+hi) clipped; (A>0, s<1-lo) kept; (A<0, s<1-lo) clipped;
    #       (A<0, s>1+hi) kept; (A>0, inside) kept; (A<0, inside) kept.
    logp, old, adv, mask = one_token_per_row(
        [big, small, small, big, inside, inside], [1.0, 1.0, -1.0, -1.0, 2.0, -2.0]
    )
    loss, stats = policy_loss(logp, old, adv, mask, level=level, clip_low=lo, clip_high=hi)
    (grad,) = torch.autograd.grad(loss, logp)
    g = grad[:, 0]
    assert g[0] == 0 and g[2] == 0
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1, 1.1])
    # Kept rows: d(-s A / B)/dlogp = -s A / B with one token per row.
    for i in (1, 3, 4, 5):
        assert float(g[i]) == pytest.approx(float(-ratios[i] * adv[i] / 6), rel=1e-5)
    assert float(stats["clip_fraction_high"]) == pytest.approx(1 / 6)
    assert float(stats["clip_fraction_low"]) == pytest.approx(1 / 6)


@pytest.mark.parametrize("level", LEVELS)
def test_padding_changes_nothing(level: str) -> None:
    logp, old, adv, mask = random_batch(7, spread=0.3)
    extra = 4
    logp2 = torch.cat([logp.detach(), torch.full((6, extra), NAN)], 1).requires_grad_(True)
    old2 = torch.cat([old, torch.full((6, extra), -float("inf"))], 1)
    mask2 = torch.cat([mask, torch.zeros(6, extra, dtype=torch.bool)], 1)
    # Garbage (NaN, -inf) also at the original padded positions.
    with torch.no_grad():
        logp2[:, :9][~mask] = NAN
    old2[:, :9][~mask] = 123.0
    kw = dict(level=level, clip_low=0.2, clip_high=0.27)
    ref = logp.detach() + 0.1
    ref2 = torch.cat([ref, torch.zeros(6, extra)], 1)
    l1, s1 = policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.05, **kw)
    l2, s2 = policy_loss(logp2, old2, adv, mask2, ref_logprobs=ref2, kl_coef=0.05, **kw)
    torch.testing.assert_close(l1, l2)
    for key in s1:
        torch.testing.assert_close(s1[key], s2[key])
    (g1,) = torch.autograd.grad(l1, logp)
    (g2,) = torch.autograd.grad(l2, logp2)
    assert torch.isfinite(g2).all()
    torch.testing.assert_close(g2[:, :9], torch.where(mask, g1, 0))
    assert torch.equal(g2[:, 9:], torch.zeros(6, extra))


def test_grpo_differs_from_gspo_off_policy() -> None:
    # A guard that the levels are not secretly the same computation.
    logp, old, adv, mask = random_batch(1, spread=0.5)
    kw = dict(clip_low=0.2, clip_high=0.27)
    a, _ = policy_loss(logp, old, adv, mask, level="token", **kw)
    b, _ = policy_loss(logp, old, adv, mask, level="sequence", **kw)
    assert abs((a - b).item()) > 1e-3


def test_level_names() -> None:
    assert set(POLICY_LOSSES) == set(LEVELS)
    assert set(LEVEL_OF) == set(get_args(LossLevel))
    assert set(LEVEL_OF.values()) == set(LEVELS)
    logp, old, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match=r"'gspo'.*valid levels: \['sequence', 'sequence_token'"):
        policy_loss(logp, old, adv, mask, level="gspo", clip_low=0.2, clip_high=0.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(clip_low=0.0), "clip_low must lie in"),
        (dict(clip_low=1.0), "clip_low must lie in"),
        (dict(clip_high=-1.0), "clip_high must be > 0"),
        (dict(kl_coef=0.1), "needs ref_logprobs"),
        (dict(advantages=torch.zeros(5)), "advantages must be"),
        (dict(old_logprobs=torch.zeros(6, 8)), "old_logprobs has shape"),
    ],
)
def test_bad_input_is_named(kwargs, match) -> None:
    logp, old, adv, mask = random_batch(0)
    args = dict(old_logprobs=old, advantages=adv, clip_low=0.2, clip_high=0.2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, mask=mask, level="sequence", **args)
