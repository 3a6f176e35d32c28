"""The memory plan's learner estimate against the memory the real learner step takes, on CPU.

Each case runs in a fresh process (DeepSpeed's CPU accelerator, one rank, bf16): a Qwen3 or
Qwen3-MoE model built from a config, `engine.build_engine` around it, then two training steps
of `step.update.update` (the learner's own micro-batch loop: forward, fused loss, backward,
optimizer step) on one micro-batch of microBatchTokens tokens (sequences of 512). Measured:
the process's peak resident memory over the two steps (Linux VmHWM, reset through
/proc/self/clear_refs before the engine is built; glibc's large blocks mmapped so that freed
memory is returned) above its resident memory before the model existed. Estimated:
`memory_plan.learner_rows` for the same setup, without its GPU-only rows (the CUDA/NCCL
allowance; no weight sync runs). With one rank ZeRO-3 gathers nothing, and the plan knows it.
Exits 1 when an estimate is off the measurement by more than 25%.

    python bench/bench_memory_plan.py [--case NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rss import reset_peak, resident

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

MiB = 2**20
SEQUENCE = 512  # tokens per sequence (prompt 64 + response 448)
VOCAB = 32000
# name -> (config fields, ZeRO stage, gradient checkpointing, microBatchTokens)
DENSE_S = dict(
    model_type="qwen3",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
DENSE_M = dict(
    model_type="qwen3",
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
MOE_M = dict(
    model_type="qwen3_moe",
    hidden_size=384,
    intermediate_size=1024,
    moe_intermediate_size=384,
    num_experts=16,
    num_experts_per_tok=4,
    decoder_sparse_step=1,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
)
CASES: dict[str, tuple[dict[str, Any], int, bool, int]] = {
    "dense-19M-z2-ckpt": (DENSE_S, 2, True, 4096),
    "dense-58M-z2": (DENSE_M, 2, False, 2048),
    "dense-58M-z2-ckpt": (DENSE_M, 2, True, 4096),
    "dense-58M-z3": (DENSE_M, 3, False, 2048),
    "moe-69M-z2": (MOE_M, 2, False, 2048),
    "moe-69M-z1-ckpt": (MOE_M, 1, True, 4096),
}


class _OneRank:
    rank, world = 0, 1

    def max_int(self, value: int) -> int:
        return value


def run_case(name: str) -> dict[str, Any]:
    """One case in this process: (estimate, measured) bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo_api.memory_plan import RUNTIME_RESERVE, LearnerSetup, Row, learner_rows
    from gspo_api.model_shape import ModelShape
    from gspo_api.validation import parse_spec
    from gspo_trainer.engine import build_engine, init_distributed
    from gspo_trainer.jobs import tiny_manifest
    from gspo_trainer.step.batch import pack
    from gspo_trainer.step.old_policy import OldPolicy
    from gspo_trainer.step.plan import plan_step
    from gspo_trainer.step.policy import Policy
    from gspo_trainer.step.update import update

    fields, stage, checkpointing, tokens = CASES[name]
    fields = {**fields, "vocab_size": VOCAB, "tie_word_embeddings": False, "use_cache": False}
    manifest = tiny_manifest()
    manifest["spec"]["model"].update(dtype="bfloat16", gradientCheckpointing=checkpointing)
    manifest["spec"]["learner"].update(zeroStage=stage, microBatchTokens=tokens)
    manifest["spec"]["algorithm"].update(
        miniBatches=1, groupSize=tokens // SEQUENCE, promptsPerStep=1
    )
    spec = parse_spec(manifest["spec"])
    init_distributed()
    rows = tokens // SEQUENCE
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (64,), generator=g).tolist()
    responses = [
        torch.randint(3, VOCAB, (SEQUENCE - 64,), generator=g).tolist() for _ in range(rows)
    ]
    packed = pack(
        [prompt],
        responses,
        [[-1.0] * len(r) for r in responses],
        [float(i % 2) for i in range(rows)],
        rows,
        pad_id=0,
    )
    base = reset_peak()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable()
    engine = build_engine(spec, model)
    policy = Policy(engine, None, None, True)
    plan = plan_step(packed, 1, tokens, _OneRank(), pack=policy.packs())
    old = OldPolicy([packed.engine_logp], None, [], None)
    advantages = packed.rewards - packed.rewards.mean()
    for _ in range(2):
        update(
            policy,
            packed,
            plan,
            old,
            advantages,
            spec.algorithm,
            aux_coef=0.0,
            behaviour=False,
            diagnose=False,
        )
    measured = resident()[1] - base
    shape = ModelShape.from_config(config.to_dict() | {"model_type": config.model_type})
    setup = LearnerSetup(1, stage, "bfloat16", False, checkpointing, tokens, False, 0, 0)
    rows_ = [
        # The reduce bucket is allocated whole (a GPU's allocator counts it all), but resident
        # memory on a CPU counts only the pages written: the model's gradients' worth.
        Row(r.name, min(r.bytes, shape.params * 2)) if r.name == "gradient reduce bucket" else r
        for r in learner_rows(shape, setup)
        if r.bytes != RUNTIME_RESERVE
    ]
    return {
        "case": name,
        "params": shape.params,
        "estimate": sum(r.bytes for r in rows_),
        "measured": measured,
        "rows": {r.name: r.bytes for r in rows_},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", action="append", choices=sorted(CASES))
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one case here, print JSON
    args = p.parse_args()
    if args.one:
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(run_case(args.one)))
        return 0
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS="2",
        PYTHONWARNINGS="ignore",
    )
    print(f"{'case':<20} {'params':>8} {'estimate MiB':>13} {'measured MiB':>13} {'ratio':>6}")
    worst = 0.0
    for name in args.case or list(CASES):
        out = subprocess.run(
            [sys.executable, __file__, "--one", name],
            env=env,
            text=True,
            capture_output=True,
            check=False,
        )
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            return 2
        r = json.loads(out.stdout.strip().splitlines()[-1])
        ratio = r["estimate"] / r["measured"]
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name:<20} {r['params'] / 1e6:>7.1f}M {r['estimate'] / MiB:>13.0f} "
            f"{r['measured'] / MiB:>13.0f} {ratio:>6.2f}",
            flush=True,
        )
    print(f"largest difference: {worst:.0%} (bound 25%)")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
