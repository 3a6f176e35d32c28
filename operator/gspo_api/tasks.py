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
- `builtin:sort3`: the same task over the symbols 0, 1 and 2, 7 to 10 of them ("2010221=" ->
  "0011222"): 9.7 response tokens on average, EOS included, from 8 to 11. Chosen because
  builtin:sort is not learned from scratch in a few hundred steps: with three symbols every
  answer is a run of 0s, a run of 1s, a run of 2s, so the policy has only three counts and
  the answer's end to get right, and a narrow range of lengths keeps where EOS belongs
  within a few positions. With algorithm.maxResponseTokens at the longest answer and its
  EOS (11) GSPO learns it further than builtin:sort on this CPU, and builtin:sort-distinct
  further still (BENCHMARKS.md). Split
  like builtin:sort: 10,000 training problems, 100 held-out ones.
- `builtin:sort-distinct`: 6 to 10 distinct digits in random order, answered by the same
  digits in ascending order ("39420157=" -> "01234579"): 9 response tokens on average, EOS
  included, from 7 to 11. Each answer token is the smallest prompt digit above the one before
  it, and EOS follows the largest: a lookup that attention does in one step, where
  builtin:sort3's counts are a sum over the whole prompt. The policy learns that answers run
  up from 0 early; what remains is to skip the 0 to 4 digits the prompt lacks (and the
  held-out prompts are orders never trained on, of sets the training saw). From 6 digits, not
  7: a prompt then lacks 2 digits on average, not 1.5 (the 0 one prompt in 5, not 7), so that
  counting up from 0 is wrong more often, for the policy to learn the lookup before it makes
  the count deterministic (with the group baseline alone it did not, on the seeds measured:
  BENCHMARKS.md). Split like builtin:sort.

Pure and without torch: validation reads the lengths, data.py the problems.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Problem = tuple[str, str]  # (prompt, answer): the answer without EOS

SORT_MIN_DIGITS, SORT_MAX_DIGITS = 5, 12
SORT_TRAIN_PROBLEMS, SORT_EVAL_PROBLEMS = 10_000, 100
SORT3_SYMBOLS, SORT3_MIN_DIGITS, SORT3_MAX_DIGITS = "012", 7, 10
DISTINCT_MIN_DIGITS, DISTINCT_MAX_DIGITS = 6, 10


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


@dataclass(frozen=True)
class SortProblems:
    """A sorting task's problems: strings of `shortest` to `longest` characters drawn from
    `symbols`, answered by the same characters in ascending order; the training and
    evaluation sets are drawn with seeds named after the task, so every process has them."""

    name: str
    symbols: str
    shortest: int
    longest: int

    def _rng(self, which: str) -> random.Random:
        return random.Random(f"{self.name}/{which}")

    def _draw(self, which: str, count: int, exclude: set[str]) -> list[Problem]:
        rng, out, seen = self._rng(which), list[Problem](), set(exclude)
        while len(out) < count:
            n = rng.randint(self.shortest, self.longest)
            digits = "".join(rng.choice(self.symbols) for _ in range(n))
            if digits + "=" not in seen:
                seen.add(digits + "=")
                out.append((f"{digits}=", "".join(sorted(digits))))
        return out

    def evaluation(self) -> list[Problem]:
        """The held-out set: SORT_EVAL_PROBLEMS fixed problems with distinct prompts."""
        return self._draw("eval", SORT_EVAL_PROBLEMS, set())

    def train(self) -> list[Problem]:
        """SORT_TRAIN_PROBLEMS fixed problems with distinct prompts, none of them an
        evaluation prompt (the evaluation measures sorting strings never trained on)."""
        held_out = {prompt for prompt, _ in self.evaluation()}
        return self._draw("train", SORT_TRAIN_PROBLEMS, held_out)

    def task(self) -> BuiltinTask:
        return BuiltinTask(self.name, self.train, self.evaluation, self.longest + 1, self.longest)


@dataclass(frozen=True)
class DistinctSortProblems(SortProblems):
    """A sorting task over strings of `shortest` to `longest` distinct characters of
    `symbols`, in random order; drawn and split as SortProblems draws and splits."""

    def _draw(self, which: str, count: int, exclude: set[str]) -> list[Problem]:
        rng, out, seen = self._rng(which), list[Problem](), set(exclude)
        while len(out) < count:
            digits = "".join(rng.sample(self.symbols, rng.randint(self.shortest, self.longest)))
            if digits + "=" not in seen:
                seen.add(digits + "=")
                out.append((f"{digits}=", "".join(sorted(digits))))
        return out


SORT = SortProblems("builtin:sort", "0123456789", SORT_MIN_DIGITS, SORT_MAX_DIGITS)
SORT3 = SortProblems("builtin:sort3", SORT3_SYMBOLS, SORT3_MIN_DIGITS, SORT3_MAX_DIGITS)
SORT_DISTINCT = DistinctSortProblems(
    "builtin:sort-distinct", "0123456789", DISTINCT_MIN_DIGITS, DISTINCT_MAX_DIGITS
)
sort_eval_problems, sort_train_problems = SORT.evaluation, SORT.train


BUILTIN_TASKS = {
    t.name: t
    for t in (
        BuiltinTask("builtin:addition", addition_problems, addition_problems, 4, 1),
        SORT.task(),
        SORT3.task(),
        SORT_DISTINCT.task(),
    )
}
