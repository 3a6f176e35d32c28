"""Weight-sync bandwidth: bucketed broadcast vs one raw flat buffer, and vs per-tensor;
and the filesystem method (write a version's safetensors shards, read them back) against
the bucketed broadcast.

Two processes on one machine, one gloo group (rank 0 = learner, rank 1 = a receiver that
unflattens like a rollout worker). Prints each figure as a ratio against its baseline:

    python bench/bench_weight_sync.py [--mb 256] [--tensors 600] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

import torch

from gspo_trainer.rollout import weight_files
from gspo_trainer.rollout import weight_sync as ws

REPEATS = 5
SMALL_REPEATS = 31  # milliseconds each: more rounds, so one scheduler hiccup cannot set the median


def make_model(total_mb: float, count: int) -> dict[str, torch.Tensor]:
    """`count` fp32 tensors: a few large matrices and many small norms/biases, like an LLM."""
    small = max(count - 8, 0)
    small_elems = 256
    big_elems = int((total_mb * 2**20 / 4 - small * small_elems) / 8)
    tensors = {f"layers.{i}.norm.weight": torch.randn(small_elems) for i in range(small)}
    tensors.update({f"layers.{i}.proj.weight": torch.randn(big_elems) for i in range(8)})
    return tensors


def receiver(port: int, shapes: list[tuple[str, int]], modes: list[str], repeats: int) -> None:
    store = ws.connect_store("127.0.0.1", port, is_master=False, timeout_s=120)
    group = ws.open_group(store, "bench", 1, 2, timeout_s=120)
    total = sum(n for _, n in shapes)
    for mode in modes:
        for _ in range(repeats):
            if mode == "raw":
                group.broadcast(torch.empty(total, dtype=torch.uint8))
            elif mode == "per_tensor":
                for _, nbytes in shapes:
                    group.broadcast(torch.empty(nbytes // 4, dtype=torch.float32))
            else:
                _, stream = ws.receive_weights(group)
                for _ in stream:
                    pass
            group.broadcast(torch.zeros(1, dtype=torch.uint8))  # end-of-round barrier


def timed(group: ws.SyncGroup, fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        group.broadcast(torch.zeros(1, dtype=torch.uint8))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(total_mb: float, count: int, bucket_mb: float, repeats: int = REPEATS) -> dict[str, float]:
    tensors = make_model(total_mb, count)
    shapes = [(n, t.numel() * 4) for n, t in tensors.items()]
    total = sum(b for _, b in shapes)
    modes = ["raw", "bucketed", "per_tensor"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=receiver, args=(port, shapes, modes, repeats))
    proc.start()
    store = ws.connect_store("127.0.0.1", port, is_master=True, timeout_s=120)
    group = ws.open_group(store, "bench", 0, 2, timeout_s=120)
    flat = torch.empty(total, dtype=torch.uint8)
    sender = ws.WeightSender(group, bucket_mb=bucket_mb)
    out = {
        "raw": timed(group, lambda: group.broadcast(flat), repeats),
        "bucketed": timed(group, lambda: sender.send(tensors.items(), version=1), repeats),
        "per_tensor": timed(group, lambda: [group.broadcast(t) for t in tensors.values()], repeats),
    }
    proc.join(timeout=120)
    out["bytes"] = total
    out["files"] = files_round_trip(tensors, bucket_mb, repeats)
    return out


def files_round_trip(tensors: dict[str, torch.Tensor], bucket_mb: float, repeats: int) -> float:
    """weightSync filesystem: rank 0 writes the version, a server reads every tensor back
    (here the same process and disk; the page cache flatters the read)."""
    times = []
    with tempfile.TemporaryDirectory() as root:
        for version in range(repeats):
            start = time.perf_counter()
            path, _ = weight_files.write_version(
                tensors.items(), Path(root), version, int(bucket_mb * 2**20)
            )
            for _ in weight_files.read_version(path):
                pass
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=256)
    p.add_argument("--tensors", type=int, default=600)
    p.add_argument("--bucket-mb", type=float, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    r = run(args.mb, args.tensors, args.bucket_mb)
    gib = r["bytes"] / 2**30
    print(
        f"model: {args.tensors} tensors, {r['bytes'] / 2**20:.0f} MiB fp32; "
        f"bucket {args.bucket_mb} MiB; gloo, 2 processes, median of {REPEATS}"
    )
    for mode in ("raw", "bucketed", "per_tensor"):
        print(f"  {mode:<10} {r[mode] * 1e3:8.1f} ms  {gib / r[mode]:6.2f} GiB/s")
    print(f"bucketed / raw flat-buffer bandwidth: {r['raw'] / r['bucketed']:.2f}x (target >= 0.7)")
    print(f"bucketed vs per-tensor speed-up:      {r['per_tensor'] / r['bucketed']:.1f}x")
    print(
        f"  {'files':<10} {r['files'] * 1e3:8.1f} ms  {gib / r['files']:6.2f} GiB/s  "
        f"(write the shards, read them back)"
    )
    print(f"filesystem / bucketed broadcast time:  {r['files'] / r['bucketed']:.2f}x")

    small = run(args.mb / 64, args.tensors, args.bucket_mb, repeats=SMALL_REPEATS)
    print(
        f"small model ({small['bytes'] / 2**20:.1f} MiB, {args.tensors} tensors): "
        f"bucketed {small['bucketed'] * 1e3:.1f} ms, per-tensor {small['per_tensor'] * 1e3:.1f}"
        f" ms -> {small['per_tensor'] / small['bucketed']:.1f}x (target >= 10; median of "
        f"{SMALL_REPEATS})"
    )


if __name__ == "__main__":
    main()
