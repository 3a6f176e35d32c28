"""Group-normalised advantages: one value per response, from the rewards of its prompt's group."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps), GSPO paper Eq. (6).

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
    adv = centred / (r.std(dim=1, keepdim=True) + eps)
    adv = torch.where(zero_spread[:, None], torch.zeros_like(adv), adv)
    stats = {
        "zero_advantage_fraction": zero_spread.float().mean(),
        "reward_mean": r.mean(),
        "reward_std": r.flatten().std(),
    }
    return adv.flatten(), stats
