"""Reward curves as a PNG: each run's per-step mean reward, faint, and its moving average."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path


def read_history(path: str | Path) -> list[dict[str, float]]:
    """The learner's history.jsonl; a step logged twice (a resumed run) keeps its last line."""
    by_step: dict[int, dict[str, float]] = {}
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record["step"])] = record
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


def plot_rewards(
    curves: Mapping[str, Sequence[tuple[int, float]]],
    out: str | Path,
    *,
    window: int = 10,
    title: str = "Mean reward per step",
    target: float | None = None,
) -> Path:
    """curves: label -> [(step, reward)]. Writes `out` (PNG) and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, (label, points) in enumerate(curves.items()):
        if not points:
            continue
        steps = [s for s, _ in points]
        rewards = [r for _, r in points]
        color = f"C{i}"
        ax.plot(steps, rewards, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_average(rewards, window), color=color, linewidth=2,
                label=f"{label} ({window}-step mean)")  # fmt: skip
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path)
    plt.close(fig)
    return path
