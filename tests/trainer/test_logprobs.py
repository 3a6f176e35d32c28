"""Chunked token log-probs and entropy against the naive full log-softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from gspo_trainer.logprobs import token_logprobs, token_logprobs_from_hidden


def naive(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float):
    """The reference: a full float32 (or float64) log-softmax, gathered, zero where masked."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    logsm = (z / temperature).log_softmax(-1)
    logp = logsm.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(mask, logp, zero), torch.where(mask, entropy, zero)


def make(dtype: torch.dtype, B: int = 3, T: int = 7, H: int = 16, V: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[-1, 1:] = False
    tokens[~mask] = -100  # padded ids may be anything: they are never read
    g_logp = torch.randn(B, T, generator=g)
    g_ent = torch.randn(B, T, generator=g)
    return hidden, weight, tokens, mask, g_logp, g_ent


def grads(outputs, inputs, g_logp, g_ent):
    logp, entropy = outputs
    objective = (logp.float() * g_logp).sum() + (entropy.float() * g_ent).sum()
    return torch.autograd.grad(objective, inputs)


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_hidden_path_matches_naive(dtype, temperature, chunk_size) -> None:
    hidden, weight, tokens, mask, g_logp, g_ent = make(dtype)
    ours = token_logprobs_from_hidden(
        hidden, weight, tokens, chunk_size, temperature, mask=mask, with_entropy=True
    )
    ref = naive(hidden @ weight.T, tokens, mask, temperature)
    assert ours.logp.dtype == torch.float32
    torch.testing.assert_close(ours.logp, ref[0], **TOL[dtype])
    torch.testing.assert_close(ours.entropy, ref[1], **TOL[dtype])
    got = grads(ours, (hidden, weight), g_logp, g_ent)
    want = grads(ref, (hidden, weight), g_logp, g_ent)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_logits_path_matches_naive(dtype, temperature) -> None:
    hidden, weight, tokens, mask, g_logp, g_ent = make(dtype)
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    ours = token_logprobs(logits, tokens, mask, 2, temperature=temperature, with_entropy=True)
    ref = naive(logits, tokens, mask, temperature)
    torch.testing.assert_close(ours.logp, ref[0], **TOL[dtype])
    torch.testing.assert_close(ours.entropy, ref[1], **TOL[dtype])
    (got,) = grads(ours, (logits,), g_logp, g_ent)
    (want,) = grads(ref, (logits,), g_logp, g_ent)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_float64_gradcheck_both_paths() -> None:
    hidden, weight, tokens, mask, _, _ = make(torch.float64, B=2, T=5, H=4, V=5)

    def from_hidden(h, w):
        s = token_logprobs_from_hidden(h, w, tokens, 2, 0.8, mask=mask, with_entropy=True)
        return s.logp, s.entropy

    def from_logits(z):
        s = token_logprobs(z, tokens, mask, 2, temperature=0.8, with_entropy=True)
        return s.logp, s.entropy

    assert torch.autograd.gradcheck(from_hidden, (hidden, weight))
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(from_logits, (logits,))


def test_padding_gives_zero_value_and_no_gradient() -> None:
    hidden, weight, tokens, mask, _, _ = make(torch.float32)
    with torch.no_grad():
        hidden[~mask] = float("nan")  # whatever sits at padded rows must not leak
    scores = token_logprobs_from_hidden(hidden, weight, tokens, 3, mask=mask, with_entropy=True)
    assert torch.equal(scores.logp[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(scores.entropy[~mask], torch.zeros(int((~mask).sum())))
    assert torch.isfinite(scores.logp).all()
    assert (scores.logp[mask] < 0).all()
    gh, gw = torch.autograd.grad(scores.logp.sum() + scores.entropy.sum(), (hidden, weight))
    assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask]))
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_extra_padding_columns_change_nothing() -> None:
    hidden, weight, tokens, mask, _, _ = make(torch.float32)
    pad = 5
    hidden2 = torch.cat([hidden, torch.randn(3, pad, 16)], 1)
    tokens2 = torch.cat([tokens, torch.full((3, pad), 7)], 1)
    mask2 = torch.cat([mask, torch.zeros(3, pad, dtype=torch.bool)], 1)
    a = token_logprobs_from_hidden(hidden, weight, tokens, 4, mask=mask).logp
    b = token_logprobs_from_hidden(hidden2, weight, tokens2, 4, mask=mask2).logp
    torch.testing.assert_close(b[:, :-pad], a, rtol=0, atol=1e-6)


def test_without_mask_scores_every_position() -> None:
    hidden, weight, tokens, _, _, _ = make(torch.float32)
    tokens = tokens.clamp(min=0)
    scores = token_logprobs_from_hidden(hidden, weight, tokens, 4)
    ref, _ = naive(hidden @ weight.T, tokens, torch.ones_like(tokens, dtype=torch.bool), 1.0)
    assert scores.entropy is None
    torch.testing.assert_close(scores.logp, ref, **TOL[torch.float32])


def test_entropy_of_uniform_is_log_vocab() -> None:
    logits = torch.zeros(2, 3, 50)
    scores = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    torch.testing.assert_close(
        scores.entropy, torch.full((2, 3), torch.log(torch.tensor(50.0)).item())
    )
    torch.testing.assert_close(
        scores.logp, torch.full((2, 3), -torch.log(torch.tensor(50.0)).item())
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (dict(tokens=torch.full((3, 7), 37)), "token ids at unmasked positions"),
        (dict(tokens=torch.zeros(3, 6, dtype=torch.long)), "tokens has shape"),
    ],
)
def test_bad_input_is_named(kwargs, match) -> None:
    hidden, weight, tokens, mask, _, _ = make(torch.float32)
    args = dict(tokens=tokens, chunk_size=4, temperature=1.0)
    args.update(kwargs)
    m = mask if args["tokens"].shape == mask.shape else None
    with pytest.raises(ValueError, match=match):
        token_logprobs_from_hidden(hidden, weight, mask=m, **args)


def test_weight_shape_mismatch_is_named() -> None:
    hidden, weight, tokens, mask, _, _ = make(torch.float32)
    with pytest.raises(ValueError, match="lm_head_weight has shape"):
        token_logprobs_from_hidden(hidden, weight.T, tokens, mask=mask)
