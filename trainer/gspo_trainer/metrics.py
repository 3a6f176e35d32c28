"""The learner's Prometheus metrics: the names the chart's alert rules and dashboard read.

What `gspo train` shows (reward_mean, entropy, zero_advantage_fraction, eval_accuracy,
eval_mean_at_k) has one name everywhere: the key in history.jsonl and in its progress bar,
and `gspo_` + that key here, so a number seen on a laptop is found on a dashboard as is.

One registry per learner (not the process-global one) so tests and `gspo train` can run
several learners in a process. Gauges hold the last step's value; histograms the timings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gspo_api.spec import TrackerName

# Step-level values: key in the learner's per-step stats -> (metric name, help).
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "reward_mean": ("gspo_reward_mean", "Mean reward of the last step's responses."),
    "reward_std": ("gspo_reward_std", "Standard deviation of the last step's rewards."),
    "reward_failure_fraction": (
        "gspo_reward_failure_fraction",
        "Share of the last step's reward calls that failed and scored 0 (by reason: "
        "gspo_reward_failures_total).",
    ),
    "loss": ("gspo_loss", "Policy loss of the last step (mean over mini-batches)."),
    "clip_fraction": (
        "gspo_clip_fraction",
        "Share of sequences (GSPO) or tokens (GRPO) whose ratio was clipped.",
    ),
    "clip_fraction_low": ("gspo_clip_fraction_low", "Share clipped at 1 - clip low."),
    "clip_fraction_high": ("gspo_clip_fraction_high", "Share clipped at 1 + clip high."),
    "log_ratio_abs": ("gspo_log_ratio_abs", "Mean |log s_i|: how far πθ moved from πold."),
    "kl": ("gspo_kl", "KL to the reference policy (0 when the KL coefficient is 0)."),
    "entropy": ("gspo_entropy", "Mean token entropy of the sampled responses under πθ."),
    "grad_norm": ("gspo_grad_norm", "Gradient norm before clipping, last mini-batch."),
    "response_length": ("gspo_response_length_mean", "Mean response length in tokens."),
    "zero_advantage_fraction": (
        "gspo_zero_advantage_fraction",
        "Share of prompt groups with no learning signal: rewards all alike (under "
        "algorithm.tokenBaseline position, alike at every position).",
    ),
    "logprob_mismatch": (
        "gspo_logprob_mismatch",
        "Mean |log πengine - log πlearner| per token on the same weights (with collection "
        "running ahead, algorithm.maxStaleness, the engine's are a version older: it then "
        "also holds the policy's change).",
    ),
    "tokens_per_second": ("gspo_tokens_per_second", "Generated tokens per second of step time."),
    "padded_token_fraction": (
        "gspo_padded_token_fraction",
        "Share of the token positions the last step's update forwards ran that were padding "
        "(0 with learner.packSequences).",
    ),
    "routing_drift": (
        "gspo_moe_routing_drift",
        "Share of activated experts one update changed, mean over layers (MoE only; "
        "diagnostics steps, metrics.diagnosticsEverySteps).",
    ),
    "router_aux_loss": ("gspo_moe_router_aux_loss", "Router load-balancing loss (MoE only)."),
    "weight_sync_bytes": ("gspo_weight_sync_bytes", "Bytes sent by the last weight sync."),
    "staleness": (
        "gspo_staleness",
        "Policy versions between the one that sampled the last step's rollouts and the one it "
        "updated (at most algorithm.maxStaleness, plus weightSync.everySteps - 1).",
    ),
    # Off-policy only (maxStaleness > 0 or weightSync.everySteps > 1): the decoupled
    # objective's importance weights, learner recompute / sampler, before truncation.
    "importance_weight_mean": ("gspo_importance_weight_mean", "Mean importance weight."),
    "importance_weight_max": ("gspo_importance_weight_max", "Largest importance weight."),
    "importance_truncated_fraction": (
        "gspo_importance_truncated_fraction",
        "Share of responses (tokens for grpo, and gspo-token on a per-token reward) whose "
        "weight algorithm.importanceWeightCap cut.",
    ),
    # Set at each evaluation (algorithm.evalEverySteps) and held until the next.
    "eval_accuracy": (
        "gspo_eval_accuracy",
        "Share of evaluation prompts answered with full reward by greedy decoding.",
    ),
    "code_pass_rate": (
        "gspo_code_pass_rate",
        "Share of the last step's responses whose program passed every test (reward.kind code).",
    ),
    "eval_mean_at_k": (
        "gspo_eval_mean_at_k",
        "Mean reward of k = algorithm.evalMeanAtK samples per evaluation prompt at the training "
        "temperature (0 while evalMeanAtK is 0).",
    ),
}

# A reward.functions component's mean, in the step's stats and history: reward/<name>.
REWARD_COMPONENT_PREFIX = "reward/"

# reward.kind code: test cases run in the last step, by outcome (code/runner.py's OUTCOMES).
CODE_TESTS_PREFIX = "code_tests/"
CODE_OUTCOMES = (
    "passed",
    "wrong_answer",
    "timeout",
    "memory",
    "runtime_error",
    "compile_error",
    "sandbox_failure",
)

# What a step's time is spent on, in seconds: the stages of step/ under their modules' names
# (rollout: generation alone; old_policy; update; weight_sync), the scoring that follows
# generation in the rollout module (reward), a checkpoint (checkpointer.py) and the whole
# step. The history holds the first five as `<name>_seconds` and the whole step as `seconds`.
STAGES = ("rollout", "reward", "old_policy", "update", "weight_sync", "checkpoint", "step")
# Histograms learner images of an earlier release export under another name (and label:
# phase for stage, logprob for old_policy): the chart's alert rules read both while a job
# started before an upgrade runs on. {name now: name then}
EARLIER_NAMES = {"gspo_stage_seconds": "gspo_phase_seconds"}
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class LearnerMetrics:
    """Every gspo_ metric the learner exports, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step = Gauge("gspo_step", "Completed training steps.", registry=r)
        self.last_step_time = Gauge(
            "gspo_last_step_timestamp_seconds",
            "Unix time the last step ended (the start time until the first step ends).",
            registry=r,
        )
        self.policy_version = Gauge(
            "gspo_policy_version", "Weights version the rollout servers last received.", registry=r
        )
        self.loss_finite = Gauge(
            "gspo_loss_finite", "1 while the last step's loss was finite, else 0.", registry=r
        )
        self.nonfinite_steps = Counter(
            "gspo_nonfinite_loss_steps",
            "Steps skipped because the loss was not finite.",
            registry=r,
        )
        self.gauges = {
            key: Gauge(name, doc, registry=r) for key, (name, doc) in STEP_GAUGES.items()
        }
        self.expert_load = Gauge(
            "gspo_moe_expert_load",
            "Share of routed tokens each expert received in the last step (MoE only).",
            ["layer", "expert"],
            registry=r,
        )
        self.layer_routing_drift = Gauge(
            "gspo_moe_layer_routing_drift",
            "Share of a layer's activated experts one update changed, at the last diagnostics "
            "step (MoE only).",
            ["layer"],
            registry=r,
        )
        self.seconds = Histogram(
            "gspo_stage_seconds",
            "Seconds spent per stage of a step.",
            ["stage"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        for stage in STAGES:
            self.seconds.labels(stage)
        self.tokens = Counter("gspo_generated_tokens", "Tokens generated by rollouts.", registry=r)
        self.reward_failures = Counter(
            "gspo_reward_failures",
            "Responses scored 0 because the reward function raised or timed out.",
            ["reason"],
            registry=r,
        )
        for reason in ("error", "timeout"):
            self.reward_failures.labels(reason)
        self.reward_component = Gauge(
            "gspo_reward_component",
            "Mean of each reward.functions component over the last step's responses "
            "(unweighted; history key reward/<name>).",
            ["name"],
            registry=r,
        )
        self.code_tests = Counter(
            "gspo_code_tests",
            "Test cases the code reward ran, by outcome (history key code_tests/<outcome>, "
            "a count per step).",
            ["outcome"],
            registry=r,
        )
        for outcome in CODE_OUTCOMES:
            self.code_tests.labels(outcome)
        self.checkpoint_time = Gauge(
            "gspo_checkpoint_last_success_timestamp_seconds",
            "Unix time of the newest complete checkpoint (0 before the first).",
            registry=r,
        )
        self.checkpoint_every_steps = Gauge(
            "gspo_checkpoint_every_steps", "Configured steps between checkpoints.", registry=r
        )
        self.prompts_dropped = Counter(
            "gspo_prompts_dropped",
            "Prompts left out: longer than data.maxPromptTokens (at start), or refused by the "
            "rollout servers (a 400 for that prompt; logged with it).",
            ["set"],
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "gspo_checkpoint_failures", "Checkpoint writes that failed.", registry=r
        )
        self.tracker_failures = Counter(
            "gspo_tracker_failures",
            "Experiment tracker calls (start, log, finish) that failed; training went on.",
            ["tracker"],
            registry=r,
        )
        for tracker in get_args(TrackerName):
            self.tracker_failures.labels(tracker)
        self.run_start = Gauge(
            "gspo_run_start_timestamp_seconds", "Unix time this learner started.", registry=r
        )
        self.run_start.set(time.time())
        self.last_step_time.set(time.time())

    def observe_step(self, step: int, stats: Mapping[str, float]) -> None:
        """Record one finished step: STEP_GAUGES keys, and reward/<name> components; other
        keys (samples, timings) are ignored."""
        self.step.set(step)
        self.last_step_time.set(time.time())
        for key, value in stats.items():
            gauge = self.gauges.get(key)
            if gauge is not None:
                gauge.set(value)
            elif key.startswith(REWARD_COMPONENT_PREFIX):
                self.reward_component.labels(key.removeprefix(REWARD_COMPONENT_PREFIX)).set(value)
            elif key.startswith(CODE_TESTS_PREFIX):
                self.code_tests.labels(key.removeprefix(CODE_TESTS_PREFIX)).inc(value)
        loss = stats.get("loss")
        if loss is not None:
            finite = math.isfinite(loss)
            self.loss_finite.set(1.0 if finite else 0.0)
            if not finite:
                self.nonfinite_steps.inc()

    def observe_seconds(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
        self.seconds.labels(stage).observe(seconds)

    def observe_routing_drift(self, per_layer: Sequence[float]) -> None:
        for layer, share in enumerate(per_layer):
            self.layer_routing_drift.labels(str(layer)).set(share)

    def observe_expert_load(self, load: Mapping[int, list[float]]) -> None:
        """load: layer index -> share of routed tokens per expert."""
        for layer, shares in load.items():
            for expert, share in enumerate(shares):
                self.expert_load.labels(str(layer), str(expert)).set(share)
