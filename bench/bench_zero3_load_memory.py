"""Host memory of a rank while the learner loads a MoE checkpoint under ZeRO-3, as a fraction of
the model's bytes: transformers' own load against the layer-at-a-time load (zero3_load).

A scaled Qwen3-MoE (hidden 512, 8 layers of 32 experts of 512, vocabulary 16k: ~225 M
parameters, bf16, ~450 MB; as in Qwen3-30B-A3B the experts are most of it) saved with
save_pretrained (one safetensors file, each expert's tensors apart, as the Hub's are), then
loaded by `engine._from_pretrained(spec, path, shard=True)` on two ranks (torchrun, gloo,
DeepSpeed's CPU accelerator, where partitions live in host memory too). Each rank's figure
is its peak resident memory during the load (Linux VmHWM, reset through /proc/self/clear_refs;
glibc's large blocks mmapped, so freed memory is returned) above its resident memory just
before, so it counts every copy: the partition kept, gathered layers, tensors read, merged and
converted state dicts. `transformers` runs the same call with zero3_load.streamed turned off.
Before the baseline each rank loads a one-layer model of the same kind once, so that what
any load imports and sets up once (transformers' model code, DeepSpeed's) is not counted.

The bound to hold in streamed mode (exit 1 otherwise): on rank 0, peak <= partition + 4 x the
largest layer (the gathered layer, gloo's staging copy of it, the layer's tensors as read and
as converted); on the other ranks, partition + 2 x the largest layer (the gathered layer and
its staging). Under NCCL the gathered layer and its staging are on the GPU, not the host.

    python bench/bench_zero3_load_memory.py [--layers 8] [--mode streamed --mode transformers]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rss import reset_peak, resident

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

MiB = 2**20


def config_fields(layers: int) -> dict[str, Any]:
    return dict(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )


def save(path: Path, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **config_fields(layers))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def rank_main(path: str, mode: str, out: str) -> None:
    import logging

    from gspo_api.validation import parse_spec
    from gspo_trainer import engine as eng
    from gspo_trainer import zero3_load
    from gspo_trainer.jobs import tiny_manifest

    logging.disable(logging.WARNING)
    manifest = tiny_manifest()
    manifest["spec"]["learner"]["zeroStage"] = 3
    manifest["spec"]["model"]["dtype"] = "bfloat16"
    spec = parse_spec(manifest["spec"])
    eng.init_distributed()
    if mode == "transformers":
        zero3_load.streamed = contextlib.nullcontext  # type: ignore[assignment]
    # A first load of a one-layer model of the same kind, so that the baseline below already
    # holds what any load imports and sets up once (transformers' model code, DeepSpeed's).
    eng._from_pretrained(spec, str(Path(path).parent / "warm"), shard=True)
    before = reset_peak()
    model = eng._from_pretrained(spec, path, shard=True)
    peak = resident()[1] - before
    kept = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    rank = int(os.environ["RANK"])
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "peak": peak, "partition": kept}) + "\n")
    import torch.distributed as dist

    dist.barrier()
    eng.exit_rank(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mode", action="append", choices=["transformers", "streamed"])
    p.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)  # path, mode, out
    args = p.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return 0
    from gspo_api.model_shape import ModelShape

    shape = ModelShape.from_config({"model_type": "qwen3_moe", **config_fields(args.layers)})
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save(model_dir, args.layers)
        save(Path(tmp) / "warm", 1)
        model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        layer = 2 * shape.largest_layer_params
        print(
            f"model {shape.params / 1e6:.0f} M parameters, {model_bytes / MiB:.0f} MiB; "
            f"largest layer {layer / MiB:.0f} MiB; 2 ranks, ZeRO-3"
        )
        print(
            f"{'mode':<13} {'rank':>4} {'peak MiB':>9} {'/ model':>8} {'partition MiB':>14} "
            f"{'bound MiB':>10}"
        )
        for mode in args.mode or ["transformers", "streamed"]:
            out = Path(tmp) / f"{mode}.jsonl"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                __file__,
                "--rank",
                str(model_dir),
                mode,
                str(out),
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 2
            for r in sorted(
                (json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["rank"]
            ):
                bound = r["partition"] + (4 if r["rank"] == 0 else 2) * layer
                held = r["peak"] <= bound
                failed |= mode == "streamed" and not held
                held |= mode != "streamed"  # the bound is the streamed load's
                print(
                    f"{mode:<13} {r['rank']:>4} {r['peak'] / MiB:>9.0f} "
                    f"{r['peak'] / model_bytes:>8.2f} {r['partition'] / MiB:>14.0f} "
                    f"{bound / MiB:>10.0f}{'' if held else '  over the bound'}",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
