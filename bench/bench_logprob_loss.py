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

    python bench/bench_logprob_loss.py            # vocab 32k, 2k tokens (8 x 256), hidden 1024
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
    hidden = torch.randn(B, T, args.hidden, generator=g).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).requires_grad_(
        True
    )
    tokens = torch.randint(0, args.vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -10.4 + 0.01 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return hidden, weight, tokens, mask, old, adv


def step(variant: str, inputs, chunk: int) -> None:
    """One forward + loss + backward; gradients land in hidden.grad and weight.grad."""
    from gspo_trainer.logprobs import token_logprobs_from_hidden
    from gspo_trainer.loss import policy_loss

    hidden, weight, tokens, mask, old, adv = inputs
    kw = dict(level="sequence", clip_low=3e-4, clip_high=4e-4)
    if variant == "fused":
        from gspo_trainer.fused_loss import policy_loss_from_hidden

        loss, _, _ = policy_loss_from_hidden(
            hidden, weight, tokens, mask, old, adv, chunk_size=chunk, with_entropy=False, **kw
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
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


def run_variant(args: argparse.Namespace, variant: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "trainer"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--child", "--variant", variant]
    for key in ("vocab", "tokens", "batch", "hidden", "chunk", "repeats"):
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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunk is None:
        from gspo_trainer.logprobs import DEFAULT_CHUNK_TOKENS

        args.chunk = DEFAULT_CHUNK_TOKENS
    if args.child:
        child(args)
        return
    print(
        f"vocab {args.vocab}, {args.tokens} tokens ({args.batch} x {args.tokens // args.batch}), "
        f"hidden {args.hidden}, float32, chunk {args.chunk}, median of {args.repeats}"
    )
    chosen = (args.variant,) if args.variant else VARIANTS
    rows = {v: run_variant(args, v) for v in chosen}
    for r in rows.values():
        note = "  (peak may be hidden by set-up)" if r["peak_hidden_by_setup"] else ""
        print(f"{r['variant']:>6}: peak +{r['peak_mib']:8.1f} MiB  time {r['time_s']:6.3f} s{note}")
    if len(rows) == len(VARIANTS):
        naive, trl = rows["naive"], rows["trl"]
        for name in ("ours", "fused"):
            r = rows[name]
            print(
                f"{name}/naive: memory {r['peak_mib'] / naive['peak_mib']:.3f}x "
                f"time {r['time_s'] / naive['time_s']:.3f}x   "
                f"{name}/trl: memory {r['peak_mib'] / trl['peak_mib']:.3f}x "
                f"time {r['time_s'] / trl['time_s']:.3f}x"
            )


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "trainer"))
    main()
