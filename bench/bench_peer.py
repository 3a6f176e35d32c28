"""Time to a greedy accuracy on the embedded default: `gspo train` against TRL's GRPOTrainer
set up as GSPO on exactly the same work, one run after the other on this machine.

Both sides take their settings from one GSPOJob (the embedded default unless a file is
given): the built-in model with the same seed, hence the same initial weights (tiny.py's
`materialize`, which `gspo train` loads too); the same task and reward; groups of
`groupSize`, `promptsPerStep` prompts a step, `miniBatches` optimizer steps per batch; the
same learning rate, Adam betas, weight decay, gradient clip, clip range, sampling
temperature, response length and router load-balancing coefficient; sequence-level
importance ratios (TRL: `importance_sampling_level="sequence"`, `loss_type="grpo"`,
`beta=0`). TRL generates with transformers in its own process; `gspo train` runs its vLLM
rollout server and DeepSpeed learner as separate processes, as a cluster's pods do. Each
side runs in a fresh interpreter, so "run s" is command to finish on both. One difference
stays: algorithm.maxStaleness applies to our side only (the embedded default's 1 generates the
next step's rollouts while this one updates, under the decoupled objective; TRL's trainer
steps synchronously). Both sides evaluate greedily, 100 answers (algorithm.evalMeanAtK is 0
in the embedded default), and their evaluations count in their training seconds.

What it prints per seed and side: the first evaluated step whose greedy accuracy on all 100
problems is >= TARGET, training seconds to it (from the start of the first step), the
command's wall time, the final accuracy and the median seconds per step (one batch: rollout,
rewards, every mini-batch's update); then medians over seeds and the ratios ours / TRL.

    python bench/bench_peer.py [JOB.yaml] --seeds 5 [--max-steps N] [--sides ours trl]

TRL comes with the project's dev extra (`pip install -e .[dev]`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO / "bench")]

from bench_train import reached  # noqa: E402
from bench_train import run as run_ours  # noqa: E402


@dataclass
class Result:
    side: str
    seed: int
    step: int | None
    seconds: float | None
    wall_s: float
    final_accuracy: float | None
    step_s: float | None  # median seconds per step


def job_spec(config: str | None) -> Any:
    """The job both sides run, as the learner reads it."""
    from gspo_api.validation import parse_spec
    from gspo_trainer.jobs import tiny_manifest
    from gspo_trainer.train import read_job_file

    manifest = read_job_file(config) if config else tiny_manifest()
    return parse_spec(manifest["spec"], prefix="spec")


def trl_side(config: str | None, seed: int, steps: int | None, out: Path) -> int:
    """One TRL run in this interpreter; writes out/history.jsonl with the fields bench_train
    reads (step, time, seconds, eval_accuracy)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_trainer.data import load_eval_examples, load_examples
    from gspo_trainer.reward_types import Scored
    from gspo_trainer.rewards import positional_reward, tokenizer_answer_ids
    from gspo_trainer.tiny import materialize

    spec = job_spec(config)
    algo, model_cfg = spec.algorithm, spec.model
    steps = steps or algo.max_steps
    out.mkdir(parents=True, exist_ok=True)
    if model_cfg.name.startswith("builtin:"):
        path = materialize(model_cfg.name, out / "model", seed=seed)
    elif Path(model_cfg.name, "config.json").is_file():  # one both sides load (bench_scale)
        path = Path(model_cfg.name)
    else:
        raise SystemExit("bench_peer: the job's model must be built-in or a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids_of = tokenizer_answer_ids(tokenizer)
    train_rows = load_examples(spec.data, tokenizer)
    eval_rows = load_eval_examples(spec.data, tokenizer)
    if not eval_rows and algo.eval_every_steps > 0:
        raise SystemExit("bench_peer: the job needs an evaluation set (data.evalSource)")
    eval_rows = eval_rows or []
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in train_rows])

    def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    def positional(
        completions: list[str], answer: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        """reward.kind positional, one number per response (TRL's GSPO takes no per-token
        rewards): the learner's own function, on the token ids TRL sampled."""
        eos = tokenizer.eos_token_id
        return [
            float(positional_reward(Scored("", c, a, eos in ids, len(ids), ids), False, ids_of))
            for c, a, ids in zip(completions, answer, completion_ids, strict=True)
        ]

    per_batch = algo.prompts_per_step * algo.group_size
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        num_generations=algo.group_size,
        per_device_train_batch_size=per_batch // algo.mini_batches,
        steps_per_generation=algo.mini_batches,
        num_iterations=1,
        max_steps=steps * algo.mini_batches,
        max_completion_length=algo.max_response_tokens,
        temperature=algo.temperature,
        top_p=algo.top_p,
        top_k=0,
        learning_rate=algo.learning_rate,
        lr_scheduler_type="constant" if algo.lr_schedule == "constant" else algo.lr_schedule,
        weight_decay=algo.weight_decay,
        adam_beta1=algo.adam_beta1,
        adam_beta2=algo.adam_beta2,
        max_grad_norm=algo.max_grad_norm,
        beta=algo.kl_coef,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        loss_type="grpo",
        importance_sampling_level="sequence" if algo.loss_level != "grpo" else "token",
        router_aux_loss_coef=model_cfg.moe.router_aux_loss_coef,
        scale_rewards=algo.scale_rewards,
        bf16=False,
    )
    prompts = [e.prompt for e in eval_rows]
    answers = [e.answer for e in eval_rows]
    history = (out / "history.jsonl").open("w")

    def greedy_accuracy(model: Any) -> float:
        was = model.training
        model.eval()
        tokenizer.padding_side = "left"
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=algo.max_response_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :])
        model.train(was)
        eos = tokenizer.eos_token
        right = sum(
            eos in t and t.split(eos)[0].strip() == a.strip()
            for t, a in zip(texts, answers, strict=True)
        )
        return right / len(answers)

    class Steps(TrainerCallback):
        """One history record per batch (miniBatches optimizer steps), with a greedy
        evaluation every evalEverySteps batches and at the last, as the learner does."""

        last = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % algo.mini_batches:
                return
            step = state.global_step // algo.mini_batches
            record: dict[str, Any] = {"step": step}
            every = algo.eval_every_steps
            if (every and step % every == 0) or step == steps:
                record["eval_accuracy"] = greedy_accuracy(kw["model"])
            now = time.time()
            record.update(time=now, seconds=now - self.last)
            self.last = now
            history.write(json.dumps(record) + "\n")
            history.flush()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=positional if spec.reward.kind == "positional" else exact,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Steps()],
    )
    Steps.last = time.time()
    trainer.train()
    history.close()
    return 0


def run_trl(config: str | None, seed: int, steps: int | None, out: Path) -> tuple[list, float]:
    """TRL's side in a fresh interpreter (imports, model build and all counted)."""
    import shutil

    from gspo_trainer.plot import read_history

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--trl-worker", "--seed", str(seed), "--work", str(out)]
    cmd += [*([config] if config else []), *(["--max-steps", str(steps)] if steps else [])]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}
    start = time.monotonic()
    code = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL).returncode
    if code != 0:
        raise SystemExit(f"TRL run, seed {seed}, exited {code}")
    return read_history(out / "history.jsonl"), time.monotonic() - start


def result(side: str, seed: int, records: list[dict], wall: float, target: float) -> Result:
    step, seconds = reached(records, target)
    evals = [r for r in records if "eval_accuracy" in r]
    steps = [r["seconds"] for r in records if "seconds" in r and "eval_accuracy" not in r]
    return Result(
        side,
        seed,
        step,
        seconds,
        wall,
        evals[-1]["eval_accuracy"] if evals else None,
        statistics.median(steps) if steps else None,
    )


def summarize(results: list[Result], target: float) -> str:
    def fmt(x: float | None, spec: str = ".0f") -> str:
        return "-" if x is None else format(x, spec)

    head = (
        f"{'side':<5} {'seed':>4} {'steps to ' + str(target):>13} {'train s':>8} "
        f"{'run s':>6} {'final acc':>9} {'s/step':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.side:<5} {r.seed:>4} {fmt(r.step, 'd'):>13} {fmt(r.seconds):>8} "
            f"{r.wall_s:>6.0f} {fmt(r.final_accuracy, '.2f'):>9} {fmt(r.step_s, '.3f'):>7}"
        )
    lines.append("")

    def median(side: str, attr: str) -> float | None:
        vals = [getattr(r, attr) for r in results if r.side == side]
        if not vals or any(v is None for v in vals):  # a seed that never got there: no median
            return None
        return statistics.median(vals)

    for attr, what in [
        ("seconds", "train s to target"),
        ("wall_s", "run s"),
        ("step_s", "s per step"),
    ]:
        ours, trl = median("ours", attr), median("trl", attr)
        ratio = f"{ours / trl:.2f}" if ours is not None and trl else "-"
        lines.append(
            f"median {what:<18} ours {fmt(ours, '.2f'):>8}  TRL {fmt(trl, '.2f'):>8}  "
            f"ratio ours/TRL {ratio}"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="GSPOJob manifest (default: the embedded default)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 on each side")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    p.add_argument("--max-steps", type=int, help="override the job's maxSteps")
    p.add_argument("--target", type=float, default=0.9, help="greedy accuracy to reach")
    p.add_argument("--work", default="/tmp/gspo-bench-peer")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_side(args.config, args.seed, args.max_steps, Path(args.work))
    results = []
    for seed in range(args.seeds):
        for side in args.sides:  # one after the other, alternating, on the same machine
            out = Path(args.work) / f"{side}-seed{seed}"
            if side == "ours":
                level = job_spec(args.config).algorithm.loss_level
                records, wall = run_ours(args.config, level, seed, args.max_steps, out)
            else:
                records, wall = run_trl(args.config, seed, args.max_steps, out)
            r = result(side, seed, records, wall, args.target)
            print(
                f"{side} seed {seed}: {args.target} at step {r.step} "
                f"({'-' if r.seconds is None else f'{r.seconds:.0f}'} s), run {wall:.0f} s, "
                f"final {r.final_accuracy}",
                flush=True,
            )
            results.append(r)
    print()
    print(summarize(results, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
