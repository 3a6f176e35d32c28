"""Group advantages: hand-computed values, zero-spread groups, input errors."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_trainer.advantages import group_advantages


def test_hand_computed_group() -> None:
    # Group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) -> A = +-0.5 * sqrt(3).
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0)
    a = 0.5 * math.sqrt(3)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a]))


def test_groups_are_independent_and_contiguous() -> None:
    rewards = torch.tensor([0.0, 2.0, 10.0, 30.0])
    adv, _ = group_advantages(rewards, group_size=2, eps=0.0)
    # Each pair is normalised on its own: [-1/sqrt2, 1/sqrt2] twice (scale-free).
    r = 1 / math.sqrt(2)
    assert torch.allclose(adv, torch.tensor([-r, r, -r, r]))


def test_zero_spread_group_gives_exact_zero_and_share() -> None:
    # 0.7 three times: the float mean is not exactly 0.7, so without the guard the eps-divided
    # rounding error would leak out; the guard makes it exactly 0.
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 5.0, 5.0, 5.0])
    adv, stats = group_advantages(rewards, group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.equal(adv[6:], torch.zeros(3))
    assert not torch.isnan(adv).any()
    assert adv[3:6].abs().min() > 0.5
    assert float(stats["zero_advantage_fraction"]) == pytest.approx(2 / 3)
    assert float(stats["reward_mean"]) == pytest.approx(float(rewards.mean()))


def test_advantages_sum_to_zero_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, generator=g)
    adv, stats = group_advantages(rewards, group_size=8)
    assert torch.allclose(adv.view(8, 8).sum(1), torch.zeros(8), atol=1e-5)
    assert float(stats["zero_advantage_fraction"]) == 0.0


def test_scale_none_centres_only_and_batch_divides_by_the_batchs_std() -> None:
    """algorithm.scaleRewards: "none" (Dr. GRPO) leaves a group of nearly alike rewards
    nearly no advantage; "batch" divides every group by one spread, so the groups keep their
    relative sizes; "group" (the paper's) makes both groups alike."""
    rewards = torch.tensor([0.9, 1.0, 0.0, 1.0])  # a close group, then a split one
    none, _ = group_advantages(rewards, group_size=2, scale="none")
    torch.testing.assert_close(none, torch.tensor([-0.05, 0.05, -0.5, 0.5]))
    batch, _ = group_advantages(rewards, group_size=2, eps=0.0, scale="batch")
    torch.testing.assert_close(batch, none / rewards.std())
    group, _ = group_advantages(rewards, group_size=2, eps=0.0)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(group, torch.tensor([-r, r, -r, r]))
    for scale in ("none", "batch"):  # a zero-spread group is still exactly 0 (0.9 thrice
        # does not average to exactly 0.9 in float32)
        rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 1.0])
        adv, _ = group_advantages(rewards, 3, scale=scale)
        assert torch.equal(adv[:3], torch.zeros(3)) and adv[3:].abs().min() > 0


def test_an_unknown_scale_is_named() -> None:
    with pytest.raises(ValueError, match="scale must be one of group, batch, none; got 'std'"):
        group_advantages(torch.zeros(4), 2, scale="std")


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(4), 1, "group_size must be >= 2"),
        (torch.zeros(5), 2, "divisible by group_size"),
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.tensor([0.0, float("nan")]), 2, "indices \\[1\\]"),
    ],
)
def test_bad_input_is_named(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
