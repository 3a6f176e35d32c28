"""Per-token rewards and GSPO-token's per-token advantages (the paper's Eq. 13-14): the loss
against a reference written from the equations, the advantages' definition, their alignment
through packing, the reward interface, and a learner step."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gspo_trainer.advantages import group_advantages, token_group_advantages
from gspo_trainer.fused_loss import policy_loss_from_hidden
from gspo_trainer.logprobs import token_logprobs_from_hidden
from gspo_trainer.loss import LossOptions, policy_loss
from gspo_trainer.rewards import (
    Component,
    RewardScorer,
    Scored,
    WeightedScorer,
    build_scorer,
    format_reward,
    token_rewards,
)
from gspo_trainer.step.batch import pack

# --- the loss: Eq. (13)-(14) ------------------------------------------------------------


def eq13_reference(logp, old, adv, mask, eps_low: float, eps_high: float):
    """GSPO-token's loss and its gradient w.r.t. logp, token by token from the paper.

    Value, Eq. (13)-(14): -(1/G) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t) A_i,t)
    with s_i,t numerically s_i = exp(mean_t log pi/pi_old). Gradient, Eq. (17): the token's
    term is s_i,t A_i,t where the min takes the unclipped term, whose derivative w.r.t. its own
    log pi is s_i (sg[s_i] pi / sg[pi]) and w.r.t. any other token's 0; a clipped term is a
    constant.
    """
    B, T = logp.shape
    loss, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        n = len(toks)
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in toks) / n)
        for t in toks:
            a = float(adv[i, t])
            unclipped = s * a
            clipped = min(max(s, 1 - eps_low), 1 + eps_high) * a
            loss -= min(unclipped, clipped) / (n * B)
            if unclipped <= clipped:
                grad[i, t] = -s * a / (n * B)
    return loss, grad


def token_batch(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = logp + 0.2 * torch.randn(B, 1, generator=g, dtype=torch.float64)  # s_i leave the band
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)  # signs mixed within responses
    return logp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_with_per_token_advantages_is_eq_13_14(seed: int) -> None:
    logp, old, adv, mask = token_batch(seed)
    loss, stats = policy_loss(
        logp, old, adv, mask, level="sequence_token", clip_low=0.2, clip_high=0.27
    )
    (grad,) = torch.autograd.grad(loss, logp)
    want, want_grad = eq13_reference(logp.detach(), old, adv, mask, 0.2, 0.27)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grad, want_grad)
    # Per-token advantages clip token by token: some tokens of a response keep their gradient
    # while others lose it, which one advantage per response never does.
    clipped = (want_grad == 0) & mask
    assert any(clipped[i].any() and (~clipped[i] & mask[i]).any() for i in range(len(mask)))
    counted = float(stats["clip_fraction_low"] + stats["clip_fraction_high"])
    assert counted == pytest.approx(float(clipped.sum()) / float(mask.sum()))


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.27)])
def test_per_token_advantages_equal_per_response_are_gspo(clip) -> None:
    logp, old, adv_t, mask = token_batch(7)
    adv = adv_t[:, 0]
    results = []
    for level, a in (("sequence", adv), ("sequence_token", adv[:, None].expand_as(logp))):
        loss, _ = policy_loss(logp, old, a, mask, level=level, clip_low=clip[0], clip_high=clip[1])
        results.append((loss, *torch.autograd.grad(loss, logp)))
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)


def test_the_sequence_level_refuses_per_token_advantages() -> None:
    logp, old, adv, mask = token_batch(0)
    with pytest.raises(ValueError, match=r"one advantage per response.*gspo-token"):
        policy_loss(logp, old, adv, mask, level="sequence", clip_low=0.2, clip_high=0.27)
    with pytest.raises(ValueError, match=r"advantages must be \(B,\)=\(6,\), or \(B, T\)"):
        policy_loss(
            logp, old, adv[:, :3], mask, level="sequence_token", clip_low=0.2, clip_high=0.27
        )


@pytest.mark.parametrize("level", ["sequence_token", "token"])
@pytest.mark.parametrize("chunk_size", [4, 100])  # 4 splits the longer responses
@pytest.mark.parametrize("stale", [False, True])
def test_the_fused_loss_takes_per_token_advantages(
    level: str, chunk_size: int, stale: bool
) -> None:
    """The update's loss (from hidden states) equals policy_loss on the same per-token
    advantages: each response's slice of them reaches its own tokens, and with rollouts an
    older version sampled (`stale`), each token's own importance weight."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 5, 9, 8, 23
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([9, 2, 5, 1, 7])[:, None]
    with torch.no_grad():
        logp = token_logprobs_from_hidden(hidden, weight, tokens, 4, 1.0, mask=mask).logp
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mu = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) if stale else None
    kw = dict(level=level, clip_low=0.2, clip_high=0.27, is_cap=2.0 if stale else None)
    scores = token_logprobs_from_hidden(hidden, weight, tokens, 4, 1.0, mask=mask)
    want, _ = policy_loss(scores.logp, old, adv, mask, behaviour_logprobs=mu, **kw)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got, _, _ = policy_loss_from_hidden(
        hidden,
        weight,
        tokens,
        mask,
        old,
        adv,
        LossOptions(**kw),
        chunk_size=chunk_size,
        behaviour_logprobs=mu,
    )
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), want_grads, strict=True):
        torch.testing.assert_close(a, b)


# --- the advantages ------------------------------------------------------------------------


def padded(rows: list[list[float]], T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.full((len(rows), T), float("nan"))  # what lies past a response is never read
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, row in enumerate(rows):
        r[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return r, mask


def test_token_advantages_hand_computed() -> None:
    r, mask = padded([[1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, stats = token_group_advantages(r, mask, group_size=2)
    # Response means 0.5 and 1, mu = 0.75. Squared deviations from mu, meaned per response:
    # (0.25^2 + 0.75^2) / 2 = 0.3125 and 0.25^2 = 0.0625; sigma^2 = their sum / (G - 1).
    sigma = math.sqrt(0.3125 + 0.0625)
    want = torch.tensor([[0.25, -0.75, 0, 0, 0], [0.25, 0.25, 0.25, 0, 0]]) / (sigma + 1e-6)
    torch.testing.assert_close(adv, want)
    assert float(stats["reward_mean"]) == 0.75
    assert float(stats["zero_advantage_fraction"]) == 0.0


def test_responses_alike_on_average_still_have_token_signal() -> None:
    r, mask = padded([[1.0, 0.0], [0.0, 1.0]])  # both score 0.5: no sequence-level signal
    assert group_advantages(torch.tensor([0.5, 0.5]), 2)[0].abs().sum() == 0
    adv, _ = token_group_advantages(r, mask, group_size=2)
    s = math.sqrt(0.25 + 0.25) + 1e-6  # within-response spread only, nothing blown up
    torch.testing.assert_close(adv[:, :2], torch.tensor([[0.5, -0.5], [-0.5, 0.5]]) / s)


def test_token_advantages_unscaled_are_the_rewards_less_the_groups_mean() -> None:
    """scaleRewards none: the hand-computed case above without its division by sigma."""
    r, mask = padded([[1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, _ = token_group_advantages(r, mask, group_size=2, scale="none")
    want = torch.tensor([[0.25, -0.75, 0, 0, 0], [0.25, 0.25, 0.25, 0, 0]])
    torch.testing.assert_close(adv, want)


def test_a_position_baseline_compares_each_token_with_its_position() -> None:
    """tokenBaseline position: a token is compared with the mean at its position of the
    group's responses that reach it; sigma is the group's, as under the group baseline."""
    r, mask = padded([[1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, stats = token_group_advantages(r, mask, group_size=2, baseline="position")
    sigma = math.sqrt(0.3125 + 0.0625)  # test_token_advantages_hand_computed's
    # Position 0: both right, no advantage; 1: 0 against 1, mean 0.5; 2: the longer alone.
    want = torch.tensor([[0.0, -0.5, 0, 0, 0], [0.0, 0.5, 0.0, 0, 0]]) / (sigma + 1e-6)
    torch.testing.assert_close(adv, want)
    assert float(stats["zero_advantage_fraction"]) == 0.0


def test_under_a_position_baseline_agreeing_responses_have_no_advantage() -> None:
    """Responses alike at every position have exactly 0, however each token scores (0.7
    seven times does not average to exactly 0.7 in float32: unguarded, the rounding would be
    divided by the group's spread), and count as a group without signal; so does a token
    past every other response's end."""
    G = 7
    same = [[0.7, 0.1, 1.0]] * G  # identical responses, tokens scored unalike
    longer = [[1.0, 0.0]] * (G - 1) + [[1.0, 0.0, 0.0]]  # one runs a token past the others
    r, mask = padded([*same, *longer])
    adv, stats = token_group_advantages(r, mask, group_size=G, baseline="position")
    assert torch.equal(adv, torch.zeros_like(adv))
    assert float(stats["zero_advantage_fraction"]) == 1.0
    group, _ = token_group_advantages(r, mask, group_size=G)
    assert group[:G][mask[:G]].abs().min() > 0  # the group baseline pushes each of them


def test_an_unknown_baseline_is_named() -> None:
    r, mask = padded([[1.0], [0.0]])
    with pytest.raises(ValueError, match="baseline must be one of group, position; got 'mean'"):
        token_group_advantages(r, mask, group_size=2, baseline="mean")


def test_zero_spread_group_has_zero_advantage() -> None:
    r, mask = padded([[1.0, 1.0], [1.0], [0.0, 1.0], [1.0, 0.0, 1.0]])
    adv, stats = token_group_advantages(r, mask, group_size=2)
    assert adv[:2].abs().sum() == 0 and adv[2:][mask[2:]].abs().min() > 0
    assert float(stats["zero_advantage_fraction"]) == 0.5


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(3))
def test_one_score_on_every_token_gives_the_sequence_advantages(seed: int, scale: str) -> None:
    """A response whose tokens all score r_i gets GSPO's Eq. (6) advantage on every token,
    under each algorithm.scaleRewards."""
    g = torch.Generator().manual_seed(seed)
    G, groups, T = 4, 3, 7
    rewards = torch.randint(0, 3, (G * groups,), generator=g).float()
    lengths = torch.randint(1, T + 1, (G * groups,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    token_rewards = rewards[:, None].expand(-1, T).clone()
    adv, stats = token_group_advantages(token_rewards, mask, G, scale=scale)
    want, want_stats = group_advantages(rewards, G, scale=scale)
    torch.testing.assert_close(adv, torch.where(mask, want[:, None], 0.0))
    for key in want_stats:
        torch.testing.assert_close(stats[key], want_stats[key])


# --- packing keeps each token's reward at its token -----------------------------------------


def test_packing_lays_each_token_reward_at_its_token() -> None:
    prompts = [[5, 6, 7], [8]]  # different lengths: the responses start at different columns
    responses = [[11, 12, 13, 14], [21, 22]]
    rewards_t = [[0.1, 0.2, 0.3, 0.4], [1.0, 2.0]]
    logps = [[-1.0] * 4, [-1.0] * 2]
    packed = pack(prompts, responses, logps, [0.25, 1.5], 1, 0, rewards_t)
    assert packed.token_rewards is not None
    for i in range(2):
        assert packed.targets[i][packed.mask[i]].tolist() == responses[i]
        torch.testing.assert_close(
            packed.token_rewards[i][packed.mask[i]], torch.tensor(rewards_t[i])
        )
        assert packed.token_rewards[i][~packed.mask[i]].abs().sum() == 0
    # The advantages come out in the same layout, each token's from its own reward.
    adv, _ = token_group_advantages(packed.token_rewards, packed.mask, group_size=2)
    mu = (0.25 + 1.5) / 2
    dev = [sum((x - mu) ** 2 for x in row) / len(row) for row in rewards_t]
    sigma = math.sqrt(sum(dev)) + 1e-6
    for i in range(2):
        want = torch.tensor([(x - mu) / sigma for x in rewards_t[i]])
        torch.testing.assert_close(adv[i][packed.mask[i]], want)
    assert packed.to(torch.device("cpu")).token_rewards is packed.token_rewards
    assert pack(prompts, responses, logps, [0.0, 0.0], 1, 0).token_rewards is None
    with pytest.raises(ValueError, match="response 1 has 2 tokens but 3 token rewards"):
        pack(prompts, responses, logps, [0.0, 0.0], 1, 0, [rewards_t[0], [1.0, 2.0, 3.0]])


# --- the reward interface ---------------------------------------------------------------------


def per_token(prompt: str, completion: str, answer: str, token_ids: list[int]) -> list[float]:
    """A reward per response token (test only): 1 for an even token id, else 0."""
    return [float(t % 2 == 0) for t in token_ids]


def short_by_one(prompt: str, completion: str, answer: str, token_ids: list[int]) -> list[float]:
    return [1.0] * (len(token_ids) - 1)


def item(ids: list[int]) -> Scored:
    return Scored("p", "text", "a", True, len(ids), ids)


def test_a_reward_may_score_each_token() -> None:
    from gspo_api.spec import RewardConfig

    scorer = build_scorer(RewardConfig(kind="python", function="test_token_advantages:per_token"))
    items = [item([2, 3, 4, 5]), item([1])]
    assert scorer.score_components(items)[0] == [(1.0, 0.0, 1.0, 0.0), (0.0,)]
    assert scorer.score(items) == [0.5, 0.0]  # the response's reward: its tokens' mean
    array = RewardScorer(lambda p, c, a: np.array([0.5, 1.0]), inline=True)
    assert array.scores([item([1, 2])]) == [(0.5, 1.0)]


def test_a_per_token_reward_of_the_wrong_length_fails_naming_it(caplog) -> None:
    from gspo_api.spec import RewardConfig

    function = "test_token_advantages:short_by_one"
    counted = []
    scorer = build_scorer(RewardConfig(kind="python", function=function), counted.append)
    with caplog.at_level(logging.WARNING, logger="gspo.rewards"):
        assert scorer.score([item([1, 2, 3])]) == [0.0]
    assert counted == ["error"]
    (record,) = [r for r in caplog.records if r.name == "gspo.rewards"]
    assert f"reward {function} returned 2 per-token scores for a response of 3 tokens" in (
        record.getMessage()
    )
    nan = RewardScorer(lambda p, c, a: [1.0, float("nan")], inline=True)
    assert nan.scores([item([1, 2])]) == [0.0] and nan.failures["error"] == 1


def test_weighted_components_mix_per_token_and_numbers() -> None:
    tokens = RewardScorer(lambda p, c, a: [1.0, 0.0, 1.0], inline=True)
    fmt = RewardScorer(lambda i: format_reward(i), inline=True, takes_item=True)
    scorer = WeightedScorer([Component("tokens", 1.0, tokens), Component("format", 0.5, fmt)])
    scores, means = scorer.score_components([item([1, 2, 3])])
    assert scores == [(1.5, 0.5, 1.5)]  # the format's 1 x 0.5 on every token
    assert means == {"reward/tokens": pytest.approx(2 / 3), "reward/format": 1.0}
    assert scorer.score([item([1, 2, 3])]) == [pytest.approx(2 / 3 + 0.5)]
    assert token_rewards([(1.0, 0.0), 3.0], [2, 3]) == [[1.0, 0.0], [3.0, 3.0, 3.0]]
    assert token_rewards([1.0, 3.0], [2, 3]) is None


# --- a learner step -------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "baseline"), [("group", "group"), ("none", "position")])
def test_a_learner_step_trains_gspo_token_on_per_token_advantages(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    scale: str,
    baseline: str,
) -> None:
    from learner_helpers import make_learner, params, tiny_spec

    import gspo_trainer.learner as learner_module
    import gspo_trainer.step.update as update_module

    seen = []
    real_update = learner_module.update

    def recording(policy, packed, plan, old, advantages, *args, **kw):  # type: ignore[no-untyped-def]
        seen.append((packed, advantages.clone()))
        return real_update(policy, packed, plan, old, advantages, *args, **kw)

    monkeypatch.setattr(learner_module, "update", recording)
    fused_calls = []
    real_fused = update_module._fused

    def fused(hidden, weight, targets, mask, old_logp, advantages, *args):  # type: ignore[no-untyped-def]
        fused_calls.append((mask.clone(), advantages.detach().clone()))
        return real_fused(hidden, weight, targets, mask, old_logp, advantages, *args)

    monkeypatch.setattr(update_module, "_fused", fused)
    manifest = tiny_spec(
        lossLevel="gspo-token",
        miniBatches=1,
        promptsPerStep=4,
        groupSize=4,
        scaleRewards=scale,
        tokenBaseline=baseline,
    )
    manifest["spec"]["reward"] = {"kind": "python", "function": "test_token_advantages:per_token"}
    manifest["spec"]["metrics"]["samplesEverySteps"] = 1
    manifest["spec"]["learner"]["microBatchTokens"] = 8  # one response per micro-batch
    learner = make_learner(tmp_path, None, manifest)
    before = params(learner)
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    packed, adv = seen[-1]
    assert adv.shape == packed.mask.shape  # one advantage per response token
    assert packed.token_rewards is not None
    want, _ = token_group_advantages(
        packed.token_rewards, packed.mask, 4, scale=scale, baseline=baseline
    )
    torch.testing.assert_close(adv, want)  # scaleRewards and tokenBaseline reach them
    for other in ({"scale": "group"}, {"baseline": "group"}) if scale != "group" else ():
        found, _ = token_group_advantages(
            packed.token_rewards, packed.mask, 4, **{"scale": scale, "baseline": baseline, **other}
        )
        assert not torch.allclose(adv, found), other
    # each token's reward is its own token's parity, laid at that token
    torch.testing.assert_close(
        packed.token_rewards[packed.mask], (packed.targets[packed.mask] % 2 == 0).float()
    )
    assert stats["reward_mean"] == pytest.approx(float(packed.rewards.mean()))
    for sample in stats["samples"]:  # a response's reward and advantage: its tokens' mean
        i, row = sample["index"], packed.mask[sample["index"]]
        assert sample["reward"] == pytest.approx(float(packed.token_rewards[i][row].mean()))
        assert sample["advantage"] == pytest.approx(float(adv[i][row].mean()), abs=1e-6)
    # The loss of each micro-batch (one response each, cut to its own width) got the
    # advantages of its own tokens: in order, they are the step's, token for token.
    got = torch.cat([a[m] for m, a in fused_calls])
    torch.testing.assert_close(got, adv[packed.mask])
    assert len(fused_calls) == len(packed.seq_lengths)
    assert math.isfinite(stats["loss"])
    after = params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # Under gspo the same reward counts by its mean per response, said once in the log.
    algorithm = learner.spec.algorithm.model_copy(update={"loss_level": "gspo"})
    learner.spec = learner.spec.model_copy(update={"algorithm": algorithm})
    with caplog.at_level(logging.WARNING, logger="gspo.learner"):
        asyncio.run(learner.sync(1))
        asyncio.run(learner.train_step(2))
        asyncio.run(learner.sync(2))
        asyncio.run(learner.train_step(3))
    assert seen[-1][1].shape == seen[-1][0].rewards.shape
    notes = [r for r in caplog.records if "spec.algorithm.lossLevel to gspo-token" in r.message]
    assert len(notes) == 1


def test_a_position_baseline_over_one_reward_per_response_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """tokenBaseline position with a reward that scored each response with one number (a
    math reward, say): the group's mean is the baseline, and rank 0 says so once."""
    from types import SimpleNamespace

    from learner_helpers import tiny_spec

    from gspo_api.validation import parse_spec
    from gspo_trainer.learner import Learner

    manifest = tiny_spec(lossLevel="gspo-token", tokenBaseline="position", groupSize=2)
    learner = SimpleNamespace(
        spec=parse_spec(manifest["spec"]), rank=0, warned_token_baseline=False
    )
    packed = SimpleNamespace(token_rewards=None, rewards=torch.tensor([0.0, 1.0, 1.0, 1.0]))
    with caplog.at_level(logging.WARNING, logger="gspo.learner"):
        for _ in range(2):
            adv, _ = Learner._advantages(learner, packed)  # type: ignore[arg-type]
    torch.testing.assert_close(adv, group_advantages(packed.rewards, 2)[0])
    notes = [r for r in caplog.records if "tokenBaseline position compares" in r.message]
    assert len(notes) == 1 and "set tokenBaseline to group" in notes[0].message
