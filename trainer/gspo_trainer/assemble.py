"""The learner's parts, built from its spec: what `Learner` runs with, and nothing it runs.

Building is done once, in an order the parts impose (the process group before any
collective, the model files on every rank before the sharded load, Routing Replay's hooks
before the engine wraps the model, the data stream before the checkpointer that saves its
position), and every choice the spec makes here is made here: which reference, which
scorer, which evaluation set. `Learner` then reads as the run and the step alone, and a
test builds the same parts a pod does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_api.spec import GSPOJobSpec
from gspo_trainer import checkpoint as ckpt
from gspo_trainer.checkpointer import Checkpointer
from gspo_trainer.data import Example, PromptStream, fit_prompts, load_eval_examples, load_examples
from gspo_trainer.draws import PromptDraws
from gspo_trainer.learner_state import LearnerState
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.ranks import Ranks, control_timeout_s, data_timeout_s
from gspo_trainer.rewards import build_scorer
from gspo_trainer.step.policy import Policy
from gspo_trainer.step.rollout import Collector, RolloutSource, RunAhead
from gspo_trainer.step.routing_replay import RoutingReplay
from gspo_trainer.step.stats import StepReport
from gspo_trainer.step.weight_sync import WeightSync
from gspo_trainer.trackers import Trackers, build_trackers

log = logging.getLogger("gspo.learner")


@dataclass
class LearnerParts:
    """Everything one rank's learner runs with. The rollout fleet is the collector's and the
    weight sync's (None on the ranks that never talk to the servers: all but rank 0). The
    parts share `state` and `draws`: replace their contents, never the objects."""

    spec: GSPOJobSpec
    metrics: LearnerMetrics
    state: LearnerState
    ranks: Ranks
    trackers: Trackers
    tokenizer: Any
    engine: Any  # DeepSpeed's engine around the policy
    reference_engine: Any  # the KL reference's own engine under ZeRO-3, else None
    policy: Policy
    collector: Collector
    run_ahead: RunAhead
    weights: WeightSync
    checkpointer: Checkpointer
    report: StepReport
    draws: PromptDraws
    eval_examples: list[Example] | None  # None: this run is not evaluated
    pad_id: int


def assemble(
    spec: GSPOJobSpec,
    rollout: RolloutSource | None,
    *,
    checkpoint_dir: str | Path | None,
    model_path: str | None = None,
    metrics: LearnerMetrics | None = None,
    history_path: str | Path | None = None,
    tracker_dir: str | Path | None = None,
) -> LearnerParts:
    """Build this rank's parts. Collective: every rank calls it, and in this order (the
    process group, the barrier after the model's download, the sharded load, DeepSpeed's
    engine and, under ZeRO-3, the reference's)."""
    from gspo_trainer import engine as eng
    from gspo_trainer.moe import moe_shape

    metrics = metrics or LearnerMetrics()
    state = LearnerState()
    # GSPOCheckpointTooOld scales its threshold by this: unset, it fell to its floor.
    metrics.checkpoint_every_steps.set(spec.checkpoint.every_steps)
    eng.init_distributed(data_timeout_s(spec))  # selects this rank's device first
    ranks = Ranks(control_timeout_s(spec))
    where = tracker_dir or checkpoint_dir
    trackers = build_trackers(spec.metrics.report_to, where, ranks.rank, metrics.tracker_failures)
    path = model_path or eng.resolve_model_path(spec)
    eng.fetch_model(spec, path)  # a Hub download, before any collective of the load
    ranks.barrier()  # on the control group: every rank has the files
    # Under ZeRO-3 loaded sharded: each rank builds and keeps only its partition.
    model, tokenizer = eng.load_model(spec, path, shard=True)
    # Routing Replay's hooks on the model's routers, which the engine runs as they are
    # (ConfigError for a model without, before the engine's set-up).
    replay = RoutingReplay(model) if spec.algorithm.routing_replay else None
    engine = eng.build_engine(spec, model)
    # The KL reference is the starting policy, frozen: loaded again from `path`, so a resume
    # (which restores the policy later) leaves it at the run's first weights. ZeRO-3:
    # sharded, in an engine of its own (kept: its hooks gather the layers); stages 0-2: a
    # whole copy on the policy's device.
    reference = reference_engine = None
    if spec.algorithm.kl_coef > 0:
        reference, reference_engine = eng.build_reference(spec, path, engine.device)
    moe = moe_shape(model.config) if spec.model.moe is not None else None
    policy = Policy(
        engine,
        moe,
        reference,
        spec.learner.pack_sequences,
        spec.model.attn_implementation,
        replay,
    )
    grpo = spec.algorithm.loss_level == "grpo" and replay is None
    if moe is not None and grpo and ranks.rank == 0:
        log.warning(
            "algorithm.lossLevel grpo on a mixture-of-experts model: token ratios swing "
            "when one update changes a token's experts, and the GSPO paper trains GRPO on "
            "MoE models only with Routing Replay (algorithm.routingReplay); gspo (or "
            "gspo-token) needs none"
        )
    scorer = build_scorer(
        spec.reward,
        on_failure=lambda r: metrics.reward_failures.labels(r).inc(),
        max_response_tokens=spec.algorithm.max_response_tokens,
        per_token=spec.algorithm.loss_level == "gspo-token",
        tokenizer=tokenizer,
    )
    collector = Collector(
        spec.algorithm,
        spec.metrics,
        rollout,  # type: ignore[arg-type]  # None only on ranks that never collect
        tokenizer,
        scorer,
        on_refused=metrics.prompts_dropped.labels("train").inc,
        max_failed_steps=spec.reward.max_failed_steps,
    )
    weights = WeightSync(
        engine,
        rollout,  # type: ignore[arg-type]  # None only on ranks that never sync
        collector.fleet_lock,
        ranks,
        metrics,
        state,
    )
    draws = prompt_draws(spec, tokenizer, metrics, state.step)
    checkpointer = Checkpointer(
        Path(checkpoint_dir) if checkpoint_dir else None,
        spec.checkpoint.keep,
        engine,
        tokenizer,
        ranks,
        metrics,
        state,
        functools.partial(trainer_state, state, draws, spec.algorithm.mini_batches),
    )
    report = StepReport(metrics, state, trackers, Path(history_path) if history_path else None)
    pad_id = tokenizer.pad_token_id
    return LearnerParts(
        spec=spec,
        metrics=metrics,
        state=state,
        ranks=ranks,
        trackers=trackers,
        tokenizer=tokenizer,
        engine=engine,
        reference_engine=reference_engine,
        policy=policy,
        collector=collector,
        run_ahead=RunAhead(collector),
        weights=weights,
        checkpointer=checkpointer,
        report=report,
        draws=draws,
        eval_examples=eval_examples(spec, tokenizer, metrics, ranks.rank),
        pad_id=tokenizer.eos_token_id if pad_id is None else pad_id,
    )


def prompt_draws(
    spec: GSPOJobSpec, tokenizer: Any, metrics: LearnerMetrics, step: int
) -> PromptDraws:
    """The training prompts that fit data.maxPromptTokens (the rest counted as dropped), in
    the shuffled order every rank draws them in."""
    examples, dropped = fit_prompts(
        load_examples(spec.data, tokenizer), tokenizer, spec.data.max_prompt_tokens
    )
    metrics.prompts_dropped.labels("train").inc(dropped)
    stream = PromptStream(examples, spec.data.shuffle_seed)
    return PromptDraws(stream, spec.algorithm.prompts_per_step, step)


def eval_examples(
    spec: GSPOJobSpec, tokenizer: Any, metrics: LearnerMetrics, rank: int
) -> list[Example] | None:
    """The held-out problems a greedy evaluation scores, when algorithm.evalEverySteps asks
    for one and the data has them (a data set of one's own needs data.evalSource)."""
    if spec.algorithm.eval_every_steps <= 0:
        return None
    examples = load_eval_examples(spec.data, tokenizer)
    if examples is None:
        if rank == 0:
            log.warning(
                "algorithm.evalEverySteps is set but data.evalSource is not: a data set of "
                "your own is evaluated only on a held-out set, so this run is not evaluated"
            )
        return None
    field = "data.evalSource" if spec.data.eval_source else "data.source"
    examples, dropped = fit_prompts(examples, tokenizer, spec.data.max_prompt_tokens, field)
    metrics.prompts_dropped.labels("eval").inc(dropped)
    return examples


def trainer_state(state: LearnerState, draws: PromptDraws, mini_batches: int) -> dict[str, Any]:
    """What a checkpoint keeps beside the engine: the data position is the one after the
    last trained step's draw (prompts drawn ahead for run-ahead collection are drawn again
    on resume); the mini-batches a step made, which the lr schedule's position counts in."""
    return {
        "step": state.step,
        "data": draws.position(state.step),
        "rng": ckpt.rng_state(),
        "policy_version": state.policy_version,
        "mini_batches": mini_batches,
    }
