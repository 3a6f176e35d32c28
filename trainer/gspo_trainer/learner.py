"""The GSPO learner: it runs the step's stages in order, rollout -> plan -> old_policy (πold) ->
update -> weight_sync -> stats (each in `step/`, its module and its timing named alike), and
the run around them: resume, checkpoints, export.

Every rank runs the same loop. Rank 0 alone talks to the rollout fleet and scores rewards,
then broadcasts the batch; each rank takes an equal share of every mini-batch, and DeepSpeed
averages the gradients, so the update is the mean over the whole mini-batch whatever the
number of ranks. Departures from the paper: πold is the learner's own recompute by default
(the engine's log-probs are measured against it and reported as the mismatch); a step's
responses form `miniBatches` contiguous mini-batches, one optimizer update each; with
algorithm.maxStaleness > 0 rank 0 collects the next steps' rollouts while this one updates,
and the objective is the decoupled one (loss.py), which corrects for the lag.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gspo_api import ports
from gspo_api.progress import LearnerProgress
from gspo_api.spec import GSPOJobSpec
from gspo_trainer import device
from gspo_trainer.assemble import LearnerParts, assemble
from gspo_trainer.engine import apply_optimizer_settings, resumed_updates
from gspo_trainer.learner_state import unless_stopped
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.samples import pick_samples
from gspo_trainer.step.batch import Packed, pack
from gspo_trainer.step.old_policy import OldPolicy, old_policy
from gspo_trainer.step.plan import plan_step
from gspo_trainer.step.rollout import Rollouts, RolloutSource
from gspo_trainer.step.stats import learner_stats
from gspo_trainer.step.update import UpdateStats, update

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gspo.learner")
T = TypeVar("T")


class _Stopping(Exception):
    """Every rank agreed to stop (SIGTERM) mid-step: a final checkpoint, then exit 143."""


@dataclass
class Learned:
    """What the engine work of a step hands to its stats."""

    old: OldPolicy
    update: UpdateStats
    seconds: dict[str, float]  # "old_policy", "update"


class Learner:
    """One rank's run and step, over the parts `assemble` built (`Learner.build` does both)."""

    def __init__(self, parts: LearnerParts) -> None:
        self.spec, self.metrics, self.state = parts.spec, parts.metrics, parts.state
        self.ranks, self.rank, self.trackers = parts.ranks, parts.ranks.rank, parts.trackers
        self.tokenizer, self.pad_id = parts.tokenizer, parts.pad_id
        self.engine, self.reference_engine = parts.engine, parts.reference_engine
        self.policy, self.collector = parts.policy, parts.collector
        self.run_ahead, self.weights = parts.run_ahead, parts.weights
        self.checkpointer, self.report = parts.checkpointer, parts.report
        self.draws, self.eval_examples = parts.draws, parts.eval_examples
        self.warned_token_rewards = False  # per-token rewards under a per-response lossLevel
        self.warned_token_baseline = False  # tokenBaseline position, one reward per response

    @classmethod
    def build(
        cls,
        spec: GSPOJobSpec,
        rollout: RolloutSource | None,
        *,
        checkpoint_dir: str | Path | None,
        model_path: str | None = None,
        metrics: LearnerMetrics | None = None,
        history_path: str | Path | None = None,
        tracker_dir: str | Path | None = None,
    ) -> Learner:
        """This rank's learner for `spec` (collective: see assemble)."""
        return cls(
            assemble(
                spec,
                rollout,
                checkpoint_dir=checkpoint_dir,
                model_path=model_path,
                metrics=metrics,
                history_path=history_path,
                tracker_dir=tracker_dir,
            )
        )

    @property
    def rollout(self) -> RolloutSource | None:
        """The rollout fleet (or source) the collector generates with and the sync updates."""
        return self.collector.rollout

    @rollout.setter
    def rollout(self, value: RolloutSource) -> None:
        self.collector.rollout = self.weights.rollout = value

    # --- progress ------------------------------------------------------------------------

    def progress(self) -> LearnerProgress:
        s = self.state
        return LearnerProgress(
            phase=s.phase,
            step=s.step,
            max_steps=self.spec.algorithm.max_steps,
            reward=s.reward,
            last_checkpoint=s.last_checkpoint,
            last_checkpoint_step=s.last_checkpoint_step,
            policy_version=s.policy_version,
            message=s.message,
            server_versions=self.rollout.server_versions() if self.rollout is not None else {},
        )

    # --- the run -------------------------------------------------------------------------

    async def run(self) -> int:
        """Resume, sync, train to maxSteps (or until asked to stop), checkpoint, export; the
        trackers (rank 0) see the whole run, however it ends."""
        self.trackers.start(self.spec.to_manifest_dict())
        try:
            return await self._run()
        finally:
            self.trackers.finish(self.state.phase)

    async def _run(self) -> int:
        alg = self.spec.algorithm
        started_at = self.resume()
        self.state.phase = "Running"
        try:
            await self._await_fleet(starting=True)  # servers load the model meanwhile
            await self.sync(self.state.step)
            while self.state.step < alg.max_steps:
                # A stop is agreed at the start of each step, in _await_fleet (raises _Stopping).
                await self.train_step(self.state.step + 1)
                every = self.spec.checkpoint.every_steps
                # after a failed checkpoint, try again at the next step, not an interval on
                due = self.state.step % every == 0 or self.checkpointer.failures > 0
                if due and self.state.step < alg.max_steps:
                    self.checkpointer.checkpoint()
        except _Stopping:
            await self.run_ahead.cancel()  # collected again on resume
            self.state.phase = "Suspending"
            if self.state.step == started_at:
                # Stopped while starting: the checkpoint it resumed from (or the model) holds
                # this state, and a full save of it can outlast the stop's grace period.
                log.info("Stopped at step %d before training a step", self.state.step)
                return 0
            self.checkpointer.checkpoint(final=True)
            log.info("Stopped at step %d after a final checkpoint", self.state.step)
            return 0
        finally:
            await self.run_ahead.cancel()
        if self.state.last_checkpoint_step != self.state.step:  # not when resumed at the end
            self.checkpointer.checkpoint(final=True)
        if self.spec.checkpoint.export_hf:  # in shards of a sync bucket, a layer at a time
            self.checkpointer.export(self.spec.weight_sync.bucket_size_mb * 2**20)
        self.state.phase = "Succeeded"
        return 0

    def resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the step resumed at."""
        state = self.checkpointer.resume()
        if state is not None:
            self.draws.resume(state["data"], self.state.step)
            updates = resumed_updates(
                self.state.step,
                self.spec.algorithm.mini_batches,
                self.checkpointer.schedule_position,
                state.get("mini_batches"),
            )
            apply_optimizer_settings(self.engine, self.spec, updates)
        return self.state.step

    async def _await_fleet(self, *, starting: bool = False) -> None:
        """Every rank: wait until a rollout server can serve. Starting, that is any server that
        answers (it gets the weights next; pods start together and vLLM may take as long as
        its startup probe allows to load); later, one holding the current policy: servers
        that appeared or came back are synced, for up to rollout.requestTimeoutSeconds."""
        limit_s = (
            ports.ROLLOUT_STARTUP_SECONDS if starting else self.spec.rollout.request_timeout_seconds
        )
        waited_s, delay_s = 0.0, 0.5
        fleet = self.rollout if self.rank == 0 else None  # rank 0 alone talks to the servers
        any_rank = self.ranks.any
        while True:
            if any_rank(self.state.stop_requested):  # suspended: the servers stop too
                raise _Stopping
            added = await self._discovered()
            ready, stale = (await fleet.fleet_state()) if fleet is not None else (1, 0)
            if not starting and any_rank(added or stale > 0):
                await self.sync(self.state.policy_version)
                if fleet is not None:
                    ready, stale = await fleet.fleet_state()
            short = ready + stale == 0 if starting else ready == 0
            if not any_rank(short):
                return
            if waited_s >= limit_s:
                raise RuntimeError(
                    f"no rollout server could serve policy version {self.state.policy_version} "
                    f"for {waited_s:.0f} s"
                )
            if waited_s == 0:  # at the start, the servers are still loading: expected
                log.log(
                    logging.INFO if starting else logging.WARNING,
                    "No rollout server can serve yet; waiting up to %.0f s",
                    limit_s,
                )
            await asyncio.sleep(delay_s)
            # Starting, a probe every 2 s at most: the first step waits on the servers' load,
            # not on the back-off (a refused connection costs nothing).
            waited_s, delay_s = waited_s + delay_s, min(delay_s * 2, 2.0 if starting else 10.0)

    async def _discovered(self) -> bool:
        """Rank 0 re-resolves the fleet; True on every rank when servers were added."""
        added = False
        if self.rank == 0 and self.rollout is not None:
            added = bool(await self.rollout.discover())
        return self.ranks.any(added)

    async def sync(self, version: int, *, final: bool = False) -> float:
        """Push the policy to the rollout servers as `version` (see step/weight_sync.py)."""
        return await self.weights.push(version, final=final)

    def eval_due(self, step: int) -> bool:
        """Evaluate at every evalEverySteps-th step and after the last (so a run always ends
        with its final accuracy)."""
        every = self.spec.algorithm.eval_every_steps
        if every <= 0 or self.eval_examples is None:
            return False
        return step % every == 0 or step == self.spec.algorithm.max_steps

    # --- one step ------------------------------------------------------------------------

    async def train_step(self, step: int) -> dict[str, float]:
        """One step: rollout -> plan -> old_policy -> update -> weight_sync -> stats (step/)."""
        alg, t_step = self.spec.algorithm, time.perf_counter()
        # --- rollout (rank 0, or taken from the run-ahead); every rank gets it ----------
        rollouts = await self._rollouts(step)
        self._start_run_ahead(step)
        packed = pack(
            rollouts.prompts,
            rollouts.responses,
            rollouts.engine_logps,
            rollouts.rewards,
            alg.group_size,
            self.pad_id,
            rollouts.token_rewards,
        )
        packed = packed.to(self.policy.device)  # the engine's (cuda:local_rank on GPUs)
        advantages, adv_stats = self._advantages(packed)
        # --- plan, old_policy, updates, routing drift: off the loop when it overlaps ----
        every = self.spec.metrics.diagnostics_every_steps
        diagnose = every > 0 and (step == 1 or step % every == 0)
        learned = await self._off_loop(lambda: self._learn(packed, advantages, diagnose))
        # --- weight_sync; an evaluation reads the servers' weights, so it syncs first ---
        t_sync, sent = time.perf_counter(), None
        evaluating = self.eval_due(step)
        if step % self.spec.weight_sync.every_steps == 0 or evaluating:
            sent = await self.sync(step, final=evaluating and step == alg.max_steps)
        seconds = {
            **rollouts.seconds,
            **learned.seconds,
            "weight_sync": time.perf_counter() - t_sync,
        }
        evaluation = {}
        # Only on the step's weights: not when stopping skipped the sync (learner_state.py).
        synced = self.state.policy_version == step
        if evaluating and self.rank == 0 and self.eval_examples is not None and synced:
            evaluation = await self.collector.evaluate(step, self.eval_examples)
        # --- stats: averaged over ranks, recorded by rank 0 -----------------------------
        # The step's own time: an evaluation is reported apart (eval_seconds).
        seconds["step"] = time.perf_counter() - t_step - evaluation.get("eval_seconds", 0.0)
        stats = self._stats(step, rollouts, packed, advantages, adv_stats, learned, seconds)
        if sent is not None:
            stats["weight_sync_bytes"] = sent
        stats.update(evaluation)  # rank 0 only, like the history and the metrics
        self.state.step, self.state.reward = step, stats["reward_mean"]
        self.draws.trained(step)
        if self.rank == 0:
            self.report.record(
                step,
                stats,
                seconds,
                float(packed.lengths.sum()),
                self._expert_load(learned.old.experts or learned.update.experts),
                learned.update.drift,
            )
        return stats

    def _advantages(self, packed: Packed) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per token (N, L-1) under lossLevel gspo-token when the reward scored per token,
        else one per response (N,) from each response's reward: gspo's and grpo's objectives
        as the paper defines them (Eq. 5, Eq. 2) give every token of a response its
        advantage, so per-token rewards count there by their mean (said once, in the log)."""
        from gspo_trainer.advantages import group_advantages, token_group_advantages

        alg, scale = self.spec.algorithm, self.spec.algorithm.scale_rewards
        if packed.token_rewards is None:
            if alg.token_baseline == "position" and self.rank == 0:
                if not self.warned_token_baseline:
                    log.warning(
                        "algorithm.tokenBaseline position compares per-token rewards, but "
                        "the reward scored each response with one number: its advantage is "
                        "against the group's mean; return one score per token (reward.kind "
                        "positional, or a python reward's list) or set tokenBaseline to group"
                    )
                self.warned_token_baseline = True
            return group_advantages(packed.rewards, alg.group_size, scale=scale)
        if alg.loss_level == "gspo-token":
            return token_group_advantages(
                packed.token_rewards,
                packed.mask,
                alg.group_size,
                scale=scale,
                baseline=alg.token_baseline,
            )
        if self.rank == 0 and not self.warned_token_rewards:
            log.warning(
                "The reward scores each response token, but algorithm.lossLevel %s "
                "takes one advantage per response: each response's reward is the mean "
                "of its token scores; set spec.algorithm.lossLevel to gspo-token to "
                "train on them token by token",
                alg.loss_level,
            )
            self.warned_token_rewards = True
        return group_advantages(packed.rewards, alg.group_size, scale=scale)

    def _stats(
        self,
        step: int,
        rollouts: Rollouts,
        packed: Packed,
        advantages: torch.Tensor,
        adv_stats: dict[str, torch.Tensor],
        learned: Learned,
        seconds: dict[str, float],
    ) -> dict[str, Any]:
        """The step's numbers, one name each (metrics.STEP_GAUGES)."""
        from gspo_trainer.advantages import response_advantages

        alg = self.spec.algorithm
        stats: dict[str, Any] = learner_stats(
            learned.update, learned.old, alg.mini_batches, self.ranks
        )
        stats.update(
            reward_mean=float(adv_stats["reward_mean"]),
            reward_std=float(adv_stats["reward_std"]),
            zero_advantage_fraction=float(adv_stats["zero_advantage_fraction"]),
            response_length=float(packed.lengths.mean()),
            tokens_per_second=float(packed.lengths.sum()) / seconds["step"],
            staleness=float(step - 1 - rollouts.policy_version),
            reward_failure_fraction=rollouts.reward_failure_fraction,
        )
        stats.update(rollouts.reward_components)
        if rollouts.texts is not None:  # samples.py; trackers read stats["samples"]
            per_response = response_advantages(advantages, packed.mask).tolist()
            stats["samples"] = pick_samples(
                *rollouts.texts,
                packed.rewards.tolist(),
                per_response,
                alg.group_size,
                self.spec.metrics.samples_per_log,
            )
        return stats

    async def _rollouts(self, step: int) -> Rollouts:
        """Every rank: the step's rollouts, from rank 0 (its run-ahead's, or collected now).
        A server that appeared gets the current weights first; with none left to serve,
        every rank waits for one to return (and syncs it) and rank 0 collects again."""
        self.draws.until(step)
        while True:
            await self._await_fleet()
            got = None
            if self.rank == 0:
                batch = self.draws.batch(step)  # cancelled: collected again on resume
                got = await unless_stopped(self.state, self.run_ahead.take(step, batch))
            rollouts = self.ranks.broadcast(got)
            if rollouts is not None:
                self.draws.collected(step)
                return rollouts

    def _start_run_ahead(self, step: int) -> None:
        """Rank 0 starts collecting the next maxStaleness steps (every rank draws their
        prompts, so the data stream stays the same everywhere)."""
        last = min(step + self.spec.algorithm.max_staleness, self.spec.algorithm.max_steps)
        self.draws.until(last)
        if self.rank == 0:
            for ahead in range(step + 1, last + 1):
                self.run_ahead.start(ahead, self.draws.batch(ahead))

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """`work` in a thread when collection overlaps it (the event loop runs the run-ahead
        meanwhile), else here, as a synchronous step always ran. The thread works on this
        rank's device (a new thread starts on GPU 0)."""
        if self.spec.algorithm.max_staleness > 0:
            return await device.to_thread(work)
        return work()

    def _learn(self, packed: Packed, advantages: torch.Tensor, diagnose: bool) -> Learned:
        """πold (and the reference), the updates, and on a diagnostics step the learner's own
        log-probs and routing drift: every rank, its rows."""
        alg, moe = self.spec.algorithm, self.spec.model.moe
        t0 = time.perf_counter()
        plan = plan_step(
            packed,
            alg.mini_batches,
            self.spec.learner.micro_batch_tokens,
            self.ranks,
            pack=self.policy.packs(),
        )
        old = old_policy(self.policy, packed, plan, alg, diagnose=diagnose)
        t1 = time.perf_counter()
        behaviour = alg.max_staleness > 0 or self.spec.weight_sync.every_steps > 1
        aux_coef = moe.router_aux_loss_coef if moe else 0.0
        stats = update(
            self.policy,
            packed,
            plan,
            old,
            advantages,
            alg,
            aux_coef=aux_coef,
            behaviour=behaviour,
            diagnose=diagnose,
        )
        return Learned(old, stats, {"old_policy": t1 - t0, "update": time.perf_counter() - t1})

    def _expert_load(self, experts: list[torch.Tensor]) -> dict[int, list[float]] | None:
        """Each expert's share of the first mini-batch's routing (model.moe.reportExpertLoad),
        from whichever forward ran first on it (πold's, or its update's standing in)."""
        from gspo_trainer.moe import expert_load

        moe = self.spec.model.moe
        if not experts or self.policy.moe is None or not (moe and moe.report_expert_load):
            return None
        return expert_load(experts, self.policy.moe.experts)
