"""Training curves as PNGs: per-step mean reward (faint) and its moving average, evaluations,
and the collapse signals (entropy, zero-advantage share)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def read_history(path: str | Path) -> list[dict[str, float]]:
    """The learner's history.jsonl; a step logged twice (a resumed run) keeps its last line,
    a line a killed learner left undecodable is skipped (jsonl.read_records)."""
    from gspo_trainer.jsonl import read_records

    by_step: dict[int, dict[str, float]] = {}
    for record in read_records(Path(path)):
        if isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _save(fig: Any, out: str | Path) -> Path:
    """Lay out, write the PNG, and free the figure (pyplot keeps every open one)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(out)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_training(
    runs: Mapping[str, Sequence[Mapping[str, float]]],
    out: str | Path,
    *,
    window: int = 10,
    title: str = "GSPO training",
    target: float | None = None,
) -> Path:
    """runs: label -> history records. Two panels sharing the step axis, so a collapse shows
    beside the reward it explains. Top: mean reward per step (faint), its moving average, and
    the evaluations (eval_accuracy, greedy: dots; eval_mean_at_k: crosses), and for code rewards
    code_pass_rate (dotted). Bottom: token
    entropy (left axis) and the share of zero-advantage groups (right axis, dashed); entropy
    falling to ~0 while that share goes to 1 with a low reward is a collapse (every group
    answers alike, so no group carries a learning signal; BENCHMARKS.md's tuning table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    share_ax = bottom.twinx()
    for i, (label, records) in enumerate(runs.items()):
        if not records:
            continue
        color = f"C{i}"
        steps = [int(r["step"]) for r in records]
        rewards = [r["reward_mean"] for r in records]
        top.plot(steps, rewards, color=color, alpha=0.2, linewidth=0.8)
        top.plot(
            steps,
            moving_average(rewards, window),
            color=color,
            linewidth=1.8,
            label=f"{label} reward_mean ({window}-step mean)",
        )
        passing = [(int(r["step"]), r["code_pass_rate"]) for r in records if "code_pass_rate" in r]
        if passing:  # reward.kind code: the share of responses that passed every test
            top.plot(
                [s for s, _ in passing],
                moving_average([p for _, p in passing], window),
                color=color,
                linewidth=1.2,
                linestyle=":",
                label=f"{label} code_pass_rate ({window}-step mean)",
            )
        evals = [r for r in records if "eval_accuracy" in r]
        if evals:
            top.plot(
                [int(r["step"]) for r in evals],
                [r["eval_accuracy"] for r in evals],
                "o-",
                color=color,
                markersize=3.5,
                linewidth=1,
                label=f"{label} eval_accuracy (greedy)",
            )
            at_k = [r for r in evals if "eval_mean_at_k" in r]
            if at_k:  # algorithm.evalMeanAtK > 0
                top.plot(
                    [int(r["step"]) for r in at_k],
                    [r["eval_mean_at_k"] for r in at_k],
                    "x",
                    color=color,
                    markersize=4,
                    label=f"{label} eval_mean_at_k",
                )
        ent = [(int(r["step"]), r["entropy"]) for r in records if "entropy" in r]
        if ent:
            bottom.plot(
                [s for s, _ in ent],
                moving_average([e for _, e in ent], window),
                color=color,
                linewidth=1.5,
                label=f"{label} entropy",
            )
        zero = [
            (int(r["step"]), r["zero_advantage_fraction"])
            for r in records
            if "zero_advantage_fraction" in r
        ]
        if zero:
            share_ax.plot(
                [s for s, _ in zero],
                moving_average([z for _, z in zero], window),
                color=color,
                linewidth=1.2,
                linestyle="--",
                alpha=0.8,
                label=f"{label} zero_advantage_fraction",
            )
    if target is not None:
        top.axhline(target, color="grey", linestyle="--", linewidth=1)
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(loc="upper left", fontsize=7)
    bottom.set_xlabel("step")
    bottom.set_ylabel("entropy (nats/token)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    share_ax.set_ylabel("zero-advantage share (dashed)")
    share_ax.set_ylim(-0.02, 1.02)
    lines = bottom.get_legend_handles_labels()
    more = share_ax.get_legend_handles_labels()
    if lines[0] or more[0]:
        bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="center right", fontsize=7)
    return _save(fig, out)


def training_seconds(records: Sequence[Mapping[str, float]]) -> list[float]:
    """Each record's time since the start of the run's first step (evaluations included)."""
    if not records:
        return []
    t0 = records[0]["time"] - records[0]["seconds"]
    return [r["time"] - t0 for r in records]


def plot_accuracy_over_time(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, float]]]],
    out: str | Path,
    *,
    title: str = "Held-out accuracy against wall-clock time",
    target: float | None = None,
) -> Path:
    """runs: label -> one history per seed. Greedy eval_accuracy against the seconds since
    the first step began, one colour per label (each seed its own line), so configurations
    that differ in speed and in learning per step compare on what a user waits for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, (label, histories) in enumerate(runs.items()):
        for j, records in enumerate(histories):
            seconds = training_seconds(records)
            evals = [
                (t, r["eval_accuracy"])
                for t, r in zip(seconds, records, strict=True)
                if "eval_accuracy" in r
            ]
            if evals:
                ax.plot(
                    [t for t, _ in evals],
                    [a for _, a in evals],
                    "o-",
                    color=f"C{i}",
                    markersize=3,
                    linewidth=1.2,
                    alpha=0.9 if j == 0 else 0.5,
                    label=label if j == 0 else None,
                )
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("eval_accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, out)
