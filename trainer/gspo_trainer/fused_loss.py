"""The policy loss straight from hidden states, with the gradient made during the forward pass.

Every level's loss is a mean over responses of a per-response term, so once a group of whole
responses has its log-probs, its share of the gradient is known. `policy_loss_from_hidden`
walks the responses in groups of about `chunk_size` tokens: logits of the group (h @ W.T / T),
log-probs, then the loss gradient for those responses, then straight away the gradient w.r.t.
the group's hidden states and the lm_head weight, while the group's logits are still in hand.
The full logits never exist and no chunk is computed twice: three matmuls per token, as a
naive full log-softmax needs, against four for the recompute-in-backward path of
`token_logprobs_from_hidden`. A response longer than `chunk_size` is split and falls back to
recomputing its pieces; the learner sizes chunks by its device (`logprobs.chunk_tokens`:
256 tokens on a CPU, thousands on a GPU), so there that takes responses of thousands of
tokens. The lm_head's gradient accumulates in float32 (`_add_head_grad`). Backward only
scales the stored gradients by the upstream gradient.

Values and gradients equal `policy_loss(token_logprobs_from_hidden(...).logp, ...)`, less
the entropy bonus's term when options.entropy_coef > 0; the tests hold them to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gspo_trainer.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    TokenScores,
    _add_head_grad,
    _chunk_forward,
    _chunk_grad,
    _compute_dtype,
    _layout,
    _span,
    _upcast,
)
from gspo_trainer.loss import LossOptions, Stats

if TYPE_CHECKING:
    import torch


def _groups(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Contiguous runs of responses [a, b) holding at most `budget` scored tokens (or one)."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            groups.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        groups.append((start, len(lengths)))
    return groups


def _fused_fn() -> Any:
    import torch

    class _FusedLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, run):
            # Held as attributes, not saved tensors, so backward can hand them over without a
            # copy (autograd steals a gradient nobody else references).
            ctx.grads = run(hidden, weight)
            return torch.zeros((), dtype=_compute_dtype(weight.dtype), device=weight.device)

        @staticmethod
        def backward(ctx, g):
            if ctx.grads is None:
                raise RuntimeError("policy_loss_from_hidden supports one backward per forward")
            grad_h, grad_w = ctx.grads
            ctx.grads = None
            # Always scaled: testing g != 1 would read it on the host (a wait for the device),
            # and the learner's upstream gradient is a micro-batch's share anyway.
            grad_h.mul_(g)
            grad_w.mul_(g)
            return (
                grad_h if ctx.needs_input_grad[0] else None,
                (grad_w if ctx.needs_input_grad[1] else None),
                None,
            )

    return _FusedLoss


_FUSED: list[Any] = []


def policy_loss_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    options: LossOptions,
    *,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = True,
    behaviour_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats, TokenScores]:
    """`policy_loss` (under `options`) of the tokens' log-probs under
    softmax(hidden @ W.T / temperature).

    hidden (B, T, H) with row [b, t] predicting tokens[b, t]; lm_head_weight (V, H); the rest
    as in `policy_loss` (behaviour_logprobs with options.is_cap: its decoupled, off-policy
    form, weighted per token where the advantages are per token, else per response). Returns
    (loss, stats, detached TokenScores) where the scores (log-probs and, by default, entropy)
    are what the learner logs. Gradients reach hidden and the weight.

    old_logprobs None: πold is these log-probs themselves, detached (the weights have not
    changed since πold: the ratio is 1, its gradient the policy gradient), with no forward
    of its own.

    With options.entropy_coef > 0 the loss is that minus entropy_coef x the mean over
    responses of each response's mean token entropy (GSPO's own averaging, so a long response
    counts as much as a short one), its gradient made in the same pass (entropy is then
    always computed).
    """
    import torch

    if not _FUSED:
        _FUSED.append(_fused_fn())
    B, T, H = hidden.shape
    V = lm_head_weight.shape[0]
    if tuple(tokens.shape) != (B, T) or tuple(mask.shape) != (B, T):
        raise ValueError(f"tokens and mask must be (B, T)=({B}, {T}) like hidden's first two dims")
    if chunk_size < 1 or not temperature > 0:
        raise ValueError(
            f"need chunk_size >= 1 and temperature > 0; got {chunk_size}, {temperature}"
        )
    mask = mask.bool()
    rows, counts = _layout(tokens, mask, V)  # sorted flat indices of scored tokens, per row
    flat_tokens = tokens.reshape(-1)
    dtype = _compute_dtype(lm_head_weight.dtype)
    logp = torch.zeros(B * T, dtype=dtype, device=hidden.device)
    bonus = options.entropy_coef
    with_entropy = with_entropy or bonus > 0
    entropy = torch.zeros_like(logp) if with_entropy else None
    # d loss / d H for each scored token: -coef / (B x its response's length), in the compute
    # dtype from the start (1/|y_i| is not rounded to float32 first); nothing without a bonus.
    g_entropy = None
    if bonus:
        per_response = mask.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)  # (B, 1)
        g_entropy = (mask.to(dtype) / per_response * (-bonus / B)).reshape(-1)

    def run(h_all: torch.Tensor, weight: torch.Tensor):
        h_flat = h_all.reshape(-1, H)
        grad_h = torch.zeros_like(h_flat)
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        for a, b in _groups(counts, chunk_size):
            g_rows = rows[starts[a] : starts[b]]
            spans = _span(g_rows.numel(), chunk_size)
            kept, lses, ents = [], [], []
            for s, e in spans:
                z = _upcast(h_flat[g_rows[s:e]] @ weight.T)
                if temperature != 1.0:
                    z.div_(temperature)
                lse, lp, ent = _chunk_forward(z, flat_tokens[g_rows[s:e]], with_entropy)
                logp[g_rows[s:e]] = lp
                if entropy is not None and ent is not None:  # both or neither: with_entropy
                    entropy[g_rows[s:e]] = ent
                lses.append(lse)
                ents.append(ent)
                kept.append(z if len(spans) == 1 else None)
            # This group's share of d loss / d logp: its own mean over responses, times b_g / B.
            with torch.enable_grad():
                leaf = logp.view(B, T)[a:b].detach().requires_grad_(True)
                ref = ref_logprobs[a:b] if ref_logprobs is not None else None
                mu = behaviour_logprobs[a:b] if behaviour_logprobs is not None else None
                part, _ = options.loss(
                    leaf,
                    old_logprobs[a:b] if old_logprobs is not None else leaf.detach(),
                    advantages[a:b],
                    mask[a:b],
                    ref_logprobs=ref,
                    behaviour_logprobs=mu,
                )
                (g_logp,) = torch.autograd.grad(part * ((b - a) / B), leaf)
            g_flat = g_logp.reshape(-1)[g_rows - a * T]  # aligned with g_rows
            for (s, e), z_kept, lse, ent in zip(spans, kept, lses, ents, strict=True):
                h = h_flat[g_rows[s:e]]
                if z_kept is not None:
                    z = z_kept
                else:
                    z = _upcast(h @ weight.T)
                    if temperature != 1.0:
                        z.div_(temperature)
                g_ent = g_entropy[g_rows[s:e]] if g_entropy is not None else None
                g = _chunk_grad(
                    z, flat_tokens[g_rows[s:e]], lse, ent, g_flat[s:e], g_ent, 1.0 / temperature
                ).to(weight.dtype)
                grad_h[g_rows[s:e]] = (g @ weight).to(grad_h.dtype)
                _add_head_grad(grad_w, g, h)
        return grad_h.view_as(h_all), grad_w.to(weight.dtype)

    h_in = hidden if hidden.dtype == lm_head_weight.dtype else hidden.to(lm_head_weight.dtype)
    zero = _FUSED[0].apply(h_in, lm_head_weight, run)  # 0-dim; carries the gradient
    logp_bt = logp.view(B, T)
    # Value and stats from the finished log-probs (cheap: (B, T) work, no vocabulary).
    value, stats = options.loss(
        logp_bt,
        old_logprobs if old_logprobs is not None else logp_bt,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        behaviour_logprobs=behaviour_logprobs,
    )
    if g_entropy is not None and entropy is not None:  # the bonus: its value, the same sum
        value = value + (g_entropy * entropy).sum()
        stats = {**stats, "loss": value.detach()}  # the logged loss is the one minimised
    scores = TokenScores(logp_bt, entropy.view(B, T) if entropy is not None else None)
    return zero + value.detach(), stats, scores
