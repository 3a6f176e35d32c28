"""reward.kind code: programs extracted from responses, run against a row's tests in the
sandbox, judged like a contest judge, scored and counted by outcome (code/runner.py)."""

from __future__ import annotations

import re
from typing import get_args

import pytest

from gspo_api.spec import CodeConfig, RewardConfig, SandboxConfig
from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.code.runner import OUTCOMES, CodeRunner, CodeScorer, Outcome
from gspo_trainer.code.sandbox import LocalSandbox
from gspo_trainer.code.tasks import BadTests, Case, extract_program, outputs_match, task_from_row
from gspo_trainer.metrics import CODE_OUTCOMES, LearnerMetrics
from gspo_trainer.reward_types import Scored
from gspo_trainer.rewards import build_scorer

ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}
SQUARE = {
    "test": "def check(f):\n    assert f(2) == 4\n    assert f(3) == 9\n",
    "entry_point": "sq",
}
FAST = {"timeoutSeconds": 2, "concurrency": 4}


def scored(completion: str, row: dict | None) -> Scored:
    return Scored("p", completion, "", True, row=row)


def code_scorer(**code: object) -> CodeScorer:
    cfg = RewardConfig.model_validate({"kind": "code", "code": code, "sandbox": FAST})
    scorer = build_scorer(cfg)
    assert isinstance(scorer, CodeScorer)
    return scorer


def test_the_program_is_the_last_fenced_block_or_the_whole_response() -> None:
    text = "plan\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\nbye"
    assert extract_program(text, "last-block") == "print(2)\n"
    assert extract_program("print(3)", "last-block") == "print(3)"  # no block: all of it
    assert extract_program(text, "whole") == text
    thought = "<think>```python\nprint(0)\n```</think>no code here"
    assert extract_program(thought, "last-block") == "no code here"


def test_outputs_compare_as_judges_do() -> None:
    assert outputs_match("5  \n\n\n", "5")  # trailing whitespace and blank lines
    assert outputs_match("1 2\r\n3\n", "1 2\n3")
    assert not outputs_match("1  2", "1 2")  # inner whitespace counts without a tolerance
    assert not outputs_match("0.3333333", "0.333333333")
    assert outputs_match("0.3333333", "0.333333333", float_tolerance=1e-6)
    assert outputs_match("x 1e6", "x 1000000.0000001", float_tolerance=1e-6)
    assert not outputs_match("0.34", "0.333333333", float_tolerance=1e-6)
    assert not outputs_match("nan", "0", float_tolerance=1e-6)
    assert not outputs_match("yes 1", "no 1", float_tolerance=1e-6)


def test_tests_are_read_from_the_configured_fields_or_refused_by_name() -> None:
    cfg = CodeConfig()
    assert task_from_row(ADD, cfg).cases == (Case("2 3\n", "5\n"), Case("10 -4\n", "6"))
    assert task_from_row({"tests": '[{"input": "", "output": "1"}]'}, cfg).count == 1
    apps = {"tests": {"inputs": ["1\n"], "outputs": ["2\n"]}}
    assert task_from_row(apps, cfg).cases == (Case("1\n", "2\n"),)
    assert task_from_row(SQUARE, cfg).entry_point == "sq"
    renamed = CodeConfig.model_validate({"testsField": "io"})
    assert task_from_row({"io": ADD["tests"]}, renamed).count == 2
    for row, says in (({"prompt": "x"}, "neither 'tests'"),
                      ({"tests": []}, "non-empty list"),
                      ({"tests": [{"input": 1, "output": "2"}]}, "'tests'[0]"),
                      ({"tests": "not json"}, "not JSON"),
                      ({"test": "assert 1", "entry_point": "a b"}, "name a function")):  # fmt: skip
        with pytest.raises(BadTests, match=re.escape(says)):
            task_from_row(row, cfg)


def test_one_name_per_outcome_in_the_runner_and_the_metrics() -> None:
    assert OUTCOMES == CODE_OUTCOMES == get_args(Outcome)


def test_programs_are_scored_by_the_share_of_tests_passed_and_counted_by_outcome() -> None:
    scorer = code_scorer()
    items = [
        scored("```python\na, b = map(int, input().split())\nprint(a + b)\n```", ADD),
        scored("a, b = map(int, input().split())\nprint(a - b if a < 5 else a + b)", ADD),
        scored("def sq(x):\n    return x * x", SQUARE),
        scored("def sq(x):\n    return x + x", SQUARE),  # f(2) passes, f(3) fails: wrong
        scored("import os\nos._exit(0)\ndef sq(x): return x", SQUARE),  # exits before asserts
        scored("def sq(x) return x", SQUARE),
        scored("12", SQUARE),  # no sq at all: check(sq) cannot pass
        scored("raise ValueError('no')", ADD),
        scored("print(1)", {"prompt": "no tests"}),
    ]
    scores, stats = scorer.score_components(items)
    assert scores == [1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats == {"code_tests/passed": 4, "code_tests/wrong_answer": 3,
                     "code_tests/timeout": 0, "code_tests/memory": 0,
                     "code_tests/runtime_error": 3, "code_tests/compile_error": 1,
                     "code_tests/sandbox_failure": 1, "code_pass_rate": 2 / 9}  # fmt: skip
    assert scorer.failures["error"] == 1  # the row without tests: visible, not a wrong answer
    assert (scorer.last.calls, scorer.last.failed_total) == (9, 1)  # reward.maxFailedSteps


def test_all_or_nothing_scoring() -> None:
    items = [scored("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", ADD)]
    assert code_scorer(scoring="all").score(items) == [0.0]
    assert code_scorer(scoring="fraction").score(items) == [0.5]


def test_float_tolerance_reaches_the_judge() -> None:
    row = {"tests": [{"input": "", "output": "0.333333333"}]}
    items = [scored("print(1 / 3)", row)]
    assert code_scorer().score(items) == [0.0]  # 0.3333333333333333 != 0.333333333
    assert code_scorer(floatTolerance=1e-6).score(items) == [1.0]


def test_test_cases_run_concurrently_up_to_the_limit() -> None:
    row = {"tests": [{"input": "", "output": "done"}] * 4}
    program = "import time\ntime.sleep(0.5)\nprint('done')"
    sandbox = LocalSandbox(SandboxConfig(timeout_seconds=5))
    runner = CodeRunner(sandbox, CodeConfig())
    import time

    t0 = time.monotonic()
    assert CodeScorer(runner, concurrency=4).score([scored(program, row)]) == [1.0]
    assert time.monotonic() - t0 < 4 * 0.5  # serial would take 2 s or more


def test_a_code_component_adds_its_counts_to_the_step(tmp_path) -> None:
    cfg = RewardConfig.model_validate({
        "functions": [{"name": "tests", "kind": "code"},
                      {"name": "fmt", "kind": "format", "weight": 0.1}],
        "sandbox": FAST,
    })  # fmt: skip
    totals, stats = build_scorer(cfg).score_components([scored("print(5)", ADD)])
    assert totals == pytest.approx([0.5 + 0.1])
    assert stats["reward/tests"] == 0.5 and stats["code_tests/passed"] == 1.0
    metrics = LearnerMetrics()
    metrics.observe_step(1, stats)
    metrics.observe_step(2, stats)
    sample = metrics.registry.get_sample_value
    assert sample("gspo_code_tests_total", {"outcome": "passed"}) == 2.0
    assert sample("gspo_code_tests_total", {"outcome": "wrong_answer"}) == 2.0
    assert sample("gspo_code_tests_total", {"outcome": "timeout"}) == 0.0
    assert sample("gspo_code_pass_rate") == 0.0


def test_two_code_components_are_refused_by_name() -> None:
    code = [{"name": "a", "kind": "code"}, {"name": "b", "kind": "code"}]
    spec = {
        "model": {"name": "builtin:tiny-qwen3"},
        "data": {"source": "builtin:addition"},
        "reward": {"functions": code},
    }
    with pytest.raises(SpecError, match=r"reward\.functions: 'a', 'b' are of kind code"):
        parse_spec(spec)


def test_the_pass_rate_and_sandbox_failures_show_in_the_bar(tmp_path) -> None:
    import io

    from gspo_trainer.train import ProgressView

    records = [{"step": s, "reward_mean": 0.5, "code_pass_rate": 0.25,
                "code_tests/sandbox_failure": float(s == 2)} for s in (1, 2)]  # fmt: skip
    view = ProgressView(tmp_path / "history.jsonl", 2, bar=False, out=io.StringIO())
    view.records = records
    assert "code_pass_rate=0.250" in view.describe(records[0])
    assert "sandbox_failure" not in view.describe(records[0])
    assert "code_tests/sandbox_failure=1" in view.describe(records[1])


def test_a_program_that_does_not_compile_runs_once_whatever_its_test_count() -> None:
    sandbox = LocalSandbox(SandboxConfig(timeout_seconds=2))
    runs = []

    class Counting:
        def run(self, *args, **kwargs):
            runs.append(args[0]["program.py"])
            return sandbox.run(*args, **kwargs)

    scorer = CodeScorer(CodeRunner(Counting(), CodeConfig()), concurrency=2)
    row = {"tests": [{"input": f"{n} 1\n", "output": f"{n + 1}\n"} for n in range(4)]}
    broken, working = "def (", "a, b = map(int, input().split())\nprint(a + b)"
    scores, stats = scorer.score_components([scored(broken, row), scored(working, row)])
    assert scores == [0.0, 1.0]
    assert stats["code_tests/compile_error"] == 4 and stats["code_tests/passed"] == 4
    assert runs.count(broken) == 1 and runs.count(working) == 4
