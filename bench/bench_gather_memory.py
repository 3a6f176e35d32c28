"""Extra memory of a weight sync and an HF export under ZeRO-3, against gathering the whole
model at once, as a ratio to the model's size.

A 24-layer Qwen3-MoE (hidden 512, 16 experts of 512, vocabulary 16k: ~350 M parameters, fp32
here; as in the real MoE models a layer outweighs the embeddings) under ZeRO-3 on two
learner ranks (torchrun, gloo; with one rank DeepSpeed's gathered parameter is its
shard, so nothing would be measured); a third process receives the sync like a rollout
worker. Each figure is the largest over the ranks of a rank's peak resident memory during
the operation above its resident memory just before (Linux VmHWM, reset through
/proc/self/clear_refs; glibc's heap trimmed before and large blocks mmapped, so freed memory
is not counted as free), so it counts every copy: gathered layers, send buffers, shard
copies, safetensors' own.

- `one layer`: the largest layer gathered alone (what ZeRO-3 costs to hold one layer whole,
  its all-gather's own staging included: gloo's all-gather of a single parameter stages a
  second copy, measured here);
- `a pass`: a ParamStream read through, every tensor let go at once: what holding the model
  a layer at a time costs (a little above `one layer`: DeepSpeed's gathers of consecutive
  layers overlap by their staging);
- `whole model`: the parameters gathered at once (what the sync and export did before);
- `sync (first)`: WeightSender reading a ParamStream (checkpoint names); the first sync also
  allocates the sender's two send buffers, which it keeps for the next ones;
- `sync (next)`: the same again, buffers already there;
- `export`: checkpoint.export_hf, shards of one bucket, a layer at a time.

The bound to hold: sync and export <= 2 buckets + a pass, where a bucket is
weightSync.bucketSizeMb or the largest tensor if that is larger (a tensor larger than a bucket
is sent as a bucket of its own). Exits 1 when it does not hold.

    python bench/bench_gather_memory.py [--layers 24] [--bucket-mb 32]
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

import torch  # noqa: E402
from rss import reset_peak, resident  # noqa: E402

from gspo_trainer import checkpoint as ckpt  # noqa: E402
from gspo_trainer.jobs import tiny_manifest  # noqa: E402
from gspo_trainer.rollout import weight_sync as ws  # noqa: E402

MiB = 2**20


def peak_extra(fn: Any) -> int:
    """Peak resident bytes during fn() above the resident bytes before it."""
    before = reset_peak()
    fn()
    _, peak = resident()
    return peak - before


def build(layers: int, bucket_mb: int) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo_api.validation import parse_spec
    from gspo_trainer.engine import build_engine
    from gspo_trainer.tiny import build_tokenizer

    manifest = copy.deepcopy(tiny_manifest())
    manifest["spec"]["learner"]["zeroStage"] = 3
    manifest["spec"]["model"]["dtype"] = "float32"
    manifest["spec"]["weightSync"]["bucketSizeMb"] = bucket_mb
    spec = parse_spec(manifest["spec"])
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return build_engine(spec, model), build_tokenizer()


def receiver(port: int, rounds: int) -> None:
    store = ws.connect_store("127.0.0.1", port, is_master=False, timeout_s=300)
    group = ws.open_group(store, "bench", 1, 2, timeout_s=300)
    for _ in range(rounds):
        _, tensors = ws.receive_weights(group)
        for _ in tensors:
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--bucket-mb", type=int, default=32)
    args = p.parse_args()
    if "RANK" in os.environ:
        return rank_main(args.layers, args.bucket_mb)
    env = dict(
        os.environ, MALLOC_MMAP_THRESHOLD_="65536", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        *sys.argv[1:],
    ]
    os.execve(sys.executable, cmd, env)


def rank_main(layers: int, bucket_mb: int) -> int:
    import logging

    import deepspeed

    from gspo_trainer.engine import exit_rank
    from gspo_trainer.param_stream import ParamStream
    from gspo_trainer.ranks import Ranks

    logging.disable(logging.WARNING)
    engine, tok = build(layers, bucket_mb)
    ranks = Ranks()
    stream = ParamStream.of(engine, ranks)
    model_bytes, layer_bytes = stream.nbytes(), stream.largest_group_bytes()
    largest_tensor = max(
        math.prod(shape) * dtype.itemsize for _, shape, dtype in ws.CheckpointNamed(stream).metas()
    )
    bucket = max(bucket_mb * MiB, largest_tensor)
    sizes = [sum(p.ds_numel * p.element_size() for _, p in g) for g in stream.groups]
    largest = stream.groups[sizes.index(max(sizes))]

    def one_layer() -> None:
        with deepspeed.zero.GatheredParameters([p for _, p in largest], modifier_rank=None):
            pass

    def one_pass() -> None:
        if ranks.rank != 0:
            stream.follow()
            return
        tensors = iter(stream)
        while (item := next(tensors, None)) is not None:
            del item  # a consumer copies each tensor out and lets it go
        stream.finish()

    def whole() -> None:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            pass

    def sync() -> None:
        if ranks.rank != 0:
            stream.follow()
            return
        sender.send(ws.CheckpointNamed(stream), version=1)
        stream.finish()

    def export(out: Path) -> None:
        if ranks.rank != 0:
            stream.follow()
            return
        ckpt.export_hf(stream.layers(), engine.module, tok, out, bucket)
        stream.finish()

    if ranks.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=receiver, args=(port, 2))
        proc.start()
        store = ws.connect_store("127.0.0.1", port, is_master=True, timeout_s=300)
        group = ws.open_group(store, "bench", 0, 2, timeout_s=300)
        sender = ws.WeightSender(group, bucket_mb=bucket_mb)
    figures = {"one layer": float(peak_extra(one_layer))}
    figures["a pass"] = float(peak_extra(one_pass))
    figures["whole model"] = float(peak_extra(whole))
    figures["sync (first)"] = float(peak_extra(sync))
    figures["sync (next)"] = float(peak_extra(sync))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        figures["export"] = float(peak_extra(lambda: export(out)))
        shards = len(list(out.glob("*.safetensors")))
    figures = ranks.maximum(figures)
    bound = 2 * bucket + figures["a pass"]
    if ranks.rank == 0:
        proc.join(timeout=300)
        print(
            f"model: {layers} layers, {model_bytes / MiB:.0f} MiB (fp32), ZeRO-3 over 2 "
            f"ranks; largest layer {layer_bytes / MiB:.1f} MiB; bucket {bucket / MiB:.1f} MiB "
            f"(--bucket-mb {bucket_mb}, or the largest tensor); bound 2 buckets + a pass "
            f"= {bound / MiB:.1f} MiB ({bound / model_bytes:.3f} of the model)"
        )
        print(f"{'operation':>13} {'peak extra MiB':>15} {'/ model':>8} {'/ bound':>8}")
        for name in ("one layer", "a pass", "whole model", "sync (first)", "sync (next)", "export"):
            extra = figures[name]
            print(
                f"{name:>13} {extra / MiB:>15.1f} {extra / model_bytes:>8.3f} {extra / bound:>8.2f}"
            )
        print(f"export: {shards} shards")
    held = all(figures[k] <= bound for k in ("sync (first)", "sync (next)", "export"))
    if ranks.rank == 0:
        print("bound held" if held else "BOUND EXCEEDED")
    ranks.barrier()
    exit_rank(0 if held else 1)


if __name__ == "__main__":
    sys.exit(main())
