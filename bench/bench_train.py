"""Steps and wall time until the mean reward reaches a target: GSPO against GRPO.

Runs `gspo train` (real vLLM rollout server, real learner) once per loss level on the same
job, seeds and machine, reads each run's history.jsonl, and reports the first step whose
trailing WINDOW-step mean reward is >= TARGET, the training wall time to that step, and the
ratio GSPO / GRPO. Both curves go into one PNG.

    python bench/bench_train.py [JOB.yaml] --max-steps 1500 --out bench/train-curves.png
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from gspo_trainer.plot import moving_average, plot_rewards, read_history  # noqa: E402


def run(config: str | None, level: str, steps: int, out: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "gspo_operator.cli", "train", *([config] if config else []),
           "--output-dir", str(out), "--max-steps", str(steps), "--loss-level", level,
           "--no-progress"]  # fmt: skip
    env = {"PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}
    import os

    start = time.monotonic()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=REPO)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # let `gspo train` stop its learner and servers itself
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    if code != 0:
        raise SystemExit(f"gspo train --loss-level {level} exited {code}")
    return read_history(out / "checkpoints" / "history.jsonl"), time.monotonic() - start


def reached(records: list[dict], target: float, window: int) -> tuple[int | None, float | None]:
    """(step, training seconds) where the trailing mean first reaches target."""
    means = moving_average([r["reward_mean"] for r in records], window)
    t0 = records[0]["time"] - records[0]["seconds"]
    for i, m in enumerate(means):
        if i + 1 >= window and m >= target:
            return int(records[i]["step"]), records[i]["time"] - t0
    return None, None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?")
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--work", default="/tmp/gspo-bench-train")
    p.add_argument("--out", default=str(REPO / "bench" / "train-curves.png"))
    args = p.parse_args()
    curves, rows = {}, []
    for level in ("gspo", "grpo"):
        records, wall = run(args.config, level, args.max_steps, Path(args.work) / level)
        step, seconds = reached(records, args.target, args.window)
        curves[level.upper()] = [(int(r["step"]), r["reward_mean"]) for r in records]
        tail = sum(r["reward_mean"] for r in records[-args.window :]) / args.window
        rows.append((level, step, seconds, wall, tail, records[-1]["seconds"]))
    plot_rewards(curves, args.out, window=args.window, target=args.target,
                 title=f"gspo train {args.config or '(tiny default)'}")  # fmt: skip
    print(f"{'level':<6} {'steps to ' + str(args.target):>14} {'train s':>8} {'run s':>7} "
          f"{'last ' + str(args.window) + ' mean':>13}")  # fmt: skip
    for level, step, seconds, wall, tail, _ in rows:
        s = "not reached" if step is None else str(step)
        t = "-" if seconds is None else f"{seconds:.0f}"
        print(f"{level:<6} {s:>14} {t:>8} {wall:>7.0f} {tail:>13.3f}")
    if rows[0][1] and rows[1][1]:
        print(f"ratio GSPO/GRPO steps to {args.target}: {rows[0][1] / rows[1][1]:.2f}")
    print(f"curves: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
