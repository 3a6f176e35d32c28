"""Step time and held-out accuracy against wall-clock time: algorithm.maxStaleness 0 vs 1.

Runs `gspo train` (real vLLM rollout server, real learner) on the same job, machine and
seeds with maxStaleness 0 (synchronous: generate, then update) and 1 (the next step's
rollouts are generated while this one updates), alternating the two so drift in the machine
falls on both. Reports per run the median step seconds (the history's `seconds`: collection
wait, πold, update, sync; evaluations apart), the ratio 1 vs 0, where the step's time went,
the final greedy eval_accuracy and the training seconds to TARGET; writes one plot of
accuracy against seconds for both.

    python bench/bench_overlap.py [JOB.yaml] [--seeds 1] [--max-steps N] [--target 0.9]

Core sharing on a small machine: `gspo train` starts the rollout server (vLLM's engine core
busy-polls one core while it serves) and the learner (OMP_NUM_THREADS=1) as their own
processes, unpinned; the ratio measures overlap only where they find a core each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO / "bench")]

from bench_train import reached, run  # noqa: E402

from gspo_trainer.jobs import tiny_manifest  # noqa: E402
from gspo_trainer.plot import plot_accuracy_over_time  # noqa: E402

STAGES = ("rollout", "old_policy", "update", "weight_sync")


def manifest_with(config: str | None, staleness: int, path: Path) -> str:
    """The job (default: the embedded one) with algorithm.maxStaleness set, as a file."""
    job = yaml.safe_load(Path(config).read_text()) if config else tiny_manifest()
    job["spec"].setdefault("algorithm", {})["maxStaleness"] = staleness
    path.write_text(yaml.safe_dump(job))
    return str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="GSPOJob manifest (default: the embedded default)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per setting")
    p.add_argument("--max-steps", type=int, help="override the job's maxSteps")
    p.add_argument("--target", type=float, default=0.9, help="eval_accuracy to reach")
    p.add_argument("--work", default="/tmp/gspo-bench-overlap")
    p.add_argument("--out", default=str(REPO / "bench" / "overlap-accuracy-vs-time.png"))
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    histories: dict[int, list[list[dict]]] = {0: [], 1: []}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for staleness in (0, 1):
                job = manifest_with(args.config, staleness, Path(tmp) / f"s{staleness}.yaml")
                out = work / f"staleness{staleness}-seed{seed}"
                records, wall = run(job, "gspo", seed, args.max_steps, out)
                histories[staleness].append(records)
                step_s = statistics.median(r["seconds"] for r in records)
                stages = {
                    st: statistics.median(r.get(f"{st}_seconds", 0.0) for r in records)
                    for st in STAGES
                }
                evals = [r for r in records if "eval_accuracy" in r]
                at, secs = reached(records, args.target)
                rows.append(
                    (
                        staleness,
                        seed,
                        step_s,
                        stages,
                        wall,
                        evals[-1]["eval_accuracy"] if evals else None,
                        at,
                        secs,
                    )
                )
                print(
                    f"maxStaleness {staleness} seed {seed}: step {step_s:.3f} s (median), "
                    f"run {wall:.0f} s, final eval_accuracy "
                    f"{rows[-1][5] if rows[-1][5] is not None else '-'}",
                    flush=True,
                )
    print()
    head = (
        f"{'maxStaleness':>12} {'seed':>4} {'step s':>7} "
        + " ".join(f"{st + ' s':>13}" for st in STAGES)
        + f" {'to ' + str(args.target):>9} {'train s':>8} {'run s':>6} "
        f"{'final acc':>9}"
    )
    print(head)
    print("-" * len(head))
    for staleness, seed, step_s, stages, wall, final, at, secs in rows:
        print(
            f"{staleness:>12} {seed:>4} {step_s:>7.3f} "
            + " ".join(f"{stages[st]:>13.3f}" for st in STAGES)
            + f" {at if at is not None else 'never':>9} "
            f"{f'{secs:.0f}' if secs is not None else '-':>8} {wall:>6.0f} "
            f"{f'{final:.2f}' if final is not None else '-':>9}"
        )
    median = {s: statistics.median(r[2] for r in rows if r[0] == s) for s in (0, 1)}
    print(
        f"\nstep time, maxStaleness 1 vs 0: {median[1] / median[0]:.2f}x "
        f"({median[1]:.3f} s vs {median[0]:.3f} s, medians over runs)"
    )
    job_name = args.config or "the embedded default"
    plot_accuracy_over_time(
        {f"maxStaleness {s}": histories[s] for s in (0, 1)},
        args.out,
        target=args.target,
        title=f"gspo train ({job_name}): eval_accuracy vs time",
    )
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
