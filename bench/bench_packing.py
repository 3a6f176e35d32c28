"""What learner.packSequences saves: the learner's forward + backward, packed vs padded.

One step's worth of rows with a realistic spread of lengths (responses log-uniform from 50 to
4,000 tokens, prompts 100-300, fixed seed), planned into micro-batches of
learner.microBatchTokens as the learner plans them (`plan_step`: padded tokens when padded,
real tokens when packed), each run through `Policy.forward` and the fused GSPO loss
(`policy_loss_from_hidden`, the update's path) and backward, no optimizer step. The model is a
Qwen3 of width 256, 4 layers, a 32k vocabulary, float32, random weights (built from its
config), sdpa attention. Both modes run in this process, alternating, on the same rows and
weights; reported: real tokens (prompt + response) per second of forward + backward (wall
clock, and per CPU second of this process, steadier on a shared machine), the ratios, and each
run's padded-token fraction. Packed under sdpa, the sequences share rows of
the longest one's length (step/policy.py, ONE_ROW_ATTENTION); --one-row adds the layout flash
and flex attention get, all in one row, here run by sdpa with its dense block-diagonal mask
(every (query, key) pair computed: what that layout costs without a varlen kernel).

    python bench/bench_packing.py [--rows 16] [--repeats 3] [--micro-batch-tokens 16384]
                                  [--one-row]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]


class _Engine:
    """What Policy reads of a DeepSpeed engine, around a plain module (no ZeRO here)."""

    def __init__(self, module):  # type: ignore[no-untyped-def]
        self.module, self.optimizer = module, None


class _OneRank:
    rank, world = 0, 1

    def max_int(self, value: int) -> int:
        return value


def model(seed: int = 0):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def rows(n: int, group: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """n responses in groups of `group` (one prompt each): responses log-uniform in
    [50, 4000] tokens, prompts uniform in [100, 300]."""
    import random

    from gspo_trainer.step.batch import pack

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 32000) for _ in range(rng.randint(100, 300))] for _ in range(n // group)
    ]
    lengths = [round(math.exp(rng.uniform(math.log(50), math.log(4000)))) for _ in range(n)]
    responses = [[rng.randrange(3, 32000) for _ in range(k)] for k in lengths]
    logps = [[-rng.uniform(0.1, 3.0) for _ in range(k)] for k in lengths]
    rewards = [float(rng.random() < 0.5) for _ in range(n)]
    return pack(prompts, responses, logps, rewards, group, pad_id=0)


def step(policy, packed, budget: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """One forward + backward over the rows, micro-batched as the learner does; returns
    (wall seconds, CPU seconds of this process, padded-token fraction)."""
    import torch

    from gspo_trainer.advantages import group_advantages
    from gspo_trainer.engine import score_with_head
    from gspo_trainer.fused_loss import policy_loss_from_hidden
    from gspo_trainer.loss import LossOptions
    from gspo_trainer.step.plan import plan_step

    advantages, _ = group_advantages(packed.rewards, 4)
    policy.module.zero_grad(set_to_none=True)
    positions = tokens = 0
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_step(packed, 1, budget, _OneRank(), pack=policy.packs())
    for mb in plan:
        for sub in mb.micro:
            fwd = policy.forward(packed, sub, router=False)
            positions, tokens = positions + fwd.positions, tokens + fwd.tokens
            loss, _, _ = score_with_head(
                policy.module,
                policy_loss_from_hidden,
                fwd.hidden,
                fwd.targets(packed, sub),
                fwd.mask(packed, sub),
                packed.engine_logp[sub, : fwd.L - 1],
                advantages[sub],
                LossOptions("sequence", 3e-4, 4e-4),
            )
            (loss * mb.share(sub)).backward()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(
        torch.isfinite(p.grad).all() for p in policy.module.parameters() if p.grad is not None
    )
    return seconds, cpu, (positions - tokens) / positions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16, help="responses (groups of 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per mode")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--one-row", action="store_true", help="also time the one-row layout")
    args = p.parse_args()

    import torch

    from gspo_trainer.step import policy as policy_module
    from gspo_trainer.step.policy import Policy

    torch.manual_seed(0)
    net = model()
    packed = rows(args.rows, 4)
    real = int(packed.attn.sum())
    lengths = packed.lengths.int().tolist()
    print(
        f"{args.rows} rows, {real} real tokens (responses {min(lengths)}-{max(lengths)}, "
        f"longest row {packed.ids.shape[1]}), microBatchTokens {args.micro_batch_tokens}, "
        f"{torch.get_num_threads()} threads"
    )
    modes = ["padded", "packed", *(["one-row"] if args.one_row else [])]
    policies = {mode: Policy(_Engine(net), None, None, mode != "padded") for mode in modes}
    assert policies["packed"].packs() and not policies["padded"].packs()
    layout = policy_module.ONE_ROW_ATTENTION
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cpus: dict[str, list[float]] = {mode: [] for mode in modes}
    fraction: dict[str, float] = {}
    warm = rows(4, 4, seed=1)  # a first, untimed round on a small step: allocator, kernels
    for round_ in range(args.repeats + 1):
        for mode, policy in policies.items():
            policy_module.ONE_ROW_ATTENTION = layout | {"sdpa"} if mode == "one-row" else layout
            if round_ == 0:
                step(policy, warm, args.micro_batch_tokens)
                continue
            seconds, cpu, fraction[mode] = step(policy, packed, args.micro_batch_tokens)
            times[mode].append(seconds)
            cpus[mode].append(cpu)
    policy_module.ONE_ROW_ATTENTION = layout
    print(
        f"{'mode':>7} {'fwd+bwd s':>10} {'tokens/s':>9} {'CPU s':>7} {'tokens/CPU s':>13} "
        f"{'padded fraction':>16}"
    )
    rate, cpu_rate = {}, {}
    for mode in modes:
        s, c = statistics.median(times[mode]), statistics.median(cpus[mode])
        rate[mode], cpu_rate[mode] = real / s, real / c
        print(
            f"{mode:>7} {s:>10.2f} {rate[mode]:>9.0f} {c:>7.2f} {cpu_rate[mode]:>13.0f} "
            f"{fraction[mode]:>16.3f}"
        )
    print()
    for mode in modes[1:]:
        print(
            f"{mode} vs padded: tokens/s {rate[mode] / rate['padded']:.2f}x, tokens per CPU "
            f"second {cpu_rate[mode] / cpu_rate['padded']:.2f}x (medians of "
            f"{args.repeats})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
