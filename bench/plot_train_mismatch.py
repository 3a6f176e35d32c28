"""One run's reward curve with its engine-learner log-prob mismatch on a log axis.

Reads the history.jsonl that `gspo train` (or bench_train.py) wrote.

    python bench/plot_train_mismatch.py /tmp/gspo-bench-train/gspo/checkpoints/history.jsonl \
        --out bench/train-curve-moe.png --title "gspo train (tiny MoE default)"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from gspo_trainer.plot import moving_average, read_history  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("history")
    p.add_argument("--out", default=str(REPO / "bench" / "train-curve-moe.png"))
    p.add_argument("--title", default="gspo train (tiny MoE default)")
    p.add_argument("--window", type=int, default=20)
    args = p.parse_args()
    # Steps that measured it: every step but where the first mini-batch's πold came from its
    # update (oldLogprobSource learner with one mini-batch) or from the engine.
    records = [r for r in read_history(args.history) if "logprob_mismatch" in r]
    steps = [int(r["step"]) for r in records]
    rewards = [r["reward_mean"] for r in records]
    mismatch = [max(r["logprob_mismatch"], 1e-9) for r in records]  # log axis: no zeros

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rewards, color="C0", alpha=0.25, linewidth=0.8)
    ax.plot(
        steps,
        moving_average(rewards, args.window),
        color="C0",
        linewidth=2,
        label=f"reward ({args.window}-step mean)",
    )
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(
        steps, mismatch, color="C3", linewidth=0.8, label="engine-learner |Δ log p| per token"
    )
    right.set_yscale("log")
    right.set_ylabel("logprob mismatch (nats/token)")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"curve: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
