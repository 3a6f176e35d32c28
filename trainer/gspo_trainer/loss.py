"""The policy losses: GSPO, GSPO-token and GRPO, one registered function per level.

Reference: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (the
GSPO paper; equation numbers below are its). Each level function returns the loss of each
response (B,) and its clip statistics; `policy_loss` adds the optional KL term and averages
over responses, so all levels share one normalisation: mean over the tokens of a response,
then mean over responses (TRL's `loss_type="grpo"`).

Stats are 0-dim detached tensors (no device sync inside the loss; call `float()` to log):
`clip_frac_low` / `clip_frac_high` share of units where the clip binds and removes the
gradient (ratio < 1 - clip_low with A < 0, ratio > 1 + clip_high with A > 0), counted over
responses at the sequence levels and over unmasked tokens at the token level;
`abs_log_seq_ratio` mean over responses of |log s_i| (every level, so runs compare);
`ratio_min` / `ratio_mean` / `ratio_max` of the ratio this level clips; `kl` (k3) when
ref_logprobs are given; `loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Stats = dict[str, "torch.Tensor"]
LevelLoss = Callable[..., tuple["torch.Tensor", Stats]]

# The spec's `algorithm.lossLevel` names -> the level names of this module.
LEVEL_OF = {"gspo": "sequence", "gspo-token": "sequence_token", "grpo": "token"}
POLICY_LOSSES: dict[str, LevelLoss] = {}


def register_policy_loss(level: str) -> Callable[[LevelLoss], LevelLoss]:
    def add(fn: LevelLoss) -> LevelLoss:
        POLICY_LOSSES[level] = fn
        return fn

    return add


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the unmasked tokens of each row (B, T) -> (B,); an empty row gives 0."""
    import torch

    total = torch.where(mask, x, torch.zeros_like(x)).sum(-1)
    return total / mask.sum(-1).clamp(min=1)


def _log_seq_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor):
    """log s_i = (1/|y_i|) sum_t (log pi - log pi_old), Eq. (7). (B,)"""
    return _masked_mean(logp - old_logp, mask)


def _clip_stats(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    valid: torch.Tensor,
) -> Stats:
    """Where the clip binds, and the ratio's range, over the `valid` units (detached)."""
    import torch

    ratio, advantages = ratio.detach(), advantages.detach()
    low = (ratio < 1 - clip_low) & (advantages < 0) & valid
    high = (ratio > 1 + clip_high) & (advantages > 0) & valid
    count = valid.sum().clamp(min=1)
    inf = torch.full_like(ratio, float("inf"))
    some = valid.any()
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    return {
        "clip_frac_low": low.sum() / count,
        "clip_frac_high": high.sum() / count,
        "ratio_min": torch.where(some, torch.where(valid, ratio, inf).min(), one),
        "ratio_mean": torch.where(some, torch.where(valid, ratio, 0).sum() / count, one),
        "ratio_max": torch.where(some, torch.where(valid, ratio, -inf).max(), one),
    }


def _clipped_surrogate(ratio, advantages, clip_low: float, clip_high: float):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A): the pessimistic PPO term, negated."""
    import torch

    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


@register_policy_loss("sequence")
def gspo_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float):
    """GSPO, Eq. (5): loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i).

    s_i = exp(mean_t log pi/pi_old), Eq. (7): one ratio per response, clipped as a whole; the
    gradient is s_i A_i times the mean over tokens of grad log pi, Eq. (11).
    logp, old_logp (B, T), advantages (B,), mask (B, T) bool -> ((B,), stats).
    """
    seq_ratio = _log_seq_ratio(logp, old_logp, mask).exp()  # (B,)
    loss = _clipped_surrogate(seq_ratio, advantages, clip_low, clip_high)
    valid = mask.any(-1)
    return loss, _clip_stats(seq_ratio, advantages, clip_low, clip_high, valid)


@register_policy_loss("sequence_token")
def gspo_token_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float):
    """GSPO-token (paper §4.3): s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)].

    Every token carries the value s_i but its own gradient path; the per-token clipped terms
    are averaged over the response's tokens. With one advantage per response (as here) the
    gradient equals GSPO's (the paper's Eq. (18) against Eq. (11)).
    """
    import torch

    log_s = _log_seq_ratio(logp, old_logp, mask).detach()  # (B,)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    tok_ratio = (log_s[:, None] + logp - logp.detach()).exp()  # (B, T), value s_i
    per_token = _clipped_surrogate(tok_ratio, advantages[:, None], clip_low, clip_high)
    stats = _clip_stats(log_s.exp(), advantages, clip_low, clip_high, mask.any(-1))
    return _masked_mean(per_token, mask), stats


@register_policy_loss("token")
def grpo_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float):
    """GRPO, the paper's Eq. (2) baseline: a clipped ratio per token, w_i,t = pi / pi_old.

    loss_i = mean over tokens t of -min(w_i,t A_i, clip(w_i,t, 1 - eps_low, 1 + eps_high) A_i).
    """
    import torch

    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    tok_ratio = log_ratio.exp()  # (B, T)
    adv = advantages[:, None].expand_as(tok_ratio)
    per_token = _clipped_surrogate(tok_ratio, adv, clip_low, clip_high)
    return _masked_mean(per_token, mask), _clip_stats(tok_ratio, adv, clip_low, clip_high, mask)


def _check(logp, old_logp, advantages, mask, level, clip_low, clip_high, ref_logprobs, kl_coef):
    if level not in POLICY_LOSSES:
        raise ValueError(
            f"unknown loss level {level!r}; valid levels: {sorted(POLICY_LOSSES)} "
            f"(spec names map through LEVEL_OF: {LEVEL_OF})"
        )
    if logp.dim() != 2:
        raise ValueError(f"logprobs must be (B, T); got shape {tuple(logp.shape)}")
    for name, t in (("old_logprobs", old_logp), ("mask", mask), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be (B,)={tuple(logp.shape[:1])}; got {tuple(advantages.shape)}"
        )
    if not 0 < clip_low < 1:
        raise ValueError(f"clip_low must lie in (0, 1), got {clip_low}")
    if not clip_high > 0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (reference policy log-probs)")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, Stats]:
    """Loss to minimise: mean over responses of the level's per-response loss (+ KL).

    logprobs (B, T) with grad, old_logprobs (B, T) (pi_old, no grad), advantages (B,),
    mask (B, T) (1 on response tokens). Values at masked positions are ignored, even NaN.
    level: "sequence" (GSPO), "sequence_token" (GSPO-token) or "token" (GRPO); see LEVEL_OF.
    KL: the k3 estimator per token, exp(ref - logp) - (ref - logp) - 1, mean over each
    response's tokens, times kl_coef, added to that response's loss.
    """
    import torch

    _check(
        logprobs, old_logprobs, advantages, mask, level, clip_low, clip_high, ref_logprobs, kl_coef
    )
    mask = mask.bool()
    old = old_logprobs.detach()
    per_response, stats = POLICY_LOSSES[level](
        logprobs, old, advantages.detach(), mask, float(clip_low), float(clip_high)
    )
    stats["abs_log_seq_ratio"] = _log_seq_ratio(logprobs.detach(), old, mask).abs().mean()
    if ref_logprobs is not None:
        delta = torch.where(mask, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
        kl_seq = _masked_mean(delta.exp() - delta - 1, mask)  # (B,)
        stats["kl"] = kl_seq.detach().mean()
        if kl_coef:
            per_response = per_response + kl_coef * kl_seq
    loss = per_response.mean()
    stats["loss"] = loss.detach()
    return loss, stats
