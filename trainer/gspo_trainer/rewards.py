"""Reward functions, and the scorer that keeps a failing one from stopping a run.

Five kinds (spec.reward.kind): `arithmetic`, builtin:addition's (the exact answer, then
EOS); `positional`, builtin:sort's (partial credit: the share of the answer's positions right,
per token under lossLevel gspo-token, 0 without EOS); `math`, answers checked with
math-verify (boxed or final answers against the dataset's reference); `python`, any
`module:function(prompt, completion, answer) -> float`; `code`, the response's program run
against the row's tests in a sandbox (code/runner.py).
A call that raises, returns a value that is not a finite float32 (NaN, inf, or past ±3.4e38,
which the learner's float32 tensors would turn into inf), or runs past `timeout_seconds`
scores 0 and is counted by reason ("error", "timeout"), with one warning per batch; the run
goes on, unless every call of reward.maxFailedSteps steps in a row failed (RewardFailed).

Or several weighted components (spec.reward.functions, TRL's reward_funcs + reward_weights):
the reward is sum(weight_i x r_i), each component scored (and failing) on its own. Two more
kinds serve as components: `format` (finished, non-empty, optionally matching a pattern) and
`length` (a penalty past a target length).

A python function written for TRL or verl runs unchanged with reward.convention trl or verl
(reward_conventions.py says what each argument is).

Per-token rewards (for algorithm.lossLevel gspo-token): a `gspo`-convention function may
return one score per response token instead of one number (a list, tuple or 1-D array as long
as the response's token ids, EOS included; a function with a `token_ids` parameter is given
them). A list of another length fails the call like a NaN does, the message naming the reward.
The response's reward, wherever one number is read (reward_mean, greedy accuracy, samples,
reward curves), is the mean of its token scores: a number reads as that number on every token,
so the two kinds mix (weighted components, failures scoring 0) without changing either's mean.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gspo_api.spec import RewardConfig, RewardFunctionConfig
from gspo_api.validation import ConfigError
from gspo_trainer.metrics import REWARD_COMPONENT_PREFIX
from gspo_trainer.reward_types import BatchOutcome, Scored

log = logging.getLogger("gspo.rewards")

RewardFn = Callable[[str, str, str], float]
Score = float | tuple[float, ...]  # one number, or one per response token
FLOAT32_MAX = 3.4028234663852886e38  # a larger reward is inf in the learner's float32 tensors


class RewardFailed(RuntimeError):
    """Every reward call failed in reward.maxFailedSteps steps in a row: the function is
    broken or hangs, and training on all-zero rewards would learn nothing."""


def out_of_range(value: float) -> bool:
    """NaN, inf, or a float64 beyond what float32 holds (it would become inf)."""
    return not math.isfinite(value) or abs(value) > FLOAT32_MAX


def sequence_reward(score: Score) -> float:
    """The one number of a response's score: a per-token score's mean (0 with no tokens)."""
    if isinstance(score, tuple):
        return sum(score) / len(score) if score else 0.0
    return score


def token_rewards(scores: Sequence[Score], lengths: Sequence[int]) -> list[list[float]] | None:
    """Each response's score per token (a number repeated over its `lengths` tokens), or None
    when every score is one number (the batch has no per-token reward)."""
    if not any(isinstance(s, tuple) for s in scores):
        return None
    return [
        list(s) if isinstance(s, tuple) else [s] * n for s, n in zip(scores, lengths, strict=True)
    ]


def as_score(value: Any, tokens: int | None, name: str) -> Score:
    """A reward call's return value as a Score: a list, tuple or 1-D array is one score per
    response token and must be as long as the response (`tokens`); anything else is read
    with float(), as a single reward always was."""
    if isinstance(value, list | tuple) or getattr(value, "ndim", None) == 1:
        scores = tuple(float(v) for v in value)
        if tokens is None or len(scores) != tokens:
            raise ValueError(
                f"reward {name} returned {len(scores)} per-token scores for a response of "
                f"{'unknown length' if tokens is None else f'{tokens} tokens'}: return one "
                "number, or one score per response token (its token_ids, EOS included)"
            )
        return scores
    return float(value)


def _add(total: Score, weight: float, score: Score) -> Score:
    """total + weight x score, a number counting on every token of a per-token score."""
    if not isinstance(total, tuple) and not isinstance(score, tuple):
        return total + weight * score
    # One of the two is a tuple (both numbers returned above); mypy cannot follow that.
    n = len(total) if isinstance(total, tuple) else len(score)  # type: ignore[arg-type]
    t = total if isinstance(total, tuple) else (total,) * n
    s = score if isinstance(score, tuple) else (score,) * n
    return tuple(a + weight * b for a, b in zip(t, s, strict=True))


def _bad(score: Score) -> bool:
    """Whether any value of `score` is not a finite float32 (see out_of_range)."""
    return any(map(out_of_range, score)) if isinstance(score, tuple) else out_of_range(score)


def takes_token_ids(fn: Callable[..., Any]) -> bool:
    """Whether `fn` declares a `token_ids` parameter (it is then given the response's ids)."""
    try:
        return "token_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or extension function without a signature
        return False


ItemFn = Callable[["Scored"], float]  # built-in components that read more than the text


def arithmetic_reward(prompt: str, completion: str, answer: str) -> float:
    """1 for exactly the reference answer (the scorer zeroes unfinished responses), else 0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


AnswerIds = Callable[[str], Sequence[int]]  # an answer's token ids, then EOS's


def positional_reward(
    item: Scored, per_token: bool = False, answer_ids: AnswerIds | None = None
) -> Score:
    """Partial credit: the share of positions where the response matches the reference.

    With `answer_ids` and the response's token ids, a position is a token: the answer's
    tokens, then EOS, against the response's tokens as sampled (EOS among them when it ended
    with one), so a special token the decoded text would not show (a pad) is a wrong
    position like any other. Without them, the answer's characters then EOS, against the
    response's characters then EOS if it ended with one. Position i is right when both hold
    the same there, and the share is of the longer of the two, so a response too short or
    too long loses the positions it lacks or adds, and only the exact answer with its EOS
    scores 1.

    With `per_token`, one score per response token (for lossLevel gspo-token): 1 for a right
    position, 0 for a wrong one, all scaled by (response positions / the longer length) so
    that their mean is the share (a response too short spreads the loss of the positions it
    lacks over its tokens). Only where the positions are the response's tokens (token ids,
    or one character per token); otherwise, and for a response of no tokens, one number."""
    want: list[object]
    got: list[object]
    if answer_ids is not None and item.token_ids is not None:
        want, got = list(answer_ids(item.answer.strip())), list(item.token_ids)
    else:  # None stands for EOS
        want = [*item.answer.strip(), None]
        got = [*item.completion, None] if item.finished else [*item.completion]
    right = [g == w for g, w in zip(got, want, strict=False)]
    longer = max(len(got), len(want))
    if not per_token or not got or item.tokens != len(got):
        return sum(right) / longer
    scale = len(got) / longer
    return tuple(scale * (i < len(right) and right[i]) for i in range(len(got)))


def tokenizer_answer_ids(tokenizer: Any) -> AnswerIds:
    """An answer's token ids as the policy's tokenizer writes them (no special tokens), then
    its EOS id; remembered per answer (the same few are scored 16 times a step)."""
    from functools import lru_cache

    eos = tokenizer.eos_token_id

    @lru_cache(maxsize=65536)
    def ids(answer: str) -> tuple[int, ...]:
        return (*tokenizer(answer, add_special_tokens=False).input_ids, eos)

    return ids


THINK_END = "</think>"


def final_part(completion: str) -> str | None:
    """The answer part of a reasoning model's response: after its last </think>; None when a
    <think> block was opened and never closed (the response ended while still thinking).
    A response without thinking tags is all answer."""
    if THINK_END in completion:
        return completion.rsplit(THINK_END, 1)[1]
    if "<think>" in completion:
        return None
    return completion


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1 when math-verify finds the final answer of the completion (after any </think>: the
    reasoning's intermediate numbers do not count) equal to the reference."""
    from math_verify import parse, verify

    final = final_part(completion)
    if final is None:
        return 0.0

    # Signal-based timeouts only work in the main thread; the scorer bounds the call instead.
    gold = parse(
        answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None
    )
    pred = parse(final, parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0


def format_reward(item: Scored, pattern: str | None = None) -> float:
    """1 when the response is well-formed: it ended with EOS (not cut at max tokens), is not
    empty once stripped, and, given `pattern`, the stripped text matches it whole (for
    builtin:addition, '-?[0-9]+': a single answer, then EOS). Correctness is not checked."""
    text = item.completion.strip()
    if not item.finished or not text:
        return 0.0
    return 1.0 if pattern is None or re.fullmatch(pattern, text) else 0.0


def length_penalty(tokens: int, target_tokens: int, max_tokens: int) -> float:
    """0 up to `target_tokens`, then linearly down to -1 at `max_tokens` (and below none)."""
    if tokens <= target_tokens:
        return 0.0
    return -min(1.0, (tokens - target_tokens) / max(1, max_tokens - target_tokens))


def load_function(path: str) -> RewardFn:
    """Import `module:function`; errors name what is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"reward.function {path!r}: cannot import {module_name!r}: {exc}"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward.function {path!r}: {module_name} has no function {attr!r}")
    return fn


def reward_function(cfg: RewardConfig) -> RewardFn:
    if cfg.kind == "arithmetic":
        return arithmetic_reward
    if cfg.kind == "math":
        return math_reward
    if cfg.function is None:
        raise ConfigError("reward.function: set 'module:function' for reward.kind python")
    return load_function(cfg.function)


class WorkerPool:
    """At most `size` daemon threads, for the scorer's whole life, running reward calls.

    A call that runs past its timeout keeps its thread (Python cannot stop it) but is
    abandoned: its result is dropped and the thread is busy until the call returns. So a
    reward that hangs holds at most `size` threads, never more, however many steps run; once
    every thread is held by a call past its timeout, the calls still queued fail at once
    instead of waiting a timeout each. Daemon threads: a hung call never blocks exit.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.queue: deque[Callable[[], None]] = deque()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.running: dict[int, float] = {}  # thread id -> when its current call started

    def submit(self, task: Callable[[], None]) -> None:
        with self.cond:
            self.queue.append(task)
            if self.idle == 0 and len(self.threads) < self.size:
                t = threading.Thread(target=self._work, name="gspo-reward", daemon=True)
                self.threads.append(t)
                t.start()
            self.cond.notify()

    def drop_queued(self) -> int:
        """Forget the tasks no thread has started; how many there were."""
        with self.cond:
            n = len(self.queue)
            self.queue.clear()
            return n

    def _work(self) -> None:
        while True:
            with self.cond:
                self.idle += 1
                while not self.queue:
                    self.cond.wait()
                self.idle -= 1
                task = self.queue.popleft()
                self.running[threading.get_ident()] = _now()
            task()
            with self.cond:
                del self.running[threading.get_ident()]
                self.cond.notify_all()

    def all_hung(self, timeout_s: float, now: float) -> bool:
        """Whether every thread there may be is running a call started `timeout_s` ago."""
        hung = sum(1 for t in self.running.values() if now - t >= timeout_s)
        return hung >= self.size


@dataclass
class RewardScorer:
    """Scores a batch on a bounded pool of daemon threads (WorkerPool), each call bounded
    by `timeout_s` from when it starts.

    A hung reward costs one timeout per batch, not one per `parallel` items, and holds at
    most `parallel` threads for the run. `failures` counts zero scores by reason since the
    scorer was made; `last` is the latest batch's outcome, logged as one warning.
    """

    # A RewardFn, or as the flags below say: takes_item, batch, token_ids.
    fn: Callable[..., Any]
    timeout_s: float = 10.0
    require_finished: bool = False
    parallel: int = 16
    inline: bool = False  # call in this thread: for built-in functions that cannot hang
    on_failure: Callable[[str], None] | None = None
    takes_item: bool = False  # fn(item: Scored), the built-in format and length components
    batch: bool = False  # fn(items) -> list[float | None], one call per batch (TRL's functions)
    token_ids: bool = False  # fn(prompt, completion, answer, token_ids=...): it takes the ids
    name: str = "function"  # how messages name the reward (reward.function, a component's name)
    failures: dict[str, int] = field(default_factory=lambda: {"error": 0, "timeout": 0})
    last: BatchOutcome = field(default_factory=BatchOutcome)
    pool: WorkerPool | None = None

    def score_components(self, items: Sequence[Scored]) -> tuple[list[Score], dict[str, float]]:
        """The scores (per token where the function gave them), and no components (a single
        reward function)."""
        return self.scores(items), {}

    def score(self, items: Sequence[Scored]) -> list[float]:
        """One reward per item (a per-token score's mean: `sequence_reward`)."""
        return [sequence_reward(s) for s in self.scores(items)]

    def scores(self, items: Sequence[Scored]) -> list[Score]:
        self.last = BatchOutcome(calls=len(items))
        if self.batch:
            return self._warned(self._score_batch(items))
        scores: list[Score] = [0.0] * len(items)
        if self.inline:
            outcomes: dict[int, Any] = {i: self._outcome(item) for i, item in enumerate(items)}
        else:
            outcomes = self._run_pooled([partial(self._outcome, item) for item in items])
        for i in range(len(items)):
            self._check(i, outcomes.get(i), scores)
        return self._warned(scores)

    def _warned(self, scores: list[Score]) -> list[Score]:
        """`scores`, after one warning for the batch's failures, if any."""
        if self.last.failed_total:
            reasons = ", ".join(f"{n} {r}" for r, n in self.last.failed.items() if n)
            log.warning(
                "Reward: %d of %d calls failed (%s) and scored 0; first: %s",
                self.last.failed_total,
                self.last.calls,
                reasons,
                self.last.first,
            )
        return scores

    def _score_batch(self, items: Sequence[Scored]) -> list[Score]:
        """One call for the whole batch on the scorer's pool, bounded by timeout_s; a call
        that fails scores every item 0 (each counted). None, TRL's "does not apply", scores 0."""
        if not items:
            return []

        def call() -> Any:
            try:
                return self.fn(items)
            except BaseException as exc:
                return exc

        outcome = self._run_pooled([call]).get(0)
        if outcome is None:
            message = f"reward call for a batch of {len(items)} ran past {self.timeout_s}s"
            self._fail("timeout", message, len(items))
            return [0.0] * len(items)
        if isinstance(outcome, BaseException):
            message = f"reward call for a batch of {len(items)} raised {outcome!r}"
            self._fail("error", message, len(items))
            return [0.0] * len(items)
        scores: list[Score] = [0.0] * len(items)
        for i, value in enumerate(outcome):
            if value is not None:
                self._check(i, value, scores)
        return scores

    def _run_pooled(self, calls: Sequence[Callable[[], Any]]) -> dict[int, Any]:
        """Each call's outcome by index (None: timed out), on the scorer's WorkerPool, waiting
        at most `timeout_s` past the start of each call, and not at all for calls no free
        thread can take."""
        if self.pool is None:
            self.pool = WorkerPool(self.parallel)
        pool, cond = self.pool, self.pool.cond
        started: dict[int, float] = {}
        final: dict[int, Any] = {}

        def task(i: int) -> Callable[[], None]:
            def run() -> None:
                with cond:
                    if i in final:  # the batch gave up on it before a thread took it
                        return
                    started[i] = _now()
                outcome = calls[i]()
                with cond:
                    if i not in final:  # not abandoned after its timeout
                        final[i] = outcome

            return run

        with cond:
            for i in range(len(calls)):
                pool.submit(task(i))
            while len(final) < len(calls):
                now = _now()
                late = [
                    i for i, t in started.items() if i not in final and now - t >= self.timeout_s
                ]
                for i in late:
                    final[i] = None
                if pool.all_hung(self.timeout_s, now):  # nothing will take the rest
                    pool.drop_queued()
                    for i in range(len(calls)):
                        final.setdefault(i, None)
                    break
                if len(final) == len(calls):
                    break
                starts = [t for i, t in started.items() if i not in final]
                # A thread whose call is within its timeout may yet be counted hung (all_hung);
                # one already past it (an earlier batch's) is waited on by nothing.
                starts += [t for t in pool.running.values() if now - t < self.timeout_s]
                wake = min(starts) + self.timeout_s - now if starts else self.timeout_s
                cond.wait(max(0.001, wake))
        return final

    def _check(self, i: int, outcome: Score | BaseException | None, scores: list[Score]) -> None:
        if outcome is None:
            self._fail("timeout", f"reward call for item {i} ran past {self.timeout_s}s")
        elif isinstance(outcome, BaseException):
            self._fail("error", f"reward call for item {i} raised {outcome!r}")
        elif _bad(outcome):
            self._fail(
                "error", f"reward call for item {i} returned {outcome}, not a finite float32"
            )
        else:
            scores[i] = outcome

    def _outcome(self, item: Scored) -> Score | BaseException:
        """One call's score (as_score: a number, or one per response token), or what it
        raised."""
        if self.require_finished and not item.finished:
            return 0.0
        try:
            if self.takes_item:
                value = self.fn(item)
            elif self.token_ids:
                value = self.fn(item.prompt, item.completion, item.answer, token_ids=item.token_ids)
            else:
                value = self.fn(item.prompt, item.completion, item.answer)
            return as_score(value, item.tokens, self.name)
        except BaseException as exc:
            return exc

    def _fail(self, reason: str, message: str, count: int = 1) -> None:
        self.failures[reason] += count
        self.last.failed[reason] += count
        self.last.first = self.last.first or message
        if self.on_failure is not None:
            for _ in range(count):
                self.on_failure(reason)


def _now() -> float:
    import time

    return time.monotonic()


# Built-in kinds that score a response cut at maxResponseTokens 0: its final answer is not
# there (a math answer cut mid-number, or still inside the reasoning, would otherwise count).
FINISHED_ONLY = ("arithmetic", "positional", "math")


def build_scorer(
    cfg: RewardConfig,
    on_failure: Callable[[str], None] | None = None,
    max_response_tokens: int | None = None,
    per_token: bool = False,
    tokenizer: Any | None = None,
) -> RewardScorer | WeightedScorer:
    """The scorer of reward.kind, or of every reward.functions component (the length component
    needs `max_response_tokens`, algorithm.maxResponseTokens). `per_token` (lossLevel
    gspo-token): built-in kinds that can score each token (positional) do. `tokenizer` (the
    policy's): positional compares token ids rather than decoded text."""
    ids = tokenizer_answer_ids(tokenizer) if tokenizer is not None else None
    if cfg.functions is None:
        if cfg.kind == "code":
            return _code_scorer(cfg, on_failure)
        if cfg.kind == "positional":
            return _positional_scorer(per_token, ids, cfg.timeout_seconds, on_failure, "positional")
        if cfg.kind == "python" and cfg.convention != "gspo":
            kw = {"timeout_s": cfg.timeout_seconds, "on_failure": on_failure}
            return convention_scorer(reward_function(cfg), cfg.convention, **kw)
        fn = reward_function(cfg)
        return RewardScorer(
            fn,
            timeout_s=cfg.timeout_seconds,
            require_finished=cfg.kind in FINISHED_ONLY,
            inline=cfg.kind == "arithmetic",
            on_failure=on_failure,
            token_ids=takes_token_ids(fn),
            name=cfg.function or str(cfg.kind),
        )
    return WeightedScorer(
        [
            Component(
                f.name,
                f.weight,
                _component_scorer(f, cfg, on_failure, max_response_tokens, per_token, ids),
            )
            for f in cfg.functions
        ]
    )


def _positional_scorer(
    per_token: bool,
    answer_ids: AnswerIds | None,
    timeout_s: float,
    on_failure: Callable[[str], None] | None,
    name: str,
) -> RewardScorer:
    """positional_reward, scored inline (it cannot hang). A response cut at maxResponseTokens
    scores 0, as for arithmetic: with its missing EOS counted as one wrong position only, a
    probe run's policy stopped ending its answers and ran every one to the cap, where a
    rising run of digits still earned a third of the credit."""
    fn = partial(positional_reward, per_token=per_token, answer_ids=answer_ids)
    return RewardScorer(
        fn,
        timeout_s=timeout_s,
        require_finished=True,
        inline=True,
        takes_item=True,
        on_failure=on_failure,
        name=name,
    )


def _code_scorer(cfg: RewardConfig, on_failure: Callable[[str], None] | None) -> Any:
    """reward.kind code (code/runner.py): programs run in the sandbox reward.sandbox sets."""
    from gspo_trainer.code.runner import build_code_scorer

    return build_code_scorer(cfg.code, cfg.sandbox, on_failure)


def _component_scorer(
    f: RewardFunctionConfig,
    cfg: RewardConfig,
    on_failure: Callable[[str], None] | None,
    max_response_tokens: int | None,
    per_token: bool,
    answer_ids: AnswerIds | None,
) -> Any:
    if f.kind == "code":
        return _code_scorer(cfg, on_failure)
    if f.kind == "positional":
        return _positional_scorer(per_token, answer_ids, cfg.timeout_seconds, on_failure, f.name)
    kw: dict[str, Any] = dict(timeout_s=cfg.timeout_seconds, on_failure=on_failure)
    if f.kind == "format":
        return RewardScorer(
            lambda item: format_reward(item, f.pattern), inline=True, takes_item=True, **kw
        )
    if f.kind == "length":
        if max_response_tokens is None:
            raise ConfigError(
                f"reward.functions {f.name!r}: kind length needs the maximum "
                "response length (algorithm.maxResponseTokens)"
            )
        target = f.target_tokens or 0

        def length(item: Scored) -> float:
            if item.tokens is None:
                raise ValueError("the response's token count is unknown")
            return length_penalty(item.tokens, target, max_response_tokens)

        return RewardScorer(length, inline=True, takes_item=True, **kw)
    one = RewardConfig(kind=f.kind, function=f.function)
    if f.kind == "python" and f.convention != "gspo":
        return convention_scorer(reward_function(one), f.convention, **kw)
    fn = reward_function(one)
    return RewardScorer(
        fn,
        require_finished=f.kind in FINISHED_ONLY,
        inline=f.kind == "arithmetic",
        token_ids=takes_token_ids(fn),
        name=f.name,
        **kw,
    )


def convention_scorer(fn: Callable[..., Any], convention: str, **kw: Any) -> RewardScorer:
    """A scorer calling a function written for TRL (once per batch) or verl (per response)."""
    from gspo_trainer.reward_conventions import trl_batch, verl_item

    if convention == "trl":
        return RewardScorer(trl_batch(fn), batch=True, **kw)
    return RewardScorer(verl_item(fn), takes_item=True, **kw)


@dataclass(frozen=True)
class Component:
    name: str
    weight: float
    scorer: Any  # RewardScorer, or code.runner.CodeScorer


@dataclass
class WeightedScorer:
    """reward = sum(weight_i x r_i) over the components, each scored by its own RewardScorer
    (a failing call scores that component 0 and is counted; the others still count)."""

    components: list[Component]

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [sequence_reward(s) for s in self.score_components(items)[0]]

    def score_components(self, items: Sequence[Scored]) -> tuple[list[Score], dict[str, float]]:
        """The weighted rewards (per token where a component gave per-token scores: a number
        counts on every token), and each component's mean over `items` (unweighted, of each
        response's `sequence_reward`), keyed reward/<name> as in history.jsonl."""
        totals: list[Score] = [0.0] * len(items)
        means: dict[str, float] = {}
        for c in self.components:
            scores, extra = c.scorer.score_components(items)  # a code component's counts
            means.update(extra)
            totals = [_add(t, c.weight, s) for t, s in zip(totals, scores, strict=True)]
            flat = [sequence_reward(s) for s in scores]
            means[REWARD_COMPONENT_PREFIX + c.name] = sum(flat) / max(1, len(flat))
        for i, total in enumerate(totals):  # in range alone, weighted sums can still overflow
            if _bad(total):
                log.warning(
                    "Reward of item %d: the weighted sum %s is not a finite float32; scored 0",
                    i,
                    total,
                )
                totals[i] = 0.0
        return totals, means

    @property
    def last(self) -> BatchOutcome:
        """The latest batch's calls and failures, over every component."""
        out = BatchOutcome()
        for c in self.components:
            out.calls += c.scorer.last.calls
            for reason, n in c.scorer.last.failed.items():
                out.failed[reason] += n
            out.first = out.first or c.scorer.last.first
        return out

    @property
    def failures(self) -> dict[str, int]:
        out = {"error": 0, "timeout": 0}
        for c in self.components:
            for reason, n in c.scorer.failures.items():
                out[reason] += n
        return out
