"""policy_loss_from_hidden equals token_logprobs_from_hidden + policy_loss, values and gradients."""

from __future__ import annotations

import pytest
import torch

from gspo_trainer.fused_loss import _groups, policy_loss_from_hidden
from gspo_trainer.logprobs import token_logprobs_from_hidden
from gspo_trainer.loss import LossOptions, policy_loss


def batch(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = 5, 9, 8, 23
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([9, 2, 5, 1, 7])[:, None]
    tokens[~mask] = -1
    with torch.no_grad():
        logp = token_logprobs_from_hidden(hidden, weight, tokens, 4, 0.7, mask=mask).logp
    # pi_old a little off pi so that some ratios leave the clip band at every level.
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=logp.dtype)
    old = old + 0.5 * torch.randn(B, 1, generator=g, dtype=logp.dtype)  # whole responses too
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=logp.dtype)
    adv = torch.randn(B, generator=g, dtype=logp.dtype)
    return hidden, weight, tokens, mask, old, adv, ref


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("chunk_size", [1, 4, 8, 100])  # 4 and 8 split the 9-token response
@pytest.mark.parametrize("off_policy", [False, True])
def test_equals_unfused_path(level: str, chunk_size: int, off_policy: bool) -> None:
    hidden, weight, tokens, mask, old, adv, ref = batch(torch.float64)
    kw = dict(level=level, clip_low=0.2, clip_high=0.27, kl_coef=0.1)
    tensors = dict(ref_logprobs=ref)
    if off_policy:  # the decoupled objective: a sampler mu apart from pi_old, weights truncated
        mu = old + 0.4 * torch.randn(
            old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype
        )
        kw.update(is_cap=1.2)
        tensors.update(behaviour_logprobs=mu)
    scores = token_logprobs_from_hidden(
        hidden, weight, tokens, 4, 0.7, mask=mask, with_entropy=True
    )
    want, want_stats = policy_loss(scores.logp, old, adv, mask, **kw, **tensors)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got, stats, got_scores = policy_loss_from_hidden(
        hidden,
        weight,
        tokens,
        mask,
        old,
        adv,
        LossOptions(**kw),
        temperature=0.7,
        chunk_size=chunk_size,
        **tensors,
    )
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
    for key in want_stats:
        torch.testing.assert_close(stats[key], want_stats[key])
    torch.testing.assert_close(got_scores.logp, scores.logp.detach())
    torch.testing.assert_close(got_scores.entropy, scores.entropy.detach())
    assert float(stats["clip_fraction_low"] + stats["clip_fraction_high"]) > 0  # the clip binds
    if off_policy:  # weights differ per response, and some are truncated
        assert 0 < float(stats["importance_truncated_fraction"]) < 1


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_the_entropy_bonus_equals_autograd_over_the_whole_softmax(
    level: str, chunk_size: int
) -> None:
    """loss - coef x mean over responses of each response's mean token entropy, the entropy
    taken from the full logits by autograd, nothing of the fused path reused."""
    hidden, weight, tokens, mask, old, adv, _ = batch(torch.float64)
    coef, temperature = 0.3, 0.7
    kw = dict(level=level, clip_low=0.2, clip_high=0.27)
    logits = hidden @ weight.T / temperature  # (B, T, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(2, tokens.clamp(min=0)[..., None]).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T)
    per_response = (entropy * mask).sum(1) / mask.sum(1)
    want = policy_loss(logp, old, adv, mask, **kw)[0] - coef * per_response.mean()
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got, stats, scores = policy_loss_from_hidden(
        hidden,
        weight,
        tokens,
        mask,
        old,
        adv,
        LossOptions(**kw, entropy_coef=coef),
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=False,  # the bonus computes it anyway
    )
    got_grads = torch.autograd.grad(got, (hidden, weight))
    exact = dict(rtol=1e-12, atol=1e-12)  # float64 throughout: nothing rounded to float32
    torch.testing.assert_close(got, want, **exact)
    torch.testing.assert_close(stats["loss"], want.detach(), **exact)  # the loss it logs
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **exact)
    assert scores.entropy is not None
    torch.testing.assert_close(scores.entropy[mask], entropy[mask].detach())
    # The bonus moves the gradient: without it the same call differs.
    plain, _, _ = policy_loss_from_hidden(
        hidden, weight, tokens, mask, old, adv, LossOptions(**kw), temperature=temperature
    )
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    assert not torch.allclose(plain_grads[1], got_grads[1])


def test_bfloat16_close_to_unfused() -> None:
    hidden, weight, tokens, mask, old, adv, _ = batch(torch.bfloat16)
    kw = dict(level="sequence", clip_low=0.2, clip_high=0.27)
    logp = token_logprobs_from_hidden(hidden, weight, tokens, 4, mask=mask).logp
    want = torch.autograd.grad(policy_loss(logp, old, adv, mask, **kw)[0], (hidden, weight))
    got_loss, _, _ = policy_loss_from_hidden(
        hidden, weight, tokens, mask, old, adv, LossOptions(**kw), chunk_size=3
    )
    got = torch.autograd.grad(got_loss, (hidden, weight))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_upstream_gradient_scales_and_one_backward_only() -> None:
    hidden, weight, tokens, mask, old, adv, _ = batch(torch.float64)
    kw = dict(level="sequence", clip_low=0.2, clip_high=0.27)
    loss, _, _ = policy_loss_from_hidden(hidden, weight, tokens, mask, old, adv, LossOptions(**kw))
    (g3,) = torch.autograd.grad(3 * loss, weight, retain_graph=True)
    loss2, _, _ = policy_loss_from_hidden(hidden, weight, tokens, mask, old, adv, LossOptions(**kw))
    (g1,) = torch.autograd.grad(loss2, weight)
    torch.testing.assert_close(g3, 3 * g1)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        torch.autograd.grad(loss, weight)


def test_groups_hold_whole_responses() -> None:
    assert _groups([3, 3, 3], 6) == [(0, 2), (2, 3)]
    assert _groups([10, 1, 1], 4) == [(0, 1), (1, 3)]  # a long response stands alone
    assert _groups([0, 0, 2], 1) == [(0, 2), (2, 3)]
    assert _groups([], 4) == []


def test_the_chunk_follows_the_device() -> None:
    """256 tokens on a CPU; thousands on a GPU, sized by its memory and the vocabulary."""
    from gspo_trainer.logprobs import DEFAULT_CHUNK_TOKENS, chunk_tokens

    assert chunk_tokens("cpu", 151_936) == DEFAULT_CHUNK_TOKENS == 256
    h100 = 80 * 10**9
    assert chunk_tokens("cuda", 151_936, h100) == 3072  # Qwen3's vocabulary
    assert chunk_tokens("cuda", 32_000, h100) == 15616
    assert chunk_tokens("cuda", 151_936, 8 * 10**9) == 1024  # the floor
    assert chunk_tokens("cuda", 1_000, h100) == 16384  # the ceiling


def test_the_head_gradient_accumulates_in_float32_without_a_bf16_product() -> None:
    """A chunk's bf16 product g.T @ h lands in the float32 accumulator unrounded: the sum
    equals float32 arithmetic on the bf16 factors, not a bf16 (V, H) block added to it."""
    from gspo_trainer.logprobs import _add_head_grad

    g_ = torch.Generator().manual_seed(0)
    acc, bf16_blocks = torch.zeros(64, 16), torch.zeros(64, 16)
    want = torch.zeros(64, 16, dtype=torch.float64)
    for _ in range(3):
        g = torch.randn(40, 64, generator=g_).bfloat16()
        h = torch.randn(40, 16, generator=g_).bfloat16()
        _add_head_grad(acc, g, h)
        bf16_blocks.add_(g.T @ h)  # what a bf16 temporary per chunk gives
        want += g.double().T @ h.double()
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(bf16_blocks.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_responses_longer_than_a_chunk_match_the_float32_reference(level: str) -> None:
    """bf16 hidden states and head, responses of 600 and 300 tokens in chunks of 256: loss
    and both gradients as float32 autograd over the full logits gives them."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 600, 16, 96
    hidden = torch.randn(B, T, H, generator=g).bfloat16().requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / 4).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([600, 300, 40])[:, None]
    old = -torch.rand(B, T, generator=g) * 3 - 2
    adv = torch.tensor([1.0, -0.5, 0.7])
    kw = dict(level=level, clip_low=0.2, clip_high=0.27)
    h32 = hidden.detach().float().requires_grad_(True)
    w32 = weight.detach().float().requires_grad_(True)
    logp = (h32 @ w32.T).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    want, _ = policy_loss(logp, old, adv, mask, **kw)
    want.backward()
    loss, _, _ = policy_loss_from_hidden(
        hidden, weight, tokens, mask, old, adv, LossOptions(**kw), chunk_size=256
    )
    loss.backward()
    torch.testing.assert_close(loss.float(), want, rtol=1e-3, atol=1e-4)
    for got, ref in ((hidden.grad, h32.grad), (weight.grad, w32.grad)):
        scale = ref.abs().max()
        torch.testing.assert_close(got.float() / scale, ref / scale, rtol=0, atol=2e-2)


def test_the_spec_entropy_coef_reaches_the_loss_options() -> None:
    from gspo_api.validation import parse_spec
    from gspo_trainer.jobs import tiny_manifest
    from gspo_trainer.step.update import loss_options

    raw = tiny_manifest()["spec"]
    raw["algorithm"]["entropyCoef"] = 0.02
    options = loss_options(parse_spec(raw).algorithm, behaviour=False)
    assert options.entropy_coef == 0.02
    raw["algorithm"]["entropyCoef"] = -0.1
    with pytest.raises(ValueError, match=r"spec\.algorithm\.entropyCoef"):
        parse_spec(raw)
