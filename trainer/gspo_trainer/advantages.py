"""Group-normalised advantages, from the rewards of a prompt's group: one value per response
(`group_advantages`, GSPO's Eq. 6), or one per response token from per-token rewards
(`token_group_advantages`, for GSPO-token's Eq. 13-14).

Each is a reward less a baseline (the group's mean; per token, optionally the mean at the
token's position: algorithm.tokenBaseline), divided by a spread that algorithm.scaleRewards
picks (TRL's `scale_rewards`, verl's `norm_adv_by_std_in_grpo`): "group", the group's standard
deviation (the paper's); "batch", the whole batch's (Lite PPO, Liu et al. 2025, arXiv
2508.08221), so groups keep their relative sizes; "none", nothing (the advantage of Dr. GRPO,
Liu et al. 2025, arXiv 2503.20783, which also drops the length normalisation kept here):
dividing by the group's own spread gives a group whose responses score nearly alike
advantages as large as any's, so the policy is pushed hardest where it already agrees with
itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, get_args

from gspo_api.spec import ScaleRewards, TokenBaseline

if TYPE_CHECKING:
    import torch

SCALES: tuple[str, ...] = get_args(ScaleRewards)  # algorithm.scaleRewards
BASELINES: tuple[str, ...] = get_args(TokenBaseline)  # algorithm.tokenBaseline


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale: str = "group"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps), GSPO paper Eq. (6); with `scale`
    "batch" the std is of every reward in the batch, with "none" there is no division.

    rewards (B,) holds B / group_size groups laid out contiguously (responses 0..G-1 answer
    prompt 0, and so on). std is the sample standard deviation (ddof 1), as in TRL and verl.
    A group whose rewards are all equal (zero spread) has no signal: its advantages are exactly
    0, never NaN and never eps-amplified rounding noise. Returns (advantages (B,) float32,
    stats) where stats are 0-dim detached tensors: `zero_advantage_fraction` (share of groups with
    zero spread, the collapse signal), `reward_mean` and `reward_std` over the batch.
    """
    import torch

    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 (a group of one has no advantage), got {group_size}"
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}; "
            f"got shape {tuple(rewards.shape)}"
        )
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:8]
        raise ValueError(f"rewards must be finite; NaN or inf at indices {bad}")
    r = rewards.detach().float().view(-1, group_size)  # (groups, G)
    zero_spread = r.amax(dim=1) == r.amin(dim=1)  # (groups,)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "none":
        adv = centred
    else:
        spread = r.std(dim=1, keepdim=True) if scale == "group" else r.flatten().std()
        adv = centred / (spread + eps)
    adv = torch.where(zero_spread[:, None], torch.zeros_like(adv), adv)
    stats = {
        "zero_advantage_fraction": zero_spread.float().mean(),
        "reward_mean": r.mean(),
        "reward_std": r.flatten().std(),
    }
    return adv.flatten(), stats


def token_group_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    scale: str = "group",
    baseline: str = "group",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A_i,t = (r_i,t - mu_g) / (sigma_g + eps): each token's reward standardised against its
    group's token rewards, the responses weighing as GSPO-token's objective weighs them.

    The GSPO paper leaves A_i,t to the user (§4.3). DeepSeekMath's process supervision (Shao
    et al. 2024, §4.1.3) standardises every step reward against the mean and std of all step
    rewards of the group's outputs; here each token's reward is that token's own credit, so
    its advantage is its own standardised reward (no sum over later steps, which their
    rewards at the end of each reasoning step need). Mean and variance are taken under the
    objective's weights, 1/(G |y_i|) per token (mean over a response's tokens, then over the
    group), so a long response does not outweigh a short one:
        mu_g      = (1/G) sum_i mean_t r_i,t
        sigma_g^2 = 1/(G-1) sum_i mean_t (r_i,t - mu_g)^2
    sigma_g^2 is the spread between responses plus the mean spread within them, so a group
    whose responses score the same on average but differ token by token still has signal,
    and no token's advantage is blown up by a small spread between responses. With every
    token of a response scored alike, r_i,t = r_i, it is exactly `group_advantages` of the
    r_i, and in general the mean over a response's tokens of A_i,t is (r_i - mu_g) /
    (sigma_g + eps), with r_i its mean reward: the sign of its sequence-level advantage.

    With `scale` "batch", sigma is taken the same way over the whole batch (about the batch's
    mean), and with "none" there is no division: each equals `group_advantages` under the same
    `scale` when every token of a response is scored alike.

    With `baseline` "position" (algorithm.tokenBaseline), the baseline of the token at
    position t is the mean reward at position t of the group's responses that reach it,
    b_g,t, in place of mu_g (sigma_g stays as above):
        A_i,t = (r_i,t - b_g,t) / (sigma_g + eps)
    so a position where every response of the group scores alike has no advantage, however
    it scores. Under mu_g, a token right in every response is pushed up in each of them on
    every step (its reward is above the group's mean whenever anything else is wrong), which
    makes the policy deterministic wherever it already agrees with itself, a rule right on
    most prompts included, before it has learned the prompts where the rule is wrong;
    position by position, a step moves only the tokens on which the group's responses differ.
    A response's extra tokens past every other response's end get no advantage: the token
    that should have ended it, beside a response that did end there, carries the loss.

    token_rewards, mask (N, T), the response tokens where mask is True, N = groups x
    group_size laid out contiguously. A group whose token rewards are all equal (under
    "position": equal at each position) has exactly 0 advantage. Returns (advantages (N, T)
    float32, 0 where masked; stats as `group_advantages`'s, of the responses' mean rewards).
    """
    import torch

    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 (a group of one has no advantage), got {group_size}"
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINES)}; got {baseline!r}")
    if token_rewards.dim() != 2 or token_rewards.shape != mask.shape:
        raise ValueError(
            f"token_rewards and mask must be (N, T) alike; got {tuple(token_rewards.shape)} "
            f"and {tuple(mask.shape)}"
        )
    if token_rewards.shape[0] % group_size:
        raise ValueError(
            f"token_rewards has {token_rewards.shape[0]} rows, not a multiple of "
            f"group_size={group_size}"
        )
    mask = mask.bool()
    r = torch.where(mask, token_rewards.detach().float(), 0.0)  # (N, T)
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r).all(-1)).flatten().tolist()[:8]
        raise ValueError(f"token rewards must be finite; NaN or inf in responses {bad}")
    T = r.shape[1]
    counts = mask.sum(-1).clamp(min=1)  # (N,)
    seq = r.sum(-1) / counts  # (N,) each response's mean reward
    mu = seq.view(-1, group_size).mean(1)  # (groups,)
    mu_tok = mu.repeat_interleave(group_size)[:, None]  # (N, 1)
    dev2 = torch.where(mask, (r - mu_tok) ** 2, 0.0).sum(-1) / counts  # (N,)
    sigma = (dev2.view(-1, group_size).sum(1) / (group_size - 1)).sqrt()  # (groups,)
    if scale == "batch":  # the same spread about the batch's mean, over every response
        dev2 = torch.where(mask, (r - seq.mean()) ** 2, 0.0).sum(-1) / counts
        sigma = (dev2.sum() / max(dev2.numel() - 1, 1)).sqrt().expand_as(sigma)
    divisor = sigma + eps if scale != "none" else torch.ones_like(sigma)
    grouped, present = r.view(-1, group_size, T), mask.view(-1, group_size, T)
    inf = torch.full_like(grouped, float("inf"))
    high = torch.where(present, grouped, -inf).amax(1)  # (groups, T): over responses at t
    low = torch.where(present, grouped, inf).amin(1)  # (a position no one reaches: inf)
    if baseline == "position":
        alike = high <= low  # (groups, T): every response reaching t scores alike there
        zero_spread = alike.all(1)  # (groups,)
        base = grouped.sum(1) / present.sum(1).clamp(min=1)  # (groups, T); masked r are 0
        base_tok = base.repeat_interleave(group_size, 0)  # (N, T)
        keep = mask & ~alike.repeat_interleave(group_size, 0)
    else:
        zero_spread = high.amax(1) <= low.amin(1)  # (groups,): every token alike (or none)
        base_tok = mu_tok
        keep = mask & ~zero_spread.repeat_interleave(group_size)[:, None]
    adv = (r - base_tok) / divisor.repeat_interleave(group_size)[:, None]
    adv = torch.where(keep, adv, 0.0)
    stats = {
        "zero_advantage_fraction": zero_spread.float().mean(),
        "reward_mean": seq.mean(),
        "reward_std": seq.std(),
    }
    return adv, stats


def response_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per response (N,): itself, or per-token advantages' mean over each
    response's tokens (what samples show beside a response's reward)."""
    if advantages.dim() == 1:
        return advantages
    mask = mask.bool()
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
