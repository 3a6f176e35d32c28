"""What a code reward reads: the program in a response, the tests in a row, and the judge.

Two test formats cover the common data sets: stdin/stdout cases (APPS, CodeContests,
LiveCodeBench: a list of {input, output}, or a JSON string of one) and assert-style test code
run after the program (MBPP, HumanEval: `test` plus `entry_point`). Field names come from
reward.code. A row whose tests cannot be read raises `BadTests`, naming the field: the scorer
counts it as a sandbox failure, never as a wrong answer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gspo_api.spec import CodeConfig

FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
THINK_END = "</think>"


class BadTests(ValueError):
    """A row's tests are missing or malformed (the data's fault, not the program's)."""


@dataclass(frozen=True)
class Case:
    """One stdin/stdout test case."""

    input: str
    output: str


@dataclass(frozen=True)
class CodeTask:
    """A row's tests: stdin/stdout `cases`, or assert-style `test` code checking `entry_point`."""

    cases: tuple[Case, ...] = ()
    test: str | None = None
    entry_point: str | None = None

    @property
    def count(self) -> int:
        return len(self.cases) if self.test is None else 1


def extract_program(response: str, mode: str) -> str:
    """The program in a response: the last fenced code block ("last-block"; the whole
    response when it has none) or the whole response ("whole"). Reasoning before the last
    </think> is never code."""
    if THINK_END in response:
        response = response.rsplit(THINK_END, 1)[1]
    if mode == "last-block":
        blocks = FENCE.findall(response)
        if blocks:
            return blocks[-1]
    return response


def task_from_row(row: Mapping[str, Any] | None, cfg: CodeConfig) -> CodeTask:
    """The row's tests, read with reward.code's field names."""
    if row is None:
        raise BadTests("the data set's rows are not available to the code reward")
    if row.get(cfg.tests_field) is not None:
        return CodeTask(cases=_cases(row[cfg.tests_field], cfg.tests_field))
    if row.get(cfg.test_field) is not None:
        test, entry = row[cfg.test_field], row.get(cfg.entry_point_field)
        if not isinstance(test, str) or not test.strip():
            raise BadTests(f"field {cfg.test_field!r} must be test code (a non-empty string)")
        if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
            raise BadTests(f"field {cfg.entry_point_field!r} must name a function, not {entry!r}")
        return CodeTask(test=test, entry_point=entry)
    raise BadTests(
        f"the row has neither {cfg.tests_field!r} (stdin/stdout cases) nor {cfg.test_field!r} "
        f"(assert-style tests); fields: {sorted(row)}; set reward.code.testsField or testField"
    )


def _cases(value: Any, field: str) -> tuple[Case, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadTests(f"field {field!r} is a string but not JSON: {exc}") from exc
    if isinstance(value, Mapping) and {"inputs", "outputs"} <= value.keys():  # APPS' layout
        value = [
            {"input": i, "output": o}
            for i, o in zip(value["inputs"], value["outputs"], strict=False)
        ]
    if not isinstance(value, list) or not value:
        raise BadTests(f"field {field!r} must be a non-empty list of {{input, output}}")
    out = []
    for i, case in enumerate(value):
        if not (
            isinstance(case, Mapping)
            and isinstance(case.get("input"), str)
            and isinstance(case.get("output"), str)
        ):
            raise BadTests(f"field {field!r}[{i}] must be {{input: str, output: str}}")
        out.append(Case(case["input"], case["output"]))
    return tuple(out)


def outputs_match(got: str, want: str, float_tolerance: float | None = None) -> bool:
    """As contest judges compare: trailing whitespace on each line and trailing blank lines
    are ignored; with `float_tolerance`, tokens that both parse as numbers may differ by that
    much (absolute or relative), other tokens must be equal."""
    got_lines, want_lines = _lines(got), _lines(want)
    if got_lines == want_lines:
        return True
    if float_tolerance is None or len(got_lines) != len(want_lines):
        return False
    for g_line, w_line in zip(got_lines, want_lines, strict=True):
        g_tokens, w_tokens = g_line.split(), w_line.split()
        if len(g_tokens) != len(w_tokens):
            return False
        for g, w in zip(g_tokens, w_tokens, strict=True):
            if g != w and not _close(g, w, float_tolerance):
                return False
    return True


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(got: str, want: str, tolerance: float) -> bool:
    try:
        g, w = float(got), float(want)
    except ValueError:
        return False
    if not (math.isfinite(g) and math.isfinite(w)):
        return False
    return math.isclose(g, w, rel_tol=tolerance, abs_tol=tolerance)
