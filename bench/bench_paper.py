"""The GSPO paper's claims at laptop scale: GSPO, GRPO, GRPO with Routing Replay and
GSPO-token on a task with long answers and a 16-expert MoE, the same compute per run.

Runs `gspo train` (real vLLM rollout server, real learner) once per variant and seed on the
same job (examples/sort-distinct.yaml: sort 6-10 distinct digits, partial credit per
position: the built-in long-answer task learned furthest here, BENCHMARKS.md) with the model
swapped for builtin:tiny-qwen3-moe-16e (16 experts, top-2, 4 layers) and the routing drift
measured every step (metrics.diagnosticsEverySteps 1), one run after the other. Every run has
the same steps, batch and learning rate; the variants differ only in the objective (and
gspo-token's per-token baseline, the job's tokenBaseline; the others take the group's).
Every variant divides its advantages by the group's sigma as the paper's Eq. 6 does
(`scaleRewards: group`) and has no entropy bonus (PAPER_SETTINGS), whatever the job sets: the
example keeps its policy sampling with unscaled advantages and an entropy bonus of 0.1, which
on a per-response reward of a few hundredths at the start outweighs the advantages and keeps
plain GSPO's policy uniform (entropy 2.69 of a possible 2.71 at step 200 on this model).

    gspo          sequence ratio, clip 3e-4/4e-4 (the paper's Eq. 5-7)
    grpo          token ratio, clip 0.2/0.27 (the paper's baseline)
    grpo-replay   grpo with algorithm.routingReplay: the update routes each token to the
                  experts πold chose (the paper's §5.3)
    gspo-token    GSPO-token, per-token advantages from the positional reward (Eq. 13-14),
                  under the job's algorithm.tokenBaseline

It prints per variant and seed the final greedy (exact-answer) accuracy, the steps and
training seconds to TARGET, the mean clipped-token fraction, the mean routing drift per
update and whether the run collapsed (entropy under 0.05 over its last 20 steps with the
final accuracy under 0.5: every group answering alike, no signal left); then each variant's
median. Figures: reward and accuracy against steps and seconds (the paper's Fig. 1), clipped
fractions (Fig. 2) and routing drift per update, seed-averaged, in bench/paper-*.png.

    python bench/bench_paper.py [JOB.yaml] --seeds 3 [--variants gspo grpo ...]
                                [--max-steps N] [--model builtin:tiny-qwen3-moe-16e] [--reuse]

--reuse reads the runs an earlier call left in --work (a run whose history reached its last
step) instead of training them again: the table and figures again, or more seeds added.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO / "bench")]

from bench_train import reached  # noqa: E402
from bench_train import run as run_train  # noqa: E402

from gspo_trainer.plot import moving_average, read_history  # noqa: E402

# `--loss-level gspo|grpo` gives the per-response objectives the group's baseline (train.py's
# job_manifest drops the job's tokenBaseline); gspo-token keeps the example's (position).
# Advantages divided by the group's sigma (as in the paper's Eq. 6) and no entropy bonus, for
# every variant (the example's own settings suit one objective, GSPO-token on per-token rewards).
PAPER_SETTINGS = ["--set", "algorithm.scaleRewards=group", "--set", "algorithm.entropyCoef=0"]
VARIANTS: dict[str, tuple[str, list[str]]] = {  # name: (lossLevel, more gspo train arguments)
    "gspo": ("gspo", []),
    "grpo": ("grpo", []),
    "grpo-replay": ("grpo", ["--set", "algorithm.routingReplay=true"]),
    "gspo-token": ("gspo-token", []),
}


@dataclass
class Result:
    variant: str
    seed: int
    step: int | None
    seconds: float | None
    final_accuracy: float | None
    reward_end: float | None  # mean training reward over the run's last REWARD_TAIL steps
    clip_fraction: float | None
    drift: float | None
    collapsed: bool
    wall_s: float | None  # None: a run read back (--reuse)


REWARD_TAIL = 50  # steps: the training reward a run ends at, the paper's Fig. 1 measure


def run(
    config: str, variant: str, seed: int, args: argparse.Namespace
) -> tuple[list, float | None]:
    """One `gspo train` of `variant` (bench_train.run: a fresh directory, the history read);
    with --reuse, the history an earlier call left, when that run reached its last step."""
    out = Path(args.work) / f"{variant}-seed{seed}"
    history = out / "checkpoints" / "history.jsonl"
    if args.reuse and history.exists():
        records = read_history(history)
        if records and records[-1]["step"] >= last_step(config, args):
            return records, None
    level, extra = VARIANTS[variant]
    extra = [
        *extra,
        *PAPER_SETTINGS,
        "--set",
        f"model.name={args.model}",
        "--set",
        "metrics.diagnosticsEverySteps=1",
    ]
    return run_train(config, level, seed, args.max_steps, out, extra=extra)


def last_step(config: str, args: argparse.Namespace) -> int:
    import yaml

    return args.max_steps or int(
        yaml.safe_load(Path(config).read_text())["spec"]["algorithm"]["maxSteps"]
    )


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else None


def result(
    variant: str, seed: int, records: list[dict], wall: float | None, target: float
) -> Result:
    step, seconds = reached(records, target)
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    final = evals[-1] if evals else None
    entropy = _mean(records[-20:], "entropy")
    collapsed = entropy is not None and entropy < 0.05 and (final or 0.0) < 0.5
    return Result(
        variant,
        seed,
        step,
        seconds,
        final,
        _mean(records[-REWARD_TAIL:], "reward_mean"),
        _mean(records, "clip_fraction"),
        _mean(records, "routing_drift"),
        collapsed,
        wall,
    )


def summarize(results: list[Result], target: float) -> str:
    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = (
        f"{'variant':<12} {'seed':>4} {'final acc':>9} {'reward end':>10} "
        f"{'steps to ' + str(target):>13} {'train s':>8} {'clipped':>8} {'drift':>6} "
        f"{'collapsed':>9} {'run s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.variant:<12} {r.seed:>4} {fmt(r.final_accuracy, '.2f'):>9} "
            f"{fmt(r.reward_end, '.3f'):>10} {fmt(r.step, 'd'):>13} {fmt(r.seconds, '.0f'):>8} "
            f"{fmt(r.clip_fraction, '.4f'):>8} {fmt(r.drift, '.3f'):>6} "
            f"{'yes' if r.collapsed else 'no':>9} {fmt(r.wall_s, '.0f'):>6}"
        )
    lines.append("")
    lines.append(
        f"{'variant':<12} {'median acc':>10} {'median reward end':>17} {'reached':>8} "
        f"{'median clipped':>15} {'median drift':>13} {'collapsed':>9}"
    )
    for variant in dict.fromkeys(r.variant for r in results):
        rows = [r for r in results if r.variant == variant]

        def med(attr: str, rows: list[Result] = rows) -> float | None:
            vals = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
            return statistics.median(vals) if vals else None

        lines.append(
            f"{variant:<12} {fmt(med('final_accuracy'), '.2f'):>10} "
            f"{fmt(med('reward_end'), '.3f'):>17} "
            f"{sum(r.step is not None for r in rows):>4}/{len(rows):<3} "
            f"{fmt(med('clip_fraction'), '.4f'):>15} {fmt(med('drift'), '.3f'):>13} "
            f"{sum(r.collapsed for r in rows):>5}/{len(rows):<3}"
        )
    return "\n".join(lines)


def _seed_mean(runs: list[list[dict]], key: str, x: str) -> tuple[list[float], list[float]]:
    """(x, mean of key over the seeds) at the steps every seed logged."""
    by_step = [{int(r["step"]): r for r in records if key in r} for records in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_step))) if by_step else []
    xs = [
        statistics.fmean(
            d[s][x] - runs[i][0]["time"] + runs[i][0]["seconds"] if x == "time" else d[s][x]
            for i, d in enumerate(by_step)
        )
        for s in steps
    ]
    return xs, [statistics.fmean(d[s][key] for d in by_step) for s in steps]


def plot(curves: dict[str, list[list[dict]]], out: Path, window: int = 20) -> list[Path]:
    """Fig. 1 (reward and greedy accuracy against steps and training seconds), Fig. 2
    (clipped-token fraction) and routing drift per update, each variant's seed mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=110)
    for i, (variant, runs) in enumerate(curves.items()):
        for col, x in enumerate(["step", "time"]):
            xs, ys = _seed_mean(runs, "reward_mean", x)
            axes[0][col].plot(xs, moving_average(ys, window), color=f"C{i}", label=variant)
            xs, ys = _seed_mean(runs, "eval_accuracy", x)
            axes[1][col].plot(xs, ys, "o-", color=f"C{i}", label=variant)
    for col, what in enumerate(["step", "training seconds"]):
        axes[0][col].set_ylabel(f"training reward ({window}-step mean)")
        axes[1][col].set_ylabel("greedy exact-answer accuracy")
        axes[1][col].set_xlabel(what)
    axes[0][0].legend()
    fig.tight_layout()
    written.append(out.with_name(out.name + "-reward.png"))
    fig.savefig(written[-1])
    for key, label, name in [
        ("clip_fraction", "clipped-token fraction", "clipping"),
        ("routing_drift", "routing drift per update", "drift"),
    ]:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for i, (variant, runs) in enumerate(curves.items()):
            xs, ys = _seed_mean(runs, key, "step")
            ax.plot(xs, moving_average(ys, window), color=f"C{i}", label=variant)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_yscale("log" if key == "clip_fraction" else "linear")
        ax.legend()
        fig.tight_layout()
        written.append(out.with_name(out.name + f"-{name}.png"))
        fig.savefig(written[-1])
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default=str(REPO / "examples" / "sort-distinct.yaml"))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model", default="builtin:tiny-qwen3-moe-16e")
    p.add_argument("--max-steps", type=int, help="override the job's maxSteps")
    p.add_argument("--target", type=float, default=0.9, help="greedy accuracy to reach")
    p.add_argument("--work", default="/tmp/gspo-bench-paper")
    p.add_argument("--out", default=str(REPO / "bench" / "paper"))
    p.add_argument("--reuse", action="store_true", help="read the finished runs in --work back")
    args = p.parse_args()
    results, curves = [], {}
    for seed in range(args.seeds):
        for variant in args.variants:  # interleaved: the machine's drift spreads over all
            records, wall = run(args.config, variant, seed, args)
            r = result(variant, seed, records, wall, args.target)
            print(
                f"{variant} seed {seed}: final accuracy {r.final_accuracy}, clipped "
                f"{r.clip_fraction}, drift {r.drift}, run "
                + ("read back" if wall is None else f"{wall:.0f} s"),
                flush=True,
            )
            results.append(r)
            curves.setdefault(variant, []).append(records)
    print()
    print(summarize(results, args.target))
    for path in plot(curves, Path(args.out)):
        print(f"figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
