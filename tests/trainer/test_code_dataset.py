"""The code data set the project ships (examples/data/code-problems.jsonl) and examples/code.yaml:
every reference solution passes its own tests in the sandbox, a wrong one does not, and the
learner's preflight names a row without tests before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gspo_api.spec import RewardConfig
from gspo_api.validation import parse_spec
from gspo_trainer.code.preflight import check_code_reward
from gspo_trainer.code.runner import CodeScorer
from gspo_trainer.reward_types import Scored
from gspo_trainer.rewards import build_scorer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/code.yaml").read_text())
PROBLEMS = REPO / EXAMPLE["spec"]["data"]["source"]


def rows() -> list[dict]:
    return [json.loads(line) for line in PROBLEMS.read_text().splitlines() if line.strip()]


def test_every_reference_solution_passes_its_tests_and_a_wrong_one_none() -> None:
    reward = RewardConfig.model_validate(EXAMPLE["spec"]["reward"])
    reward.sandbox.concurrency = 4
    scorer = build_scorer(reward)
    assert isinstance(scorer, CodeScorer)
    data = rows()
    assert len(data) >= 30 and len({r["id"] for r in data}) == len(data)
    assert sum("tests" in r for r in data) >= 20 and sum("test" in r for r in data) >= 8
    solutions = [Scored(r["prompt"], f"```python\n{r['answer']}```", "", True, row=r) for r in data]
    wrong = [Scored(r["prompt"], "print(0)", "", True, row=r) for r in data[::8]]
    scores, stats = scorer.score_components(solutions + wrong)
    failing = [r["id"] for r, s in zip(data, scores, strict=False) if s != 1.0]
    assert failing == []
    assert max(scores[len(data) :]) < 1.0
    assert stats["code_tests/sandbox_failure"] == 0


def test_the_example_validates_and_its_preflight_passes() -> None:
    spec = parse_spec(EXAMPLE["spec"])
    import os

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert check_code_reward(spec) == []
    finally:
        os.chdir(cwd)


def test_a_row_without_tests_is_named_before_the_run(tmp_path) -> None:
    data = tmp_path / "problems.jsonl"
    lines = [json.dumps(r) for r in rows()[:2]] + [json.dumps({"prompt": "p", "answer": "a"})]
    data.write_text("\n".join(lines) + "\n")
    raw = {**EXAMPLE["spec"], "data": {**EXAMPLE["spec"]["data"], "source": str(data)}}
    problems = check_code_reward(parse_spec(raw))
    assert len(problems) == 1
    field, message = problems[0]
    assert field == "spec.data.source" and message.startswith("row 2: the row has neither 'tests'")
