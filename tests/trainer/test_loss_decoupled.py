"""The decoupled objective for stale rollouts: clip against the proximal policy, weight by
proximal / behaviour, truncated; checked against a per-response loop written from the formula."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_trainer.loss import importance_weights, policy_loss

CLIP = {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4), "token": (0.2, 0.27)}


def case(seed: int, b: int = 6, t: int = 5):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = (prox + torch.randn(b, t, generator=g) * 2e-4).requires_grad_(True)
    behaviour = prox + torch.randn(b, t, generator=g) * 0.3  # an older version sampled
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    return logp, prox, behaviour, adv, mask


def reference(logp, prox, behaviour, adv, mask, level, cap):  # type: ignore[no-untyped-def]
    """The decoupled loss, one response and one token at a time: adv (B,), or (B, T) per
    token, each token's term then weighted by its own pi_prox / mu."""
    lo, hi = CLIP[level]
    total = 0.0
    for i in range(logp.shape[0]):
        toks = [j for j in range(logp.shape[1]) if mask[i, j]]
        if level == "token" or adv.dim() == 2:
            s = math.exp(sum(logp[i, j] - prox[i, j] for j in toks) / len(toks))
            terms = []
            for j in toks:
                r = math.exp(logp[i, j] - prox[i, j]) if level == "token" else s
                a = adv[i, j] if adv.dim() == 2 else adv[i]
                w = min(math.exp(prox[i, j] - behaviour[i, j]), cap)
                clipped = min(max(r, 1 - lo), 1 + hi)
                terms.append(-w * min(r * a, clipped * a))
            total += sum(terms) / len(toks)
        else:
            s = math.exp(sum(logp[i, j] - prox[i, j] for j in toks) / len(toks))
            w = min(math.exp(sum(prox[i, j] - behaviour[i, j] for j in toks) / len(toks)), cap)
            clipped = min(max(s, 1 - lo), 1 + hi)
            total += -w * min(s * adv[i], clipped * adv[i])
    return total / logp.shape[0]


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("cap", [1.2, 5.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_formula(level: str, cap: float, seed: int) -> None:
    logp, prox, behaviour, adv, mask = case(seed)
    lo, hi = CLIP[level]
    loss, stats = policy_loss(logp, prox, adv, mask, level=level, clip_low=lo, clip_high=hi,
                              behaviour_logprobs=behaviour, is_cap=cap)  # fmt: skip
    want = reference(logp.detach().double(), prox.double(), behaviour.double(), adv.double(),
                     mask, level, cap)  # fmt: skip
    assert loss.item() == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    assert 0.0 <= float(stats["importance_truncated_fraction"]) <= 1.0


@pytest.mark.parametrize("level", ["sequence_token", "token"])
@pytest.mark.parametrize("cap", [1.2, 5.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_per_token_advantages_take_per_token_weights(level: str, cap: float, seed: int) -> None:
    """GSPO-token on A_i,t (a per-token reward, lossLevel gspo-token), like GRPO: each token's
    term is weighted by that token's own pi_prox / mu, not by its response's geometric mean."""
    logp, prox, behaviour, _, mask = case(seed)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed + 10))
    lo, hi = CLIP[level]
    kw = dict(level=level, clip_low=lo, clip_high=hi, is_cap=cap)
    loss, stats = policy_loss(logp, prox, adv, mask, behaviour_logprobs=behaviour, **kw)
    doubles = (t.detach().double() for t in (logp, prox, behaviour, adv))
    want = reference(*doubles, mask, level, cap)
    assert loss.item() == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    raw = (prox - behaviour).exp()[mask]  # the statistics count tokens
    assert float(stats["importance_weight_max"]) == pytest.approx(float(raw.max()), rel=1e-6)
    assert float(stats["importance_truncated_fraction"]) == pytest.approx(
        float((raw > cap).float().mean())
    )


def test_a_token_the_last_update_made_less_likely_weighs_less() -> None:
    """One response of two tokens, both with advantage -1, sampled one version back: the
    last update made token 0 less likely (mu = e^0.5 pi_prox) and token 1 more likely (mu =
    e^-0.5 pi_prox). Their geometric mean is 1, which would push token 0 down again at the
    older version's higher sampling rate; each token's own weight scales its gradient to
    what pi_prox would have sampled: e^-0.5 and e^0.5."""
    prox = torch.tensor([[-1.0, -2.0]])
    logp = prox.clone().requires_grad_(True)
    behaviour = prox + torch.tensor([[0.5, -0.5]])
    adv, mask = torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    kw = dict(level="sequence_token", clip_low=3e-4, clip_high=4e-4, is_cap=2.0)
    loss, _ = policy_loss(logp, prox, adv, mask, behaviour_logprobs=behaviour, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    # d loss / d logp_t = -A_t w_t s / |y| with s = 1 at pi_theta = pi_prox
    want = torch.tensor([[math.exp(-0.5), math.exp(0.5)]]) / 2
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
def test_behaviour_equal_to_proximal_is_the_on_policy_loss(level: str) -> None:
    """maxStaleness 0: mu = pi_prox, every weight 1, the loss and its gradient unchanged."""
    logp, prox, _, adv, mask = case(3)
    lo, hi = CLIP[level]
    plain, _ = policy_loss(logp, prox, adv, mask, level=level, clip_low=lo, clip_high=hi)
    (g_plain,) = torch.autograd.grad(plain, logp)
    same, stats = policy_loss(logp, prox, adv, mask, level=level, clip_low=lo, clip_high=hi,
                              behaviour_logprobs=prox.clone(), is_cap=2.0)  # fmt: skip
    (g_same,) = torch.autograd.grad(same, logp)
    assert same.item() == plain.item()
    torch.testing.assert_close(g_same, g_plain, rtol=0, atol=0)
    assert (
        float(stats["importance_weight_mean"]) == 1.0
        and float(stats["importance_truncated_fraction"]) == 0.0
    )


def test_weights_scale_the_gradient_and_carry_none_themselves() -> None:
    """A response sampled by a policy that made it twice as likely as pi_prox does (weight
    1/2) moves pi_theta half as far; the weight is a constant (no gradient flows into mu or
    pi_prox)."""
    logp, prox, _, adv, mask = case(4)
    behaviour = prox + math.log(2.0)  # mu = 2 pi_prox on every token: weight exactly 1/2
    plain, _ = policy_loss(logp, prox, adv, mask, level="sequence", clip_low=3e-4,
                           clip_high=4e-4)  # fmt: skip
    (g_plain,) = torch.autograd.grad(plain, logp)
    half, stats = policy_loss(logp, prox, adv, mask, level="sequence", clip_low=3e-4,
                              clip_high=4e-4, behaviour_logprobs=behaviour)  # fmt: skip
    (g_half,) = torch.autograd.grad(half, logp)
    torch.testing.assert_close(g_half, g_plain / 2)
    assert float(stats["importance_weight_mean"]) == pytest.approx(0.5)


def test_truncation_and_its_statistics() -> None:
    prox = torch.zeros(3, 2)
    behaviour = torch.tensor([[0.0, 0.0], [-1.0, -1.0], [-3.0, 0.0]])  # weights 1, e, e^1.5
    mask = torch.ones(3, 2, dtype=torch.bool)
    w, stats = importance_weights(prox, behaviour, mask, token_level=False, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, 2.0]))
    assert float(stats["importance_weight_max"]) == pytest.approx(math.exp(1.5), rel=1e-6)
    assert float(stats["importance_truncated_fraction"]) == pytest.approx(2 / 3)
    tw, tstats = importance_weights(prox, behaviour, mask, token_level=True, cap=2.0)
    torch.testing.assert_close(tw, torch.tensor([[1.0, 1.0], [2.0, 2.0], [2.0, 1.0]]))
    assert float(tstats["importance_truncated_fraction"]) == pytest.approx(3 / 6)


def test_a_cap_below_one_is_refused() -> None:
    logp, prox, behaviour, adv, mask = case(5)
    with pytest.raises(ValueError, match="is_cap must be >= 1"):
        policy_loss(logp, prox, adv, mask, level="sequence", clip_low=3e-4, clip_high=4e-4,
                    behaviour_logprobs=behaviour, is_cap=0.5)  # fmt: skip
