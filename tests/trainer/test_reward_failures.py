"""A reward that hangs, fails or returns nonsense costs a bounded time and thread count per
step, is reported once per step where the user looks, and stops the run when it fails every
call for reward.maxFailedSteps steps."""

from __future__ import annotations

import io
import logging
import threading
import time
from pathlib import Path

import pytest

from gspo_trainer.rewards import (
    Component,
    RewardFailed,
    RewardScorer,
    Scored,
    WeightedScorer,
)
from gspo_trainer.step.rollout import Collector
from gspo_trainer.train import ProgressView, summary

ITEMS = [Scored("1+1=", "2", "2", True, 1)] * 32


def test_a_hung_reward_costs_one_timeout_per_batch_and_a_bounded_pool() -> None:
    release = threading.Event()

    def hangs(prompt: str, completion: str, answer: str) -> float:
        release.wait()
        return 1.0

    scorer = RewardScorer(hangs, timeout_s=0.1, parallel=4)
    before = threading.active_count()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            assert scorer.score(ITEMS) == [0.0] * len(ITEMS)
            # Before: one timeout per 4 items (0.8 s a batch), 4 more hung threads each time.
            assert time.monotonic() - t0 < 0.5
        assert scorer.failures["timeout"] == 3 * len(ITEMS)
        assert threading.active_count() - before <= 4
    finally:
        release.set()


def test_a_hung_batch_reward_holds_no_more_threads_than_its_pool() -> None:
    """A function called once per batch (TRL's) runs on the same bounded pool."""
    release = threading.Event()

    def hangs(items: object) -> list[float]:
        release.wait()
        return [1.0]

    scorer = RewardScorer(hangs, timeout_s=0.05, parallel=2, batch=True)
    before = threading.active_count()
    try:
        for _ in range(4):
            assert scorer.score(ITEMS[:3]) == [0.0] * 3
        assert scorer.failures["timeout"] == 4 * 3
        assert threading.active_count() - before <= 2  # before: one more thread a batch
    finally:
        release.set()


def test_a_slow_reward_still_scores_every_item() -> None:
    """Calls queued behind others get their own timeout from when they start."""

    def slow(prompt: str, completion: str, answer: str) -> float:
        time.sleep(0.01)
        return 1.0

    scorer = RewardScorer(slow, timeout_s=0.08, parallel=4)
    assert scorer.score(ITEMS) == [1.0] * len(ITEMS)  # 8 rounds of 0.01 s > one timeout


def test_failures_are_one_warning_per_batch(caplog: pytest.LogCaptureFixture) -> None:
    def broken(prompt: str, completion: str, answer: str) -> float:
        raise KeyError("answer")

    scorer = RewardScorer(broken, parallel=4)
    with caplog.at_level(logging.WARNING, logger="gspo.rewards"):
        scorer.score(ITEMS)
    (record,) = [r for r in caplog.records if r.name == "gspo.rewards"]
    assert "32 of 32 calls failed (32 error)" in record.getMessage()
    assert scorer.last.failed_total == 32 and scorer.last.calls == 32


@pytest.mark.parametrize("value", [1e308, -1e308, 1e39, float("nan"), float("inf")])
def test_a_reward_float32_cannot_hold_is_a_failure(value: float) -> None:
    scorer = RewardScorer(lambda p, c, a: value, inline=True)
    assert scorer.score(ITEMS[:2]) == [0.0, 0.0]
    assert scorer.failures["error"] == 2


def test_a_weighted_sum_past_float32_scores_0() -> None:
    big = RewardScorer(lambda p, c, a: 3e38, inline=True)
    weighted = WeightedScorer([Component("a", 1.0, big), Component("b", 1.0, big)])
    assert weighted.score(ITEMS[:1]) == [0.0]


def test_every_call_failing_for_max_failed_steps_stops_the_run() -> None:
    outcome = {"fail": True}

    def flaky(prompt: str, completion: str, answer: str) -> float:
        if outcome["fail"]:
            raise RuntimeError("reward service down")
        return 1.0

    scorer = RewardScorer(flaky, inline=True)
    collector = Collector(None, None, None, None, scorer, max_failed_steps=2)  # type: ignore[arg-type]
    scorer.score(ITEMS[:4])
    assert collector.reward_failures(1) == 1.0
    outcome["fail"] = False
    scorer.score(ITEMS[:4])
    assert collector.reward_failures(2) == 0.0  # a good step resets the count
    outcome["fail"] = True
    scorer.score(ITEMS[:4])
    collector.reward_failures(3)
    scorer.score(ITEMS[:4])
    with pytest.raises(RewardFailed, match="every reward call failed in 2 steps in a row"):
        collector.reward_failures(4)
    never = Collector(None, None, None, None, scorer, max_failed_steps=0)  # type: ignore[arg-type]
    for step in range(5):
        assert never.reward_failures(step) == 1.0


def test_gspo_train_shows_failing_rewards_on_the_console() -> None:
    out = io.StringIO()
    view = ProgressView(None, max_steps=4, bar=False, out=out)  # type: ignore[arg-type]
    for step, failed in [(1, 0.0), (2, 1.0), (3, 1.0), (4, 0.0)]:
        view.show({"step": step, "reward_mean": 0.0, "reward_failure_fraction": failed})
    warnings = [line for line in out.getvalue().splitlines() if "WARNING" in line]
    assert warnings == [
        "WARNING: step 2: 100% of the reward calls failed and scored 0 (the learner's log says why)"
    ]
    text = summary(Path("/nonexistent"), view.records, 1.0, 0)
    assert "reward calls failed in 2 of 4 steps (every call in 2)" in text


def test_a_thread_held_by_an_earlier_batch_does_not_make_the_next_one_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call hung in an earlier batch is past its timeout for good: the next batch waits for
    its own calls, not in a 1 ms polling loop until they end."""
    import gspo_trainer.rewards as rewards

    release = threading.Event()

    def reward(prompt: str, completion: str, answer: str) -> float:
        if completion == "hang":
            release.wait()
        else:
            time.sleep(0.15)  # a slow reward, well inside its timeout
        return 1.0

    scorer = RewardScorer(reward, timeout_s=0.2, parallel=2)
    try:
        assert scorer.score([Scored("p", "hang", "2", True)]) == [0.0]
        clock_reads = 0
        real_now = rewards._now

        def counted() -> float:
            nonlocal clock_reads
            clock_reads += 1
            return real_now()

        monkeypatch.setattr(rewards, "_now", counted)
        assert scorer.score([Scored("p", "slow", "2", True)]) == [1.0]
        assert clock_reads < 20, clock_reads  # before: one wake a millisecond, ~150
    finally:
        release.set()
