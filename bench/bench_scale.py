"""Seconds per step, `gspo train` against TRL, as the model and the responses grow.

The embedded default's model has ~0.5M parameters and answers in two tokens: there a step's
fixed costs (a request to the rollout server, a weight sync, the learner and vLLM on fixed
halves of the machine) outweigh its work. This bench runs both sides (bench_peer.py's: TRL
1.16's GRPOTrainer set up as GSPO, `gspo train` with its vLLM server and learner) on the
same job at growing widths of the built-in Qwen3-MoE shape (2 layers, 4 experts, top-2;
model_shape.tiny_config_fields) and on two tasks: the embedded default's addition (one digit
and EOS) and builtin:sort-distinct (examples/sort-distinct.yaml: 7 to 11 response tokens;
lossLevel gspo on both sides, TRL's GSPO taking one reward per response). Both load one
model directory per width and seed, so the initial weights are the same.

Each run trains `--steps` steps with no evaluation and no checkpoint before the last; the
figure is the median of each side's seconds per step after the first `--warmup` (one batch:
rollout, rewards, every mini-batch's update, and for `gspo train` the weight sync), and the
ratio ours / TRL; "tokens" is the mean response length of `gspo train`'s steps. One run per
point, one after the other on this machine.

    python bench/bench_scale.py [--widths 128 256 512 1024] [--tasks addition sort-distinct]
                                [--steps 12] [--out bench/scale-step-time.png]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO / "bench")]

from bench_peer import run_trl  # noqa: E402
from bench_train import run as run_ours  # noqa: E402

TASKS = {"addition": None, "sort-distinct": REPO / "examples" / "sort-distinct.yaml"}


def model_dir(root: Path, width: int, seed: int) -> tuple[Path, int]:
    """A random Qwen3-MoE of `width` (the built-in tokenizer), saved once; its path and
    parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_trainer.tiny import build_tokenizer, tiny_config

    path = root / f"qwen3-moe-w{width}-seed{seed}"
    tokenizer = build_tokenizer()
    if not (path / "config.json").exists():
        config = tiny_config(
            "qwen3_moe",
            len(tokenizer),
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            hidden=width,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def job_file(task: str, model: Path, steps: int, out: Path) -> Path:
    """The task's job with the model at `model`, `steps` steps, no evaluation, lossLevel gspo."""
    import yaml

    from gspo_trainer.jobs import tiny_manifest
    from gspo_trainer.train import read_job_file

    source = TASKS[task]
    manifest = copy.deepcopy(read_job_file(str(source)) if source else tiny_manifest())
    spec = manifest["spec"]
    spec["model"]["name"] = str(model)
    spec["algorithm"].update(
        maxSteps=steps,
        evalEverySteps=0,
        lossLevel="gspo",
        tokenBaseline="group",
        # as the embedded default: no entropy bonus (TRL has none), the group's std (TRL gets it)
        scaleRewards="group",
        entropyCoef=0.0,
        # synchronous, as TRL's step and as these figures were taken (the embedded default
        # itself runs one step ahead: bench_peer.py)
        maxStaleness=0,
    )
    spec.setdefault("checkpoint", {})["everySteps"] = steps
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{task}-{model.name}.yaml"
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def step_seconds(records: list[dict[str, Any]], warmup: int) -> float:
    """The median seconds of the steps after the first `warmup`."""
    times = [r["seconds"] for r in records if "seconds" in r and r["step"] > warmup]
    if not times:
        raise SystemExit(f"fewer than {warmup + 1} steps in the history")
    return statistics.median(times)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for task, style in zip(TASKS, ["-", "--"], strict=False):
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        params = [r["params"] / 1e6 for r in mine]
        left.plot(
            params, [r["ours"] for r in mine], "o" + style, color="C0", label=f"gspo train, {task}"
        )
        left.plot(params, [r["trl"] for r in mine], "s" + style, color="C1", label=f"TRL, {task}")
        right.plot(
            params, [r["ours"] / r["trl"] for r in mine], "o" + style, color="C2", label=task
        )
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("seconds per step (median)")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("ours / TRL (below 1: gspo train faster)")
    fig.suptitle("Seconds per step as the model grows (2-core CPU, one run per point)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/gspo-bench-scale")
    p.add_argument("--out", default=str(REPO / "bench" / "scale-step-time.png"))
    args = p.parse_args()
    work = Path(args.work)
    rows = []
    print(
        f"{'task':<14} {'width':>5} {'params':>8} {'tokens':>6} {'ours s':>7} {'TRL s':>7} "
        f"{'ours/TRL':>8}"
    )
    for task in args.tasks:
        for width in args.widths:
            model, params = model_dir(work / "models", width, args.seed)
            job = job_file(task, model, args.steps, work / "jobs")
            run = work / f"{task}-w{width}"
            ours, _ = run_ours(str(job), "gspo", args.seed, None, run / "ours")
            trl, _ = run_trl(str(job), args.seed, None, run / "trl")
            row = {
                "task": task,
                "width": width,
                "params": params,
                "ours": step_seconds(ours, args.warmup),
                "trl": step_seconds(trl, args.warmup),
                "length": statistics.mean(r["response_length"] for r in ours),
            }
            rows.append(row)
            print(
                f"{task:<14} {width:>5} {params / 1e6:>7.2f}M {row['length']:>6.1f} "
                f"{row['ours']:>7.3f} "
                f"{row['trl']:>7.3f} {row['ours'] / row['trl']:>8.2f}",
                flush=True,
            )
    plot(rows, Path(args.out))
    print(f"\nplot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
