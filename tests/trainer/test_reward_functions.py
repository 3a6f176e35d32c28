"""reward.functions: weighted components (TRL's reward_funcs + reward_weights), the format and
length components, failures per component, and each component in history and Prometheus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from learner_helpers import make_learner, tiny_spec

from gspo_api.spec import RewardConfig
from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.plot import read_history
from gspo_trainer.reward_types import Scored
from gspo_trainer.rewards import build_scorer, format_reward, length_penalty


def boom(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("reward exploded")


def varied(prompt: str, completion: str, answer: str) -> float:
    return float(sum(map(ord, completion)) % 7)


def item(completion: str, tokens: int, finished: bool = True, answer: str = "7") -> Scored:
    return Scored("3+4=", completion, answer, finished, tokens)


def test_format_checks_eos_non_empty_and_the_pattern() -> None:
    assert format_reward(item("7", 2)) == 1.0
    assert format_reward(item("anything at all", 9)) == 1.0  # no pattern: finished, not empty
    assert format_reward(item("7", 1, finished=False)) == 0.0  # cut at max tokens
    assert format_reward(item("  ", 3)) == 0.0
    assert format_reward(item(" 12 ", 4), r"-?[0-9]+") == 1.0
    assert format_reward(item("1 2", 4), r"-?[0-9]+") == 0.0  # two answers
    assert format_reward(item("7+", 3), r"-?[0-9]+") == 0.0


def test_length_is_free_to_the_target_then_falls_to_minus_one() -> None:
    assert [length_penalty(n, 2, 6) for n in range(7)] == [0, 0, 0, -0.25, -0.5, -0.75, -1]
    assert length_penalty(3, 0, 3) == -1.0


def test_the_reward_is_the_weighted_sum_of_its_components() -> None:
    cfg = RewardConfig.model_validate(
        {
            "functions": [
                {"name": "exact", "kind": "arithmetic", "weight": 2.0},
                {"name": "format", "kind": "format", "pattern": "[0-9]+", "weight": 0.5},
                {"name": "short", "kind": "length", "targetTokens": 1, "weight": 3.0},
            ]
        }
    )
    items = [item("7", 2), item("8", 1), item("x", 4), item("7", 4, finished=False)]
    totals, means = build_scorer(cfg, max_response_tokens=4).score_components(items)
    exact, fmt, short = [1, 0, 0, 0], [1, 1, 0, 0], [-1 / 3, 0, -1, -1]
    expected = [2.0 * e + 0.5 * f + 3.0 * s for e, f, s in zip(exact, fmt, short, strict=True)]
    assert totals == pytest.approx(expected)
    assert means == pytest.approx(
        {"reward/exact": 0.25, "reward/format": 0.5, "reward/short": (-1 / 3 - 2) / 4}
    )


def test_a_raising_component_scores_zero_and_is_counted() -> None:
    metrics = LearnerMetrics()
    cfg = RewardConfig.model_validate(
        {
            "functions": [
                {"name": "broken", "kind": "python", "function": "test_reward_functions:boom"},
                {"name": "format", "kind": "format", "weight": 0.5},
            ]
        }
    )
    scorer = build_scorer(cfg, lambda reason: metrics.reward_failures.labels(reason).inc())
    totals, means = scorer.score_components([item("7", 2), item("", 1)])
    assert totals == [0.5, 0.0]  # the format component still counts
    assert means["reward/broken"] == 0.0
    assert scorer.failures == {"error": 2, "timeout": 0}
    assert metrics.registry.get_sample_value("gspo_reward_failures_total", {"reason": "error"}) == 2


def test_functions_with_kind_or_function_are_refused_naming_the_field() -> None:
    spec = tiny_spec()["spec"]
    spec["reward"]["functions"] = [{"name": "format", "kind": "format"}]
    with pytest.raises(SpecError) as info:
        parse_spec(spec)  # the tiny spec also sets reward.kind: arithmetic
    (problem,) = info.value.problems
    assert problem.path == "spec.reward.kind"
    assert "remove reward.kind and reward.function" in problem.message
    del spec["reward"]["kind"]
    assert parse_spec(spec).reward.kind is None  # the list alone is a valid reward


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_each_component_goes_to_history_and_prometheus(cache: Path, tmp_path: Path) -> None:
    manifest = tiny_spec(miniBatches=1)
    weights = {"exact": 1.0, "format": 0.25, "short": 0.5, "varied": 0.1}
    manifest["spec"]["reward"] = {
        "timeoutSeconds": 5,
        "functions": [
            {"name": "exact", "kind": "arithmetic", "weight": weights["exact"]},
            {"name": "format", "kind": "format", "pattern": "[0-9]+", "weight": weights["format"]},
            {"name": "short", "kind": "length", "targetTokens": 1, "weight": weights["short"]},
            {
                "name": "varied",
                "kind": "python",
                "function": "test_reward_functions:varied",
                "weight": weights["varied"],
            },
        ],
    }
    history = tmp_path / "history.jsonl"
    learner = make_learner(cache, None, manifest, history_path=history)
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    (record,) = read_history(history)
    sample = learner.metrics.registry.get_sample_value
    for name in weights:
        assert record[f"reward/{name}"] == stats[f"reward/{name}"]
        assert sample("gspo_reward_component", {"name": name}) == stats[f"reward/{name}"]
    assert stats["reward/varied"] > 0  # a real mean, not a constant
    assert stats["reward/short"] < 0  # random 4-token answers run past 1 token
    # The mean reward is the weighted sum of the component means (the sum is linear).
    combined = sum(w * stats[f"reward/{n}"] for n, w in weights.items())
    assert stats["reward_mean"] == pytest.approx(combined, abs=1e-5)


def test_a_single_reward_kind_logs_no_components(cache: Path) -> None:
    learner = make_learner(cache, None, tiny_spec(miniBatches=1))
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    assert not [k for k in stats if k.startswith("reward/")]
    assert learner.spec.reward.kind == "arithmetic"
