"""Token log-prob + GSPO loss, forward and backward, on CPU: peak memory and time per variant.

Variants, all starting from the final hidden states (B, T, H) and the lm_head weight (V, H)
and ending with the gradient of both:
  naive  logits = h @ W.T in full, float32 log_softmax over the vocabulary, gather
  trl    logits in full, TRL's `selective_log_softmax` (trl.trainer.utils)
  ours   `token_logprobs_from_hidden`: chunked, the full logits never exist, each chunk's
         logits recomputed in backward
then the same `policy_loss(level="sequence")` and backward; and
  fused  `policy_loss_from_hidden`: the same loss, its gradient made in the forward pass.
Each variant runs in a fresh subprocess; its peak is the process's RSS high-water mark
(ru_maxrss) minus its RSS just before the path (inputs, imports and a small warm-up already
in). glibc is told to return every block over 64 KiB to the OS on free
(MALLOC_MMAP_THRESHOLD_), the same for every variant, so RSS follows live tensors. Time is
the median of --repeats runs. Ratios are printed against naive and TRL from the same run.

On a GPU (--device cuda) every variant runs in this process, in --dtype, and the peak is
torch's allocator high-water mark above what the inputs hold; the chunk defaults to the
device's (`logprobs.chunk_tokens`). Each line gives tokens/s, and the ratios compare them
against naive, the unfused reference, from the same run.

    python bench/bench_logprob_loss.py            # vocab 32k, 2k tokens (8 x 256), hidden 1024
    python bench/bench_logprob_loss.py --device cuda --dtype bfloat16 --vocab 151936 \
        --tokens 16384 --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("naive", "trl", "ours", "fused")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_inputs(args: argparse.Namespace, B: int, T: int):
    import torch

    g = torch.Generator().manual_seed(0)
    dtype, device = getattr(torch, args.dtype), args.device
    hidden = torch.randn(B, T, args.hidden, generator=g).to(device, dtype).requires_grad_(True)
    weight = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    weight = weight.to(device, dtype).requires_grad_(True)
    tokens = torch.randint(0, args.vocab, (B, T), generator=g).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    old = (-10.4 + 0.01 * torch.randn(B, T, generator=g)).to(device)
    adv = torch.randn(B, generator=g).to(device)
    return hidden, weight, tokens, mask, old, adv


def measure_cuda(args: argparse.Namespace, variant: str) -> dict:
    """One variant on the GPU, in this process: median time, tokens/s and the allocator's
    peak above the inputs."""
    import torch

    step(variant, make_inputs(args, 2, 8), args.chunk)
    inputs = make_inputs(args, args.batch, args.tokens // args.batch)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        inputs[0].grad = inputs[1].grad = None
        t0 = time.perf_counter()
        step(variant, inputs, args.chunk)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {
        "variant": variant,
        "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
        "peak_hidden_by_setup": False,
        "time_s": t,
        "tokens_per_s": args.tokens / t,
        "threads": torch.get_num_threads(),
    }


def step(variant: str, inputs, chunk: int) -> None:
    """One forward + loss + backward; gradients land in hidden.grad and weight.grad."""
    from gspo_trainer.logprobs import token_logprobs_from_hidden
    from gspo_trainer.loss import LossOptions, policy_loss

    hidden, weight, tokens, mask, old, adv = inputs
    kw = dict(level="sequence", clip_low=3e-4, clip_high=4e-4)
    if variant == "fused":
        from gspo_trainer.fused_loss import policy_loss_from_hidden

        loss, _, _ = policy_loss_from_hidden(
            hidden,
            weight,
            tokens,
            mask,
            old,
            adv,
            LossOptions(**kw),
            chunk_size=chunk,
            with_entropy=False,
        )
        loss.backward()
        return
    if variant == "ours":
        logp = token_logprobs_from_hidden(hidden, weight, tokens, chunk, mask=mask).logp
    else:
        logits = hidden @ weight.T  # (B, T, V)
        if variant == "naive":
            logp = logits.float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
        else:
            from trl.trainer.utils import selective_log_softmax

            logp = selective_log_softmax(logits, tokens)
        del logits
    loss, _ = policy_loss(logp, old, adv, mask, **kw)
    loss.backward()


def child(args: argparse.Namespace) -> None:
    import torch

    if args.variant == "trl":
        import trl.trainer.utils  # noqa: F401  (import cost outside the measurement)
    warm = make_inputs(args, 2, 8)
    step(args.variant, warm, args.chunk)
    inputs = make_inputs(args, args.batch, args.tokens // args.batch)
    times = []
    base = rss_bytes()
    peak_before = peak_bytes()
    for _ in range(args.repeats):
        inputs[0].grad = inputs[1].grad = None
        t0 = time.perf_counter()
        step(args.variant, inputs, args.chunk)
        times.append(time.perf_counter() - t0)
    peak = peak_bytes()
    result = {
        "variant": args.variant,
        "peak_mib": (peak - base) / 2**20,
        "peak_hidden_by_setup": peak == peak_before,
        "time_s": statistics.median(times),
        "tokens_per_s": args.tokens / statistics.median(times),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


def run_variant(args: argparse.Namespace, variant: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "operator"), str(REPO / "trainer"), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, __file__, "--child", "--variant", variant]
    for key in ("vocab", "tokens", "batch", "hidden", "chunk", "repeats", "dtype", "device"):
        cmd += [f"--{key}", str(getattr(args, key))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="responses; tokens / batch each")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=None, help="ours: tokens per chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: in this process")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunk is None:
        import torch

        from gspo_trainer.logprobs import device_chunk_tokens

        args.chunk = device_chunk_tokens(torch.device(args.device), args.vocab)
    if args.child:
        child(args)
        return
    print(
        f"vocab {args.vocab}, {args.tokens} tokens ({args.batch} x {args.tokens // args.batch}), "
        f"hidden {args.hidden}, {args.dtype} on {args.device}, chunk {args.chunk}, "
        f"median of {args.repeats}"
    )
    chosen = (args.variant,) if args.variant else VARIANTS
    measure = run_variant if args.device == "cpu" else measure_cuda
    rows = {v: measure(args, v) for v in chosen}
    for r in rows.values():
        note = "  (peak may be hidden by set-up)" if r["peak_hidden_by_setup"] else ""
        print(
            f"{r['variant']:>6}: peak +{r['peak_mib']:8.1f} MiB  time {r['time_s']:6.3f} s  "
            f"{r['tokens_per_s']:9.0f} tokens/s{note}"
        )
    if len(rows) == len(VARIANTS):
        naive, trl = rows["naive"], rows["trl"]
        for name in ("ours", "fused"):
            r = rows[name]
            print(
                f"{name}/naive: memory {r['peak_mib'] / naive['peak_mib']:.3f}x "
                f"time {r['time_s'] / naive['time_s']:.3f}x "
                f"tokens/s {r['tokens_per_s'] / naive['tokens_per_s']:.2f}x   "
                f"{name}/trl: memory {r['peak_mib'] / trl['peak_mib']:.3f}x "
                f"time {r['time_s'] / trl['time_s']:.3f}x"
            )


if __name__ == "__main__":
    sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]
    main()
