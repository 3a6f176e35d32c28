"""Reward functions, and the scorer that keeps a failing one from stopping a run.

Three kinds (spec.reward.kind): `arithmetic`, the built-in toy task (the exact answer, then
EOS); `math`, answers checked with math-verify (boxed or final answers against the dataset's
reference); `python`, any `module:function(prompt, completion, answer) -> float`.
A call that raises, returns a non-finite value, or runs past `timeout_seconds` scores 0 and
is counted by reason ("error", "timeout"); the run goes on.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gspo_trainer.config import RewardConfig

log = logging.getLogger("gspo.rewards")

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Scored:
    prompt: str
    completion: str  # decoded response without special tokens
    answer: str
    finished: bool  # the response ended with EOS (not cut at max tokens)


def arithmetic_reward(prompt: str, completion: str, answer: str) -> float:
    """1 for exactly the reference answer (the scorer zeroes unfinished responses), else 0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1 when math-verify finds the completion's final answer equal to the reference."""
    from math_verify import parse, verify

    # Signal-based timeouts only work in the main thread; the scorer bounds the call instead.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$",
                 parsing_timeout=None)  # fmt: skip
    pred = parse(completion, parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0


def load_function(path: str) -> RewardFn:
    """Import `module:function`; errors name what is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward.function {path!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function {path!r}: {module_name} has no function {attr!r}")
    return fn


def reward_function(cfg: RewardConfig) -> RewardFn:
    if cfg.kind == "arithmetic":
        return arithmetic_reward
    if cfg.kind == "math":
        return math_reward
    if cfg.function is None:
        raise ValueError("reward.function: set 'module:function' for reward.kind python")
    return load_function(cfg.function)


@dataclass
class RewardScorer:
    """Scores a batch in daemon threads, each call bounded by `timeout_s`.

    Daemon threads, so a call that never returns is abandoned without blocking exit.
    `failures` counts zero scores by reason since the scorer was made.
    """

    fn: RewardFn
    timeout_s: float = 10.0
    require_finished: bool = False
    parallel: int = 16
    inline: bool = False  # call in this thread: for built-in functions that cannot hang
    on_failure: Callable[[str], None] | None = None
    failures: dict[str, int] = field(default_factory=lambda: {"error": 0, "timeout": 0})

    def score(self, items: Sequence[Scored]) -> list[float]:
        scores = [0.0] * len(items)
        if self.inline:
            results: dict[int, float | BaseException] = {}
            for i, item in enumerate(items):
                self._call(item, i, results)
            return [self._check(i, results.get(i), scores) for i in range(len(items))]
        for start in range(0, len(items), self.parallel):
            chunk = range(start, min(start + self.parallel, len(items)))
            results: dict[int, float | BaseException] = {}
            threads = []
            for i in chunk:
                t = threading.Thread(target=self._call, args=(items[i], i, results), daemon=True)
                t.start()
                threads.append((i, t))
            deadline = _now() + self.timeout_s
            for i, t in threads:
                t.join(max(0.0, deadline - _now()))
                self._check(i, results.get(i), scores)
        return scores

    def _check(self, i: int, outcome: float | BaseException | None, scores: list[float]) -> float:
        if outcome is None:
            self._fail("timeout", f"reward call for item {i} ran past {self.timeout_s}s")
        elif isinstance(outcome, BaseException):
            self._fail("error", f"reward call for item {i} raised {outcome!r}")
        elif not math.isfinite(outcome):
            self._fail("error", f"reward call for item {i} returned {outcome}")
        else:
            scores[i] = outcome
        return scores[i]

    def _call(self, item: Scored, i: int, results: dict[int, float | BaseException]) -> None:
        if self.require_finished and not item.finished:
            results[i] = 0.0
            return
        try:
            results[i] = float(self.fn(item.prompt, item.completion, item.answer))
        except BaseException as exc:
            results[i] = exc

    def _fail(self, reason: str, message: str) -> None:
        self.failures[reason] += 1
        if self.on_failure is not None:
            self.on_failure(reason)
        log.warning("%s; scored 0", message)


def _now() -> float:
    import time

    return time.monotonic()


def build_scorer(cfg: RewardConfig, on_failure: Callable[[str], None] | None = None):
    return RewardScorer(
        reward_function(cfg),
        timeout_s=cfg.timeout_seconds,
        require_finished=cfg.kind == "arithmetic",
        inline=cfg.kind == "arithmetic",
        on_failure=on_failure,
    )
