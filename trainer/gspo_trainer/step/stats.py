"""Stats: one step's numbers under one name each, the same in the history (JSON lines), the
trackers, Prometheus (metrics.STEP_GAUGES, and gspo_stage_seconds by metrics.STAGES) and the
log line. Rank-local numbers are averaged over the ranks (maxima: their largest) first."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gspo_trainer.jsonl import append_record
from gspo_trainer.learner_state import LearnerState
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.ranks import Ranks
from gspo_trainer.samples import format_samples
from gspo_trainer.step.old_policy import OldPolicy
from gspo_trainer.step.update import UpdateStats

log = logging.getLogger("gspo.learner")


def learner_stats(
    update: UpdateStats, old: OldPolicy, mini_batches: int, ranks: Ranks
) -> dict[str, float]:
    """The loss, clip, entropy, mismatch and drift numbers, over every rank's rows (mismatch
    and drift only when measured: every rank measures on the same steps), and
    padded_token_fraction: the share of the token positions the updates' forwards ran, over
    every rank, that were padding (0 when packed, learner.packSequences)."""
    local = update.local(mini_batches)
    if old.mismatch is not None:
        local["logprob_mismatch"] = old.mismatch
    if update.drift is not None:
        local["routing_drift"] = sum(update.drift) / len(update.drift)
    local["_positions"], local["_padding"] = update.positions, update.positions - update.tokens
    stats = ranks.mean(local)
    positions, padding = stats.pop("_positions"), stats.pop("_padding")
    stats["padded_token_fraction"] = padding / positions if positions else 0.0
    stats.update(ranks.maximum(update.maxima))
    if update.grad_norm is not None:
        stats["grad_norm"] = update.grad_norm
    return stats


class StepReport:
    """Rank 0 records a finished step: Prometheus, history file, trackers, one log line."""

    def __init__(
        self, metrics: LearnerMetrics, state: LearnerState, trackers: Any, history_path: Path | None
    ) -> None:
        self.metrics, self.state, self.trackers = metrics, state, trackers
        self.history_path = history_path
        if history_path is not None:
            history_path.parent.mkdir(parents=True, exist_ok=True)

    def record(
        self,
        step: int,
        stats: dict[str, Any],
        seconds: dict[str, float],
        tokens: float,
        expert_load: dict[int, list[float]] | None,
        drift: list[float] | None,
    ) -> None:
        """`seconds` by metrics.STAGES name ("step": the whole step, evaluation apart); drift:
        rank 0's per-layer routing drift, when measured."""
        self.metrics.observe_step(step, stats)
        self.metrics.tokens.inc(tokens)
        for stage, value in seconds.items():
            if stage != "weight_sync":  # observed by WeightSync, for every sync
                self.metrics.observe_seconds(stage, value)
        if expert_load is not None:
            self.metrics.observe_expert_load(expert_load)
        if drift is not None:
            self.metrics.observe_routing_drift(drift)
        record = {
            "step": step,
            "seconds": seconds["step"],
            "time": time.time(),
            **stats,
            **{f"{k}_seconds": v for k, v in seconds.items() if k != "step"},
        }
        self.state.history.append(record)
        if self.history_path is not None:
            append_record(self.history_path, record)
        self.trackers.log(step, record)
        mismatch, mean_drift = stats.get("logprob_mismatch"), stats.get("routing_drift")
        log.info(
            "step %d reward %.3f clip %.4f |log s| %.2e entropy %.3f len %.1f "
            "mismatch %s drift %s %.2fs",
            step,
            stats["reward_mean"],
            stats["clip_fraction"],
            stats["log_ratio_abs"],
            stats.get("entropy", 0.0),
            stats["response_length"],
            f"{mismatch:.2e}" if mismatch is not None else "-",
            f"{mean_drift:.3f}" if mean_drift is not None else "-",
            seconds["step"],
        )
        if "samples" in stats:
            log.info("%s", format_samples(step, stats["samples"]))
