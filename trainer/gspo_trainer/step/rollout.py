"""Rollout (rank 0): prompts -> rollouts tagged with the policy version that sampled them ->
rewards. Touches no engine, so it can run while the update does (algorithm.maxStaleness).

One lock orders everything that talks to the rollout fleet's weights: a generation and a
weight sync never overlap, so no rollout mixes two policy versions, whatever runs ahead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gspo_api.spec import AlgorithmConfig, MetricsConfig
from gspo_trainer.rewards import (
    RewardFailed,
    RewardScorer,
    Scored,
    WeightedScorer,
    sequence_reward,
    token_rewards,
)
from gspo_trainer.rollout.client import RequestRefused, RolloutError
from gspo_trainer.rollout.types import Completion, RolloutBatch, SamplingParams, step_seed
from gspo_trainer.samples import samples_due

log = logging.getLogger("gspo.learner")


class RolloutSource(Protocol):
    """What the learner needs from rollouts: the fleet of servers (`FleetDiscovery` over
    `RolloutClient` in production; `LocalRollout`, one in-process policy, in tests)."""

    async def generate(self, prompts: Any, params: SamplingParams) -> RolloutBatch: ...

    async def sync_weights(self, named_tensors: Any, version: int) -> Any: ...

    async def fleet_state(self) -> tuple[int, int]:
        """(servers that can serve the current version, live servers that need a sync)."""
        ...

    def server_versions(self) -> dict[str, int | None]:
        """The policy version each server last reported, by URL (None: not synced yet)."""
        ...

    async def discover(self) -> list[str]:
        """Re-resolve the fleet's address; the URLs of servers that appeared."""
        ...


@dataclass(frozen=True)
class Rollouts:
    """One step's rollouts and rewards, what every rank needs of them (rank 0 broadcasts)."""

    step: int
    prompts: list[list[int]]  # token ids, one per prompt
    responses: list[list[int]]  # G per prompt, groups contiguous
    engine_logps: list[list[float]]  # the sampler's log-prob of each response token
    rewards: list[float]  # one per response (a per-token reward's mean over its tokens)
    reward_components: dict[str, float]  # reward/<name>: each function's mean
    texts: tuple[list[str], list[str]] | None  # (prompts, completions) when samples are due
    policy_version: int  # the oldest version among the servers that sampled them
    seconds: dict[str, float]  # "rollout", "reward"
    reward_failure_fraction: float = 0.0  # share of the step's reward calls that failed
    # One score per response token, for every response, when the reward gave any per-token
    # scores (a number is repeated over its response's tokens); None when it gave none.
    token_rewards: list[list[float]] | None = None


class Collector:
    def __init__(
        self,
        alg: AlgorithmConfig,
        metrics: MetricsConfig,
        rollout: RolloutSource,
        tokenizer: Any,
        scorer: RewardScorer | WeightedScorer,
        on_refused: Callable[[], None] = lambda: None,
        max_failed_steps: int = 0,
    ) -> None:
        self.alg, self.metrics = alg, metrics
        self.max_failed_steps = max_failed_steps  # reward.maxFailedSteps (0: never stop)
        self.failed_steps = 0  # steps in a row whose every reward call failed
        self.rollout, self.tokenizer, self.scorer = rollout, tokenizer, scorer
        self.on_refused = on_refused  # counts each prompt the servers refused
        self.fleet_lock = asyncio.Lock()  # held by each generation and each weight sync

    def sampling(self, step: int) -> SamplingParams:
        """Sampling of step `step`, seeded from (algorithm.seed, step): sample j of prompt i
        draws with its own seed (SamplingParams.seed), so a run is repeatable and every
        sample of a batch has a stream of its own (one seed shared by every prompt's request
        would draw every prompt's samples from one random stream)."""
        alg = self.alg
        return SamplingParams(
            n=alg.group_size,
            max_tokens=alg.max_response_tokens,
            temperature=alg.temperature,
            top_p=alg.top_p,
            top_k=-1,
            seed=step_seed(alg.seed, step),
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )

    def prompt_ids(self, examples: list[Any]) -> list[list[int]]:
        """The prompts' token ids as the rollout servers get them (no special tokens added;
        data.fit_prompts counts them the same way)."""
        return [self.tokenizer(e.prompt, add_special_tokens=False).input_ids for e in examples]

    def scored(self, examples: list[Any], completions: list[Completion]) -> list[Scored]:
        """What the reward sees of each completion: its prompt, decoded text, reference
        answer, whether it ended with EOS, its length in tokens, and for TRL's and verl's
        reward functions its tokens, the prompt as the row had it and the row."""
        out = []
        for c in completions:
            e = examples[c.prompt_index]
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            finished = c.finish_reason == "stop"
            out.append(
                Scored(
                    e.prompt,
                    text,
                    e.answer,
                    finished,
                    len(c.token_ids),
                    c.token_ids,
                    e.source_prompt,
                    e.row,
                )
            )
        return out

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        async with self.fleet_lock:
            return await self.rollout.generate(prompts, params)

    async def collect(self, step: int, examples: list[Any]) -> Rollouts | None:
        """The step's rollouts and rewards; None when no rollout server was left to serve.
        A prompt the servers refuse (400: too long for the model, say) is dropped from the
        step, logged and counted, and the rest are generated again; drawn again, it would be
        refused again, so retrying it would stall the run."""
        examples = list(examples)
        prompts = self.prompt_ids(examples)
        t0 = time.perf_counter()
        while True:
            try:
                batch = await self.generate(prompts, self.sampling(step))
                break
            except RequestRefused as exc:
                at = exc.prompt_index
                if at is None or not 0 <= at < len(prompts) or len(prompts) == 1:
                    raise RuntimeError(
                        f"step {step}: the rollout servers refused the request: {exc}"
                    ) from exc
                log.error(
                    "Step %d: dropped prompt %r, which the rollout servers refuse: %s",
                    step,
                    examples[at].prompt,
                    exc,
                )
                self.on_refused()
                del examples[at], prompts[at]
            except RolloutError as exc:
                log.warning("Step %d: %s; waiting for a rollout server", step, exc)
                return None
        t1 = time.perf_counter()
        completions = [c for group in batch.groups for c in group]
        scored = self.scored(examples, completions)
        scores, components = self.scorer.score_components(scored)  # components: reward/<name>
        failed = self.reward_failures(step)
        due = samples_due(step, self.metrics.samples_every_steps)
        return Rollouts(
            step=step,
            prompts=prompts,
            responses=[c.token_ids for c in completions],
            engine_logps=[c.logprobs for c in completions],
            rewards=[sequence_reward(s) for s in scores],
            reward_components=components,
            texts=([s.prompt for s in scored], [s.completion for s in scored]) if due else None,
            policy_version=min(c.policy_version for c in completions),
            seconds={"rollout": t1 - t0, "reward": time.perf_counter() - t1},
            reward_failure_fraction=failed,
            token_rewards=token_rewards(scores, [len(c.token_ids) for c in completions]),
        )

    def reward_failures(self, step: int) -> float:
        """The share of the step's reward calls that failed; RewardFailed once every call
        failed in reward.maxFailedSteps steps in a row."""
        outcome = self.scorer.last
        fraction = outcome.failed_total / outcome.calls if outcome.calls else 0.0
        self.failed_steps = self.failed_steps + 1 if fraction == 1.0 else 0
        if self.max_failed_steps and self.failed_steps >= self.max_failed_steps:
            raise RewardFailed(
                f"every reward call failed in {self.failed_steps} steps in a row (step {step}: "
                f"{outcome.failed_total} of {outcome.calls}; first: {outcome.first}); fix the "
                "reward function, or raise reward.maxFailedSteps (0: never stop)"
            )
        return fraction

    async def evaluate(self, step: int, examples: list[Any]) -> dict[str, float]:
        """The policy the rollout servers hold on the evaluation set, through the same engine
        as the rollouts: `eval_accuracy`, the share of prompts whose greedy answer
        (temperature 0) scores full reward, and with algorithm.evalMeanAtK = k > 0
        `eval_mean_at_k`, the mean reward of k samples per prompt at the training temperature
        (what training sees, without its prompt order). {} when no server could serve
        (logged; training goes on)."""
        alg = self.alg
        prompts = self.prompt_ids(examples)
        passes = {
            "greedy": SamplingParams(
                n=1,
                max_tokens=alg.max_response_tokens,
                temperature=0.0,
                stop_token_ids=(self.tokenizer.eos_token_id,),
            )
        }
        if alg.eval_mean_at_k > 0:
            passes["sampled"] = replace(
                self.sampling(step), n=alg.eval_mean_at_k, seed=step_seed(alg.seed, step, "eval")
            )
        t0 = time.perf_counter()
        scores: dict[str, list[float]] = {}
        try:
            for name, params in passes.items():
                batch = await self.generate(prompts, params)
                completions = [c for group in batch.groups for c in group]
                scores[name] = self.scorer.score(self.scored(examples, completions))
        except RolloutError as exc:
            log.warning("Step %d: evaluation skipped: %s", step, exc)
            return {}
        greedy = scores["greedy"]
        out = {"eval_accuracy": sum(r >= 1.0 for r in greedy) / len(greedy)}
        if "sampled" in scores:
            out["eval_mean_at_k"] = sum(scores["sampled"]) / len(scores["sampled"])
        out["eval_seconds"] = time.perf_counter() - t0
        return out


class RunAhead:
    """Rank 0's collections of the steps after the current one, started while it updates:
    at most algorithm.maxStaleness of them, so a rollout is at most that many policy versions
    older than the update it feeds (the fleet lock runs them one after another, each with
    the weights the servers hold when it starts)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.tasks: dict[int, asyncio.Task[Rollouts | None]] = {}

    def start(self, step: int, examples: list[Any]) -> None:
        if step not in self.tasks:
            self.tasks[step] = asyncio.create_task(self.collector.collect(step, examples))

    async def take(self, step: int, examples: list[Any]) -> Rollouts | None:
        """The step's rollouts: the run-ahead collection's, else collected now."""
        task = self.tasks.pop(step, None)
        if task is None:
            return await self.collector.collect(step, examples)
        return await task

    async def cancel(self) -> None:
        tasks, self.tasks = list(self.tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
