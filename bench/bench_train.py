"""Steps and seconds until the greedy evaluation accuracy reaches a target: GSPO and GRPO.

Runs `gspo train` (real vLLM rollout server, real learner) once per loss level and seed on
the same job and machine, reads each run's history.jsonl, and reports per seed the first
evaluation whose `eval_accuracy` (greedy, on the job's evaluation set: all 100 problems of
the built-in task) is >= TARGET, the training seconds to it (from the start of the first
step), the command's wall time and the final accuracy; then the median and the worst seed of
each level. Evaluation, not the training reward, decides: a 16-prompt step's mean reward is
noisy and can cross 0.9 by luck (one seed's mean reward crossed 0.9 at step 1,479 and sank
back to 0.87: BENCHMARKS.md). The job needs algorithm.evalEverySteps > 0 (the embedded
default has it); the resolution of "steps to target" is that interval.

    python bench/bench_train.py [JOB.yaml] --seeds 5 [--levels gspo grpo] [--max-steps N]
                                [--parallel 2]

`--parallel 2` runs two at a time, each pinned to its own core (rollout server and learner
sharing it, as in BENCHMARKS.md's tuning table); the default runs one at a time, unpinned.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from gspo_trainer.plot import plot_training, read_history  # noqa: E402


@dataclass
class Result:
    level: str
    seed: int
    step: int | None  # first evaluated step at or above the target; None: never
    seconds: float | None  # training seconds to that step
    wall_s: float  # command to summary
    final_accuracy: float | None
    steps: int


def run(
    config: str | None,
    level: str,
    seed: int,
    steps: int | None,
    out: Path,
    core: int | None = None,
    extra: Sequence[str] = (),
) -> tuple[list[dict], float]:
    """One `gspo train` run in a fresh directory (a leftover one would resume), on one core
    when `core` is given (`taskset`: the rollout server and the learner share it); `extra`:
    more `gspo train` arguments (`--set algorithm.routingReplay=true`)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    pin = ["taskset", "-c", str(core)] if core is not None else []
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    cmd = [*pin, sys.executable, "-m", "gspo_operator.cli", "train", *([config] if config else []),
           "--output-dir", str(out), "--loss-level", level, "--seed", str(seed),
           "--no-progress", *(["--max-steps", str(steps)] if steps else []), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # let `gspo train` stop its learner and servers itself
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    if code != 0:
        raise SystemExit(f"gspo train --loss-level {level} --seed {seed} exited {code}")
    return read_history(out / "checkpoints" / "history.jsonl"), time.monotonic() - start


def reached(records: list[dict], target: float) -> tuple[int | None, float | None]:
    """(step, training seconds) of the first evaluation at or above target."""
    if not records:
        return None, None
    t0 = records[0]["time"] - records[0]["seconds"]
    for r in records:
        if r.get("eval_accuracy", -1.0) >= target:
            return int(r["step"]), r["time"] - t0
    return None, None


def summarize(results: list[Result], target: float) -> str:
    """Per-seed rows, then median and worst per level (a level with a seed that never got
    there has no finite worst: it says so)."""
    head = (
        f"{'level':<6} {'seed':>4} {'steps to ' + str(target):>13} {'train s':>8} "
        f"{'run s':>6} {'final acc':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        step = "not reached" if r.step is None else str(r.step)
        secs = "-" if r.seconds is None else f"{r.seconds:.0f}"
        acc = "-" if r.final_accuracy is None else f"{r.final_accuracy:.2f}"
        lines.append(f"{r.level:<6} {r.seed:>4} {step:>13} {secs:>8} {r.wall_s:>6.0f} {acc:>9}")
    lines.append("")
    lines.append(
        f"{'level':<6} {'reached':>8} {'median steps':>13} {'worst steps':>12} "
        f"{'median s':>9} {'worst s':>8} {'worst run s':>12}"
    )
    for level in dict.fromkeys(r.level for r in results):
        rows = [r for r in results if r.level == level]
        steps = [r.step for r in rows if r.step is not None]
        secs = [r.seconds for r in rows if r.seconds is not None]
        every = len(steps) == len(rows)
        lines.append(
            f"{level:<6} {len(steps):>4}/{len(rows):<3} "
            f"{f'{statistics.median(steps):.0f}' if steps else '-':>13} "
            f"{str(max(steps)) if every else 'never':>12} "
            f"{f'{statistics.median(secs):.0f}' if secs else '-':>9} "
            f"{f'{max(secs):.0f}' if every else 'never':>8} "
            f"{max(r.wall_s for r in rows):>12.0f}"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="GSPOJob manifest (default: the embedded default)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per level")
    p.add_argument(
        "--levels", nargs="+", default=["gspo", "grpo"], choices=["gspo", "gspo-token", "grpo"]
    )
    p.add_argument("--max-steps", type=int, help="override the job's maxSteps")
    p.add_argument("--target", type=float, default=0.9, help="eval_accuracy to reach")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at a time, each pinned to its own core (taskset -c 0, 1, ...)",
    )
    p.add_argument("--work", default="/tmp/gspo-bench-train")
    p.add_argument("--out", default=str(REPO / "bench" / "train-curves.png"))
    args = p.parse_args()
    runs = [(level, seed) for level in args.levels for seed in range(args.seeds)]
    free_cores: queue.Queue[int] = queue.Queue()
    for core in range(args.parallel):
        free_cores.put(core)

    def one(index: int) -> Result:
        level, seed = runs[index]
        out = Path(args.work) / f"{level}-seed{seed}"
        core = free_cores.get() if args.parallel > 1 else None  # a core no other run holds
        try:
            records, wall = run(args.config, level, seed, args.max_steps, out, core)
        finally:
            if core is not None:
                free_cores.put(core)
        step, seconds = reached(records, args.target)
        evals = [r for r in records if "eval_accuracy" in r]
        if not evals:
            raise SystemExit("no evaluations in the history: set algorithm.evalEverySteps")
        print(
            f"{level} seed {seed}: eval_accuracy {args.target} at step {step} "
            f"({'-' if seconds is None else f'{seconds:.0f}'} s), run {wall:.0f} s, "
            f"final {evals[-1]['eval_accuracy']:.2f}",
            flush=True,
        )
        if seed == 0:
            curves[level.upper()] = records
        return Result(
            level,
            seed,
            step,
            seconds,
            wall,
            evals[-1]["eval_accuracy"],
            int(records[-1]["step"]) if records else 0,
        )

    curves: dict[str, list[dict]] = {}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(one, range(len(runs))))
    curves = {
        level.upper(): curves[level.upper()] for level in args.levels if level.upper() in curves
    }
    job = args.config or "(the embedded default)"
    plot_training(curves, args.out, target=args.target, title=f"gspo train {job}, seed 0")
    print()
    print(summarize(results, args.target))
    print(f"curves (seed 0): {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
