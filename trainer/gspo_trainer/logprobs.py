"""Log-probabilities (and entropy) of the sampled tokens, without a full [B, T, V] log-softmax.

A naive `logits.float().log_softmax(-1).gather(...)` holds several float32 copies of the
vocabulary-wide tensor at once (the logits, the log-softmax, and both again as gradients in
backward). Here the rows are processed `chunk_size` tokens at a time inside a custom autograd
function that saves only one float per token (the log-sum-exp) and recomputes a chunk's logits in
backward, so the largest temporary is [chunk_size, V] in float32:

- `token_logprobs_from_hidden` starts from the final hidden states and the lm_head weight: the
  full logits never exist, in forward or backward. This is the learner's path.
- `token_logprobs` starts from logits the caller already has; only their gradient is full size.

Padded positions (mask 0) are skipped entirely: they cost no compute, give 0 and get no gradient,
whatever token id they hold. Scores are taken at `logits / temperature`, so the learner scores
under the temperature the engine sampled with.

The learner's loss goes one step further: `fused_loss.policy_loss_from_hidden` makes the
gradient in the forward pass and so skips the recompute (see BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from gspo_api.chunking import (  # noqa: F401  (re-exported: fused_loss, tests)
    DEFAULT_CHUNK_TOKENS,
    GPU_CHUNK_BYTES_PER_LOGIT,
    GPU_CHUNK_MEMORY_SHARE,
    GPU_CHUNK_TOKENS,
    chunk_tokens,
)

if TYPE_CHECKING:
    import torch


def device_chunk_tokens(device: torch.device, vocab: int) -> int:
    """`chunk_tokens` for a torch device (a CUDA device's total memory read from it)."""
    import torch

    if device.type != "cuda":
        return chunk_tokens(device.type, vocab)
    return chunk_tokens("cuda", vocab, torch.cuda.get_device_properties(device).total_memory)


def _add_head_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (V, H) += g.T @ h, g (n, V) and h (n, H) in the weight's dtype, accumulated in
    grad_w's float32 without a (V, H) temporary: for a bf16 weight a plain `g.T @ h` would
    make one in bf16 per chunk (rounded to 8 bits before it is added). CUDA's matmul writes
    bf16 products straight into a float32 output (`out_dtype`); elsewhere the chunk's two
    small factors are upcast instead ((n, V) and (n, H) temporaries)."""
    import torch

    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.T, h)
    elif grad_w.is_cuda and _MIXED_MATMUL[0]:
        try:
            torch.addmm(grad_w, g.T, h, out_dtype=grad_w.dtype, out=grad_w)
        except (TypeError, RuntimeError):  # a torch without out_dtype for this pair
            _MIXED_MATMUL[0] = False
            _add_head_grad(grad_w, g, h)
    else:
        grad_w.addmm_(g.T.to(grad_w.dtype), h.to(grad_w.dtype))


_MIXED_MATMUL = [True]  # whether this torch's CUDA matmul takes out_dtype (found on first use)


class TokenScores(NamedTuple):
    """Per-token scores of the sampled tokens, float32 (float64 for float64 inputs), 0 where
    the mask is 0."""

    logp: torch.Tensor  # (B, T)
    entropy: torch.Tensor | None  # (B, T), None unless asked for


def _chunk_forward(
    z: torch.Tensor, tokens: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-sum-exp, sampled-token log-prob and entropy of one float32 chunk z (n, V)."""
    import torch

    lse = torch.logsumexp(z, dim=-1)  # (n,)
    logp = z.gather(1, tokens[:, None]).squeeze(1) - lse
    if not want_entropy:
        return lse, logp, None
    p = (z - lse[:, None]).exp_()  # (n, V)
    # H = lse - sum_v p_v z_v; the batched dot keeps it to one (n, V) temporary.
    entropy = lse - (p.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
    return lse, logp, entropy


def _chunk_grad(
    z: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    inv_temperature: float,
) -> torch.Tensor:
    """Gradient w.r.t. the chunk's unscaled logits; overwrites z (n, V) float32.

    d logp_k / d z_v = [v == k] - p_v and d H / d z_v = -p_v (log p_v + H), so the whole
    gradient is p_v * -(g_logp + g_H (log p_v + H)) plus g_logp at the sampled token; both are
    then divided by the temperature (z = logits / T).
    """
    import torch

    n = z.shape[0]
    g_lp = g_logp if g_logp is not None else z.new_zeros(n)
    g_lp = g_lp.to(z.dtype) * inv_temperature
    z.sub_(lse[:, None])  # log p, in place
    p = torch.exp(z)
    if g_entropy is not None and entropy is not None:
        g_h = g_entropy.to(z.dtype) * inv_temperature
        z.add_(entropy[:, None]).mul_(g_h[:, None]).add_(g_lp[:, None])
        p.mul_(z).neg_()
    else:
        p.mul_(-g_lp[:, None])
    p.scatter_add_(1, tokens[:, None], g_lp[:, None])
    return p  # (n, V)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: never below float32 for the softmax."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def _upcast(z: torch.Tensor) -> torch.Tensor:
    return z.to(_compute_dtype(z.dtype))


def _span(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _forward_chunks(
    n: int,
    chunk: int,
    logits_of: Callable[[int, int], torch.Tensor],
    tokens: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """lse, logp and entropy of n rows whose logits `logits_of(start, end)` makes a chunk at
    a time, so that no (n, V) float32 tensor ever exists."""
    import torch

    lse = like.new_empty(n, dtype=_compute_dtype(like.dtype))
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if want_entropy else None
    for s, e in _span(n, chunk):
        z = _upcast(logits_of(s, e))
        if temperature != 1.0:
            z.div_(temperature)
        lse[s:e], logp[s:e], ent = _chunk_forward(z, tokens[s:e], want_entropy)
        if entropy is not None and ent is not None:  # both or neither: want_entropy
            entropy[s:e] = ent
    return lse, logp, entropy


def _hidden_fn() -> Any:
    import torch

    class _FromHidden(torch.autograd.Function):
        """logp (and entropy) of `tokens` under softmax(hidden @ weight.T / T), chunked."""

        @staticmethod
        def forward(ctx, hidden, weight, tokens, chunk, temperature, want_entropy):
            # hidden (n, H), weight (V, H), tokens (n,)
            lse, logp, entropy = _forward_chunks(
                hidden.shape[0],
                chunk,
                lambda s, e: hidden[s:e] @ weight.T,
                tokens,
                temperature,
                want_entropy,
                hidden,
            )
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(hidden, weight, tokens, lse, entropy)
            ctx.chunk, ctx.temperature = chunk, temperature
            return (logp, entropy) if want_entropy else logp

        @staticmethod
        def backward(ctx, g_logp, g_entropy=None):
            hidden, weight, tokens, lse, entropy = ctx.saved_tensors
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            if (g_logp is None and g_entropy is None) or not (need_h or need_w):
                return None, None, None, None, None, None
            grad_h = torch.empty_like(hidden) if need_h else None
            # float32 accumulator: one rounding per chunk, not per token, for bf16 weights.
            grad_w = weight.new_zeros(weight.shape, dtype=lse.dtype) if need_w else None
            inv_t = 1.0 / ctx.temperature
            for s, e in _span(hidden.shape[0], ctx.chunk):
                h = hidden[s:e]
                z = _upcast(h @ weight.T)
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                g = _chunk_grad(
                    z,
                    tokens[s:e],
                    lse[s:e],
                    entropy[s:e] if entropy is not None else None,
                    g_logp[s:e] if g_logp is not None else None,
                    g_entropy[s:e] if g_entropy is not None else None,
                    inv_t,
                ).to(weight.dtype)  # (c, V)
                if grad_h is not None:
                    torch.mm(g, weight, out=grad_h[s:e])  # (c, H)
                if grad_w is not None:
                    _add_head_grad(grad_w, g, h)
            if grad_w is not None:
                grad_w = grad_w.to(weight.dtype)
            return grad_h, grad_w, None, None, None, None

    return _FromHidden


def _logits_fn() -> Any:
    import torch

    class _FromLogits(torch.autograd.Function):
        """logp (and entropy) of `tokens` at `rows` of logits (N, V) / T, chunked."""

        @staticmethod
        def forward(ctx, logits, rows, tokens, chunk, temperature, want_entropy):
            lse, logp, entropy = _forward_chunks(
                rows.shape[0],
                chunk,
                lambda s, e: logits.index_select(0, rows[s:e]),
                tokens,
                temperature,
                want_entropy,
                logits,
            )
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(logits, rows, tokens, lse, entropy)
            ctx.chunk, ctx.temperature = chunk, temperature
            return (logp, entropy) if want_entropy else logp

        @staticmethod
        def backward(ctx, g_logp, g_entropy=None):
            logits, rows, tokens, lse, entropy = ctx.saved_tensors
            if g_logp is None and g_entropy is None:
                return None, None, None, None, None, None
            every_row = rows.shape[0] == logits.shape[0]  # rows are sorted and unique
            grad = torch.empty_like(logits) if every_row else torch.zeros_like(logits)
            for s, e in _span(rows.shape[0], ctx.chunk):
                z = _upcast(logits.index_select(0, rows[s:e]))
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                g = _chunk_grad(
                    z,
                    tokens[s:e],
                    lse[s:e],
                    entropy[s:e] if entropy is not None else None,
                    g_logp[s:e] if g_logp is not None else None,
                    g_entropy[s:e] if g_entropy is not None else None,
                    1.0 / ctx.temperature,
                )
                if every_row:
                    grad[s:e] = g
                else:
                    grad.index_copy_(0, rows[s:e], g.to(grad.dtype))
            return grad, None, None, None, None, None

    return _FromLogits


_FUNCTIONS: dict[str, Any] = {}


def _function(name: str) -> Any:
    if name not in _FUNCTIONS:
        _FUNCTIONS[name] = _hidden_fn() if name == "hidden" else _logits_fn()
    return _FUNCTIONS[name]


def _check(tokens: Any, mask: Any, lead: tuple[int, ...], chunk_size: int, temperature: float):
    if tuple(tokens.shape) != lead:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected {lead}")
    if mask is not None and tuple(mask.shape) != lead:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {lead} like tokens")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampling temperature), got {temperature}")


def _layout(
    tokens: torch.Tensor, mask: torch.Tensor | None, vocab: int
) -> tuple[torch.Tensor, list[int]]:
    """(rows, counts): the flat indices of the scored positions (sorted, on the tokens'
    device) and how many each row (B, T) holds, after checking their token ids. One read from
    the device, the mask and the ids together: on a GPU each read waits for the work queued
    before it, and finding the positions (nonzero), checking the ids (min, max) and counting
    per row would each be one."""
    import numpy as np
    import torch

    lead = tuple(tokens.shape)
    flat = tokens.reshape(-1)
    keep = torch.ones_like(flat) if mask is None else mask.reshape(-1).to(flat.dtype)
    host = torch.cat([keep, flat]).cpu().numpy()  # the one read; the rest is host work
    keep_h, flat_h = host[: flat.numel()].astype(bool), host[flat.numel() :]
    picked = flat_h[keep_h]
    if picked.size and (picked.min() < 0 or picked.max() >= vocab):
        raise ValueError(
            f"token ids at unmasked positions must lie in [0, {vocab}); got "
            f"[{picked.min()}, {picked.max()}] (mask padded positions out)"
        )
    counts = keep_h.reshape(lead[0] if lead else 1, -1).sum(-1).tolist()
    rows = torch.from_numpy(np.flatnonzero(keep_h))
    if flat.device.type != "cpu":
        rows = rows.pin_memory().to(flat.device, non_blocking=True)
    return rows, counts


def _scatter(values: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Place per-row values back into a zero (B, T) tensor (differentiable)."""
    out = values.new_zeros(math.prod(shape))
    return out.index_copy(0, rows, values).view(shape)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> TokenScores:
    """log softmax(logits / T)[tokens] per position, from logits (B, T, V) and tokens (B, T).

    logits[b, t] must already be the distribution that produced tokens[b, t] (shift before
    calling). Equal to `(logits.float() / T).log_softmax(-1).gather(-1, tokens)` where mask is
    1 and 0 elsewhere, but never holds more than a [chunk_size, V] float32 temporary besides
    the logits' own gradient.
    """
    lead = tuple(logits.shape[:-1])
    _check(tokens, mask, lead, chunk_size, temperature)
    vocab = logits.shape[-1]
    rows, _ = _layout(tokens, mask, vocab)
    flat_tokens = tokens.reshape(-1).index_select(0, rows)
    out = _function("logits").apply(
        logits.reshape(-1, vocab), rows, flat_tokens, chunk_size, float(temperature), with_entropy
    )
    logp, entropy = out if with_entropy else (out, None)
    return TokenScores(
        _scatter(logp, rows, lead),
        _scatter(entropy, rows, lead) if entropy is not None else None,
    )


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> TokenScores:
    """log softmax(hidden @ W.T / T)[tokens] per position, never forming the full logits.

    hidden (B, T, H) are the final hidden states (after the last norm) whose row [b, t]
    predicts tokens[b, t]; lm_head_weight is (V, H) (an lm_head without bias). Gradients flow
    to both hidden and the weight; backward recomputes each chunk's logits (one extra matmul
    per chunk: the price of never holding [B, T, V]).
    """
    lead = tuple(hidden.shape[:-1])
    _check(tokens, mask, lead, chunk_size, temperature)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; expected (vocab, "
            f"{hidden.shape[-1]}) to match hidden's last dimension"
        )
    rows, _ = _layout(tokens, mask, lm_head_weight.shape[0])
    h = hidden.reshape(-1, hidden.shape[-1])
    if rows.numel() != h.shape[0]:
        h = h.index_select(0, rows)
    flat_tokens = tokens.reshape(-1).index_select(0, rows)
    if h.dtype != lm_head_weight.dtype:
        h = h.to(lm_head_weight.dtype)
    out = _function("hidden").apply(
        h, lm_head_weight, flat_tokens, chunk_size, float(temperature), with_entropy
    )
    logp, entropy = out if with_entropy else (out, None)
    return TokenScores(
        _scatter(logp, rows, lead),
        _scatter(entropy, rows, lead) if entropy is not None else None,
    )
