"""reward.convention: functions written for TRL (reward_funcs, once per batch) or verl
(compute_score, per response) score unchanged, failing like any reward function."""

from __future__ import annotations

import re
import sys
import time
import types
from typing import Any

import pytest

from gspo_api.spec import RewardConfig
from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.reward_types import Scored
from gspo_trainer.rewards import build_scorer

CALLS: list[dict[str, Any]] = []


def trl_accuracy(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float | None]:
    """As TRL's docs write one: conversational completions, a dataset column by name."""
    CALLS.append({"completions": completions, "solution": solution, **kwargs})
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [
        None if s == "skip" else float(c.strip() == s)
        for c, s in zip(contents, solution, strict=True)
    ]


async def trl_async(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.5 for _ in completions]


def trl_wrong_length(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0]


def trl_slow(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    time.sleep(5)
    return [1.0] * len(completions)


def verl_gsm8k(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float | dict[str, float]:
    """As verl's gsm8k.compute_score: the number after the last '####'."""
    found = re.findall(r"#### (\-?[0-9.,]+)", solution_str)
    score = 1.0 if found and found[-1].replace(",", "") == ground_truth else 0.0
    if extra_info and extra_info.get("as_dict"):
        return {"score": score, "acc": score}
    assert data_source == "openai/gsm8k"
    return score


@pytest.fixture(autouse=True, scope="module")
def reward_module() -> Any:
    module = types.ModuleType("user_rewards")
    for fn in (trl_accuracy, trl_async, trl_wrong_length, trl_slow, verl_gsm8k):
        setattr(module, fn.__name__, fn)
    sys.modules["user_rewards"] = module
    yield
    del sys.modules["user_rewards"]


def scorer(function: str, convention: str, timeout_s: float = 10.0) -> Any:
    cfg = RewardConfig(
        kind="python",
        function=f"user_rewards:{function}",
        convention=convention,
        timeout_seconds=timeout_s,
    )
    return build_scorer(cfg)


def conversation(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def trl_item(completion: str, solution: str) -> Scored:
    row = {"prompt": conversation("3+4?"), "solution": solution, "level": 2}
    return Scored("<|user|>3+4?", completion, solution, True, 2, [5, 6], row["prompt"], row)


def test_a_trl_function_gets_the_batch_as_trl_gives_it() -> None:
    CALLS.clear()
    items = [trl_item("7", "7"), trl_item(" 8", "7"), trl_item("7", "skip")]
    assert scorer("trl_accuracy", "trl").score(items) == [1.0, 0.0, 0.0]  # None scores 0
    (call,) = CALLS  # once for the batch
    assert call["completions"][0] == [{"role": "assistant", "content": "7"}]
    assert call["prompts"] == [conversation("3+4?")] * 3
    assert call["completion_ids"] == [[5, 6]] * 3
    assert call["level"] == [2, 2, 2] and "prompt" not in call  # the other columns


def test_a_trl_function_on_text_prompts_gets_text() -> None:
    CALLS.clear()
    item = Scored("3+4=", "7", "7", True, 1, [5], "3+4=", {"prompt": "3+4=", "solution": "7"})
    assert scorer("trl_accuracy", "trl").score([item]) == [1.0]
    assert CALLS[0]["completions"] == ["7"] and CALLS[0]["prompts"] == ["3+4="]


def test_async_wrong_length_and_slow_trl_functions() -> None:
    items = [trl_item("7", "7"), trl_item("8", "7")]
    assert scorer("trl_async", "trl").score(items) == [0.5, 0.5]
    wrong = scorer("trl_wrong_length", "trl")
    assert wrong.score(items) == [0.0, 0.0] and wrong.failures == {"error": 2, "timeout": 0}
    slow = scorer("trl_slow", "trl", timeout_s=0.05)
    assert slow.score(items) == [0.0, 0.0] and slow.failures == {"error": 0, "timeout": 2}


def test_a_verl_compute_score_gets_verls_arguments() -> None:
    row = {
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": "72"},
        "extra_info": {"index": 0},
    }
    items = [
        Scored("p", "so #### 72", "72", True, row=row),
        Scored("p", "#### 7,2", "72", True, row=row),
        Scored("p", "#### 71", "72", True, row={**row, "extra_info": {"as_dict": True}}),
    ]
    assert scorer("verl_gsm8k", "verl").score(items) == [1.0, 1.0, 0.0]


def test_a_component_may_follow_a_convention_and_the_spec_checks_it() -> None:
    from learner_helpers import tiny_spec

    cfg = RewardConfig.model_validate(
        {
            "functions": [
                {
                    "name": "acc",
                    "kind": "python",
                    "function": "user_rewards:trl_accuracy",
                    "convention": "trl",
                    "weight": 2.0,
                },
                {"name": "fmt", "kind": "format"},
            ]
        }
    )
    totals, means = build_scorer(cfg).score_components([trl_item("7", "7"), trl_item("8", "7")])
    assert totals == [3.0, 1.0] and means["reward/acc"] == 0.5
    spec = tiny_spec()["spec"]
    spec["reward"] = {"kind": "arithmetic", "convention": "trl"}
    with pytest.raises(SpecError, match=r"spec.reward.convention: is only read when reward.kind"):
        parse_spec(spec)


def test_trls_own_accuracy_reward_runs_unchanged() -> None:
    """trl.rewards.accuracy_reward (math-verify on conversational completions, the data set's
    solution column), named in the spec as TRL users pass it to reward_funcs."""
    cfg = RewardConfig(kind="python", function="trl.rewards:accuracy_reward", convention="trl")
    items = [trl_item("so \\boxed{72}", "72"), trl_item("\\boxed{71}", "72")]
    assert build_scorer(cfg).score(items) == [1.0, 0.0]


def test_the_collector_hands_a_conversations_row_to_a_trl_function() -> None:
    """What the learner scores: the example's messages and columns reach the function."""
    from gspo_api.spec import AlgorithmConfig, MetricsConfig
    from gspo_trainer.data import Example
    from gspo_trainer.rollout.types import Completion
    from gspo_trainer.step.rollout import Collector
    from gspo_trainer.tiny import build_tokenizer

    CALLS.clear()
    tok = build_tokenizer()
    row = {"prompt": conversation("3+4?"), "solution": "7"}
    example = Example("<|user|>3+4?", "7", row["prompt"], row)
    ids = tok("7", add_special_tokens=False).input_ids
    completion = Completion(0, ids, [0.0] * len(ids), "stop", 0)
    score = scorer("trl_accuracy", "trl")
    collector = Collector(AlgorithmConfig(), MetricsConfig(), None, tok, score)  # type: ignore[arg-type]
    assert score.score(collector.scored([example], [completion])) == [1.0]
    assert CALLS[0]["prompts"] == [row["prompt"]] and CALLS[0]["solution"] == ["7"]
