"""The built-in tasks (`data.source: builtin:<name>`): problems generated here, never read or
downloaded, over the built-in tokenizer's characters (tiny.ARITHMETIC_ALPHABET, one token
each), so every built-in model and the rollout servers' copy of its tokenizer serve them.

- `builtin:addition`: every "a+b=" with single digits, answered by the last digit of a+b:
  two response tokens (the digit, EOS). Its 100 problems are both its training and its
  evaluation set.
- `builtin:sort`: a string of 5 to 12 digits, answered by the same digits in ascending order
  ("31415926=" -> "11234569"): 9.5 response tokens on average, EOS included, and from 6 to
  13. Chosen over reversal because sorting is counting, which attention does without
  positions: the next digit is the smallest one the prompt holds more often than the answer
  so far does, and EOS comes once none is left; reversal needs each answer position to find
  the prompt position mirrored about "=", which the model must compute from its rotary
  position encoding for every length. And a policy that has learned only that answers rise
  from 0 to 9 already gets part of the positions right, so partial credit (the `positional`
  reward) has a signal from the start. Training draws from 10,000 fixed problems; the
  evaluation set is 100 other fixed problems, none of whose prompts is a training prompt.

Pure and without torch: validation reads the lengths, data.py the problems.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Problem = tuple[str, str]  # (prompt, answer): the answer without EOS

SORT_MIN_DIGITS, SORT_MAX_DIGITS = 5, 12
SORT_TRAIN_PROBLEMS, SORT_EVAL_PROBLEMS = 10_000, 100
_SORT_EVAL_SEED, _SORT_TRAIN_SEED = "builtin:sort/eval", "builtin:sort/train"


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in task: its problems and the longest prompt and answer, in characters (one
    token each under the built-in tokenizer; the answer's EOS not counted)."""

    name: str
    train: Callable[[], list[Problem]]
    evaluation: Callable[[], list[Problem]]
    longest_prompt: int
    longest_answer: int


def addition_problems() -> list[Problem]:
    """Every "a+b=" with single digits; the answer is the last digit of a+b (100 problems)."""
    return [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]


def _sort_problem(rng: random.Random) -> Problem:
    n = rng.randint(SORT_MIN_DIGITS, SORT_MAX_DIGITS)
    digits = "".join(rng.choice("0123456789") for _ in range(n))
    return f"{digits}=", "".join(sorted(digits))


def sort_eval_problems() -> list[Problem]:
    """The held-out set: SORT_EVAL_PROBLEMS fixed problems with distinct prompts."""
    rng, out, seen = random.Random(_SORT_EVAL_SEED), list[Problem](), set[str]()
    while len(out) < SORT_EVAL_PROBLEMS:
        problem = _sort_problem(rng)
        if problem[0] not in seen:
            seen.add(problem[0])
            out.append(problem)
    return out


def sort_train_problems() -> list[Problem]:
    """SORT_TRAIN_PROBLEMS fixed problems with distinct prompts, none of them an evaluation
    prompt (the evaluation measures sorting digit strings never trained on)."""
    held_out = {prompt for prompt, _ in sort_eval_problems()}
    rng, out, seen = random.Random(_SORT_TRAIN_SEED), list[Problem](), set(held_out)
    while len(out) < SORT_TRAIN_PROBLEMS:
        problem = _sort_problem(rng)
        if problem[0] not in seen:
            seen.add(problem[0])
            out.append(problem)
    return out


BUILTIN_TASKS = {
    t.name: t
    for t in (
        BuiltinTask("builtin:addition", addition_problems, addition_problems, 4, 1),
        BuiltinTask(
            "builtin:sort",
            sort_train_problems,
            sort_eval_problems,
            SORT_MAX_DIGITS + 1,
            SORT_MAX_DIGITS,
        ),
    )
}
