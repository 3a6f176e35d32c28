"""Rewards: the built-in task, math-verify, user functions, and failures that score 0."""

from __future__ import annotations

import math
import time

import pytest

from gspo_api.spec import RewardConfig
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.rewards import (
    RewardScorer,
    Scored,
    arithmetic_reward,
    build_scorer,
    final_part,
    load_function,
    math_reward,
)


def always_half(prompt: str, completion: str, answer: str) -> float:
    return 0.5


def boom(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("reward exploded")


def hang(prompt: str, completion: str, answer: str) -> float:
    time.sleep(30)
    return 1.0


def not_a_number(prompt: str, completion: str, answer: str) -> float:
    return math.nan


def item(completion: str, answer: str = "7", finished: bool = True) -> Scored:
    return Scored("3+4=", completion, answer, finished)


def test_arithmetic_needs_exact_answer_and_eos() -> None:
    scorer = build_scorer(RewardConfig(kind="arithmetic"))
    scores = scorer.score([item("7"), item("8"), item("77"), item("7", finished=False)])
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert arithmetic_reward("", " 7 ", "7") == 1.0


def test_math_verify_reads_boxed_answers() -> None:
    assert math_reward("", "so the answer is \\boxed{42}", "42") == 1.0
    assert math_reward("", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("", "\\boxed{41}", "42") == 0.0


def test_python_function_by_module_path() -> None:
    fn = load_function("test_rewards:always_half")
    assert fn("", "", "") == 0.5
    with pytest.raises(ValueError, match="no function 'missing'"):
        load_function("test_rewards:missing")
    with pytest.raises(ValueError, match="cannot import"):
        load_function("no_such_module_xyz:f")


def test_raising_hanging_and_nan_rewards_score_zero_and_are_counted() -> None:
    metrics = LearnerMetrics()

    def counted(reason: str) -> None:
        metrics.reward_failures.labels(reason).inc()

    items = [item("7")] * 3
    scorer = RewardScorer(boom, timeout_s=5, on_failure=counted)
    assert scorer.score(items) == [0.0, 0.0, 0.0]
    assert scorer.failures == {"error": 3, "timeout": 0}

    start = time.monotonic()
    hung = RewardScorer(hang, timeout_s=0.3, on_failure=counted)
    assert hung.score(items) == [0.0, 0.0, 0.0]
    assert time.monotonic() - start < 3  # the three calls share one deadline
    assert hung.failures == {"error": 0, "timeout": 3}

    assert RewardScorer(not_a_number, on_failure=counted).score(items[:1]) == [0.0]
    sample = metrics.registry.get_sample_value
    assert sample("gspo_reward_failures_total", {"reason": "error"}) == 4
    assert sample("gspo_reward_failures_total", {"reason": "timeout"}) == 3


def test_user_function_scores_pass_through() -> None:
    cfg = RewardConfig(kind="python", function="test_rewards:always_half")
    assert build_scorer(cfg).score([item("x"), item("y", finished=False)]) == [0.5, 0.5]


def test_math_reads_the_answer_after_the_reasoning_and_needs_a_finished_response() -> None:
    """A reasoning model's intermediate numbers are not its answer; a response cut at
    maxResponseTokens (or still thinking) has none."""
    scorer = build_scorer(RewardConfig(kind="math"))
    think = "<think>3+4 is 7, but let me say 12 first</think>The answer is \\boxed{7}."
    assert scorer.score([item(think)]) == [1.0]
    assert scorer.score([item(think, answer="12")]) == [0.0]  # 12 only inside the reasoning
    assert scorer.score([item("<think>it is \\boxed{7}")]) == [0.0]  # never left the reasoning
    assert scorer.score([item("\\boxed{7}", finished=False)]) == [0.0]  # cut at max tokens
    assert scorer.score([item("\\boxed{7}")]) == [1.0]
    assert final_part("a</think>b</think>c") == "c"
