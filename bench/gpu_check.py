"""The learner's GPU path in one command: what only a GPU shows, measured with the project's
own code on random-weight models built from configs (no download, no vLLM, no network).

    python bench/gpu_check.py              # one H100/H200, at most ~8 minutes; JSON on stdout
    python bench/gpu_check.py --dry-run    # the same code on this CPU at toy size (CI runs it)

Sections, each on its own (a failure is recorded as its "error" and the next one runs):
  pytest_gpu    `pytest -m gpu tests/trainer` (collect-only in a dry run)
  fused_loss    policy_loss_from_hidden in bf16 against float32 autograd over full logits at
                16k tokens: loss and gradients, time, tokens/s and peak memory of both, the
                device's chunk size
  update_dense  a Qwen3-0.6B-shaped model, ZeRO-3 bf16 (one rank), the step's πold pass and
                update on packed micro-batches of 0.5-4k-token responses: time, tokens/s, MFU
                against 989 TFLOP/s (H100 SXM dense bf16), peak memory (and the memory plan's
                estimate where a `memory_plan` module exists), ZeRO-3's prefetch trace mode,
                the attention and expert kernels
  checkpoint    that engine's checkpoint: save, resume bit-exact, manifest hashing GB/s and
                the single-threaded hashing time it implies for a 30B checkpoint
  update_moe    the same for a ~1.6B Qwen3-MoE (64 experts, top-8)
  sync_moe      the MoE's weights through a one-rank NCCL sync group (the weight-sync
                sender's buckets: packing and the collective), GB/s

On the GPU machine (Python 3.12, torch, transformers, no DeepSpeed): carry a DeepSpeed wheel
built here, `bench/gpu_check.sh` does both halves (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # H100 SXM dense bf16, as verl and Megatron report MFU
# Bytes a ZeRO-3 checkpoint holds per parameter (fp32 master and Adam's two moments) and a
# 30B model's parameters (Qwen3-30B-A3B): ~366 GB to hash.
CHECKPOINT_BYTES_PER_PARAM = 12
PARAMS_30B = 30.5e9

# Model shapes: Qwen3-0.6B's config (random weights), and a Qwen3-MoE of ~1.6B (64 experts,
# top-8, ~0.4B active); toy sizes for the dry run.
DENSE = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=40_960,
    rope_theta=1e6,
)
MOE = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=384,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=40_960,
    rope_theta=1e6,
)
TOY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)


class Sizes:
    """What each section runs at: the GPU's sizes, or toy ones for a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.loss_tokens, self.loss_vocab, self.loss_hidden = (
            (512, 1000, 64) if dry_run else (16_384, 151_936, 1024)
        )
        self.responses = (8, 24, 96) if dry_run else (16, 512, 4096)  # count, shortest, longest
        self.prompt_tokens = 16 if dry_run else 256
        self.micro_batch_tokens = 256 if dry_run else 16_384
        self.pytest_timeout_s = 120 if dry_run else 240


def config_of(kind: str, sizes: Sizes) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    if sizes.dry_run:
        shape = {k: v for k, v in TOY.items() if kind == "moe" or "expert" not in k}
    else:
        shape = MOE if kind == "moe" else DENSE
    if kind == "moe":
        return Qwen3MoeConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Qwen3Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def device() -> Any:
    import torch

    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_memory() -> Any:
    """Yields a dict that gets "peak_gib": the allocator's high-water mark on a GPU (reset on
    entry), the process's RSS high-water mark on a CPU."""
    import resource

    import torch

    out: dict[str, float] = {}
    if torch.cuda.is_available():
        synchronize()
        torch.cuda.reset_peak_memory_stats()
    yield out
    if torch.cuda.is_available():
        synchronize()
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- pytest -m gpu ------------------------------------------------------------------------


def pytest_gpu(sizes: Sizes, _: dict) -> dict:
    """The suite's GPU tests: the files under tests/ that mark any (collecting all of tests/
    would import test modules that need vLLM, which the GPU machine lacks)."""
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text(encoding="utf-8")
    )
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += ["--collect-only", *files] if sizes.dry_run else files
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "operator"), str(REPO / "trainer"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=sizes.pytest_timeout_s
    )
    lines = proc.stdout.strip().splitlines()
    return {
        "command": " ".join(cmd[2:]),
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stderr.strip()[-500:],
    }


# --- the fused loss -----------------------------------------------------------------------


def fused_loss(sizes: Sizes, _: dict) -> dict:
    import torch

    from gspo_trainer.fused_loss import policy_loss_from_hidden
    from gspo_trainer.logprobs import device_chunk_tokens
    from gspo_trainer.loss import LossOptions, policy_loss

    dev = device()
    T, V, H = sizes.loss_tokens, sizes.loss_vocab, sizes.loss_hidden
    B = 8
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T // B, H, generator=g).to(dev, torch.bfloat16)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dev, torch.bfloat16)
    tokens = torch.randint(0, V, (B, T // B), generator=g).to(dev)
    mask = torch.ones(B, T // B, dtype=torch.bool, device=dev)
    old = (-torch.rand(B, T // B, generator=g) * 4 - 8).to(dev)
    adv = torch.randn(B, generator=g).to(dev)
    kw: dict[str, Any] = dict(level="sequence", clip_low=3e-4, clip_high=4e-4)
    chunk = device_chunk_tokens(dev, V)

    def fused() -> tuple[Any, ...]:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _, _ = policy_loss_from_hidden(
            h, w, tokens, mask, old, adv, LossOptions(**kw), chunk_size=chunk
        )
        loss.backward()
        return loss.float(), h.grad.float(), w.grad.float()

    def reference() -> tuple[Any, ...]:  # float32 autograd over the full logits
        h = hidden.float().requires_grad_(True)
        w = weight.float().requires_grad_(True)
        logp = (h @ w.T).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
        loss, _ = policy_loss(logp, old, adv, mask, **kw)
        loss.backward()
        return loss, h.grad, w.grad

    out: dict[str, Any] = {"tokens": T, "vocab": V, "hidden": H, "chunk_tokens": chunk}
    results = {}
    for name, fn in (("fused", fused), ("reference_fp32", reference)):
        fn()  # warm-up
        free_memory()
        times = []
        with peak_memory() as peak:
            for _ in range(3):
                synchronize()
                t0 = time.perf_counter()
                results[name] = fn()
                synchronize()
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out[name] = {"time_s": t, "tokens_per_s": T / t, **peak}
    (loss, gh, gw), (ref_loss, ref_gh, ref_gw) = results["fused"], results["reference_fp32"]
    out["loss"], out["loss_reference"] = float(loss), float(ref_loss)
    for name, got, ref in (("grad_hidden", gh, ref_gh), ("grad_weight", gw, ref_gw)):
        out[f"{name}_max_rel_error"] = float((got - ref).abs().max() / ref.abs().max())
    key = "peak_gib" if "peak_gib" in out["fused"] else "peak_rss_gib"
    out["speedup"] = out["reference_fp32"]["time_s"] / out["fused"]["time_s"]
    out["memory_ratio"] = out["fused"][key] / max(out["reference_fp32"][key], 1e-9)
    return out


# --- a ZeRO-3 update ----------------------------------------------------------------------


def check_spec(sizes: Sizes, attention: str) -> Any:
    from gspo_api.validation import parse_spec
    from gspo_trainer.jobs import tiny_manifest

    manifest = tiny_manifest()
    manifest["spec"]["model"].update(
        name="builtin:tiny-qwen3",
        dtype="bfloat16",
        gradientCheckpointing=True,
        attnImplementation=attention,
    )
    manifest["spec"]["learner"].update(zeroStage=3, microBatchTokens=sizes.micro_batch_tokens)
    manifest["spec"]["algorithm"].update(learningRate=1e-6, miniBatches=1)
    return parse_spec(manifest["spec"])


def random_batch(sizes: Sizes, vocab: int) -> tuple[Any, Any]:
    """Packed responses of sizes.responses lengths (uniform between the shortest and the
    longest), two per prompt, with their advantages."""
    import torch

    from gspo_trainer.step.batch import pack

    n, low, high = sizes.responses
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    prompts = [
        torch.randint(3, vocab, (sizes.prompt_tokens,), generator=g).tolist() for _ in range(n // 2)
    ]
    responses = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]
    logps = [(-torch.rand(m, generator=g) * 3).tolist() for m in lengths]
    packed = pack(prompts, responses, logps, [float(i % 2) for i in range(n)], 2, 0)
    return packed, torch.tensor([1.0, -1.0] * (n // 2))


def model_flops(config: Any, packed: Any, passes: int) -> float:
    """Matmul FLOPs of `passes` (forward = 1, backward = 2) over the packed sequences: 2 per
    active parameter per token (every weight but the embedding table, top-k experts of an
    MoE layer), plus causal attention's 2 * s^2 * heads * head_dim per layer and sequence."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    heads, kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attn_params = hidden * head_dim * (2 * heads + 2 * kv)
    if getattr(config, "num_experts", None):
        mlp_params = 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok
        mlp_params += hidden * config.num_experts  # the router
    else:
        mlp_params = 3 * hidden * config.intermediate_size
    active = layers * (attn_params + mlp_params) + config.vocab_size * hidden  # + lm_head
    lengths = list(packed.seq_lengths)
    per_pass = 2 * active * sum(lengths)
    per_pass += sum(2 * s * s * heads * head_dim for s in lengths) * layers
    return float(per_pass * passes)


def memory_plan_estimate(spec: Any, config: Any, peak: dict) -> dict:
    """The memory plan's learner estimate for this model and spec (memory_plan.plan over the
    model's config, one GPU), beside the measured peak: estimate / measured is the figure
    the plan is judged by."""
    from gspo_api import memory_plan
    from gspo_api.model_shape import ModelShape

    shape = ModelShape.from_config(config.to_dict())
    one_gpu = spec.learner.model_copy(update={"replicas": 1, "gpus_per_replica": 1})
    spec = spec.model_copy(update={"learner": one_gpu})  # this check's process: one GPU
    plan = memory_plan.plan(spec, shape, "gpu_check (random weights)")
    learner = next(r for r in plan.roles if r.role == "learner")
    measured = peak.get("peak_gib")  # torch's allocator: no CUDA context, no NCCL buffers
    allocated = (learner.total - memory_plan.RUNTIME_RESERVE) / 2**30
    return {
        "learner_gib": learner.total / 2**30,
        "rows_gib": {r.name: r.bytes / 2**30 for r in learner.rows},
        "estimate_over_measured": allocated / measured if measured else None,
    }


def zero3_update(kind: str, sizes: Sizes, keep: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_trainer import engine as eng
    from gspo_trainer.moe import moe_shape
    from gspo_trainer.step.batch import token_micro_count, token_micro_slices
    from gspo_trainer.step.old_policy import old_policy
    from gspo_trainer.step.plan import MiniBatch
    from gspo_trainer.step.policy import Policy
    from gspo_trainer.step.update import update

    dev = device()
    attention = "sdpa"
    if dev.type == "cuda":
        import importlib.util

        attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    spec = check_spec(sizes, attention)
    config = config_of(kind, sizes)
    # One process: its store binds a port the OS picks (a port found free beforehand can be
    # taken by another process before the store binds it).
    os.environ.setdefault("MASTER_PORT", "0")
    eng.init_distributed()
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    engine = eng.build_engine(spec, model)
    policy = Policy(engine, moe_shape(config), None, pack=True, attention=attention)
    packed, advantages = random_batch(sizes, config.vocab_size)
    packed = packed.to(policy.device)
    n = len(packed.seq_lengths)
    lengths = list(packed.seq_lengths)
    count = token_micro_count(lengths, sizes.micro_batch_tokens)
    plan = [MiniBatch(slice(0, n), token_micro_slices(slice(0, n), lengths, count))]
    alg = spec.algorithm
    aux = 0.001 if kind == "moe" else 0.0

    def step() -> tuple[float, float]:
        synchronize()
        t0 = time.perf_counter()
        # diagnose: the πold pass runs (between diagnostics steps the learner lets the one
        # mini-batch's update forward stand in for it); its time is what this reports.
        old = old_policy(policy, packed, plan, alg, diagnose=True)
        synchronize()
        t1 = time.perf_counter()
        update(
            policy,
            packed,
            plan,
            old,
            advantages,
            alg,
            aux_coef=aux,
            behaviour=False,
            diagnose=False,
        )
        synchronize()
        return t1 - t0, time.perf_counter() - t1

    step()  # warm-up: ZeRO-3 records its trace here
    with peak_memory() as peak:
        old_policy_s, update_s = step()
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    mode = (
        "COMPLETE"
        if coordinator.is_complete_trace()
        else "RECORD"
        if coordinator.is_record_trace()
        else "INVALID"
    )
    flops = model_flops(config, packed, 3) + model_flops(config, packed, 1)  # gradient ckpt
    tokens = sum(lengths)
    out = {
        "params": params,
        "responses": n,
        "tokens": tokens,
        "micro_batches": count,
        "old_policy_s": old_policy_s,
        "update_s": update_s,
        "update_tokens_per_s": tokens / update_s,
        "mfu": model_flops(config, packed, 3) / update_s / (PEAK_TFLOPS * 1e12),
        "mfu_with_recompute": flops / update_s / (PEAK_TFLOPS * 1e12),
        **peak,
        "memory_plan": memory_plan_estimate(spec, config, peak),
        "zero3_trace": mode,
        "attention": model.config._attn_implementation,
        "experts": getattr(model.config, "_experts_implementation", None)
        if kind == "moe"
        else None,
        "chunk_tokens": policy.chunk_tokens,
    }
    keep[kind] = (engine, policy, packed, advantages, plan, alg)
    return out


def update_dense(sizes: Sizes, keep: dict) -> dict:
    return zero3_update("dense", sizes, keep)


def update_moe(sizes: Sizes, keep: dict) -> dict:
    keep.pop("dense", None)  # the checkpoint section is done with it
    free_memory()
    return zero3_update("moe", sizes, keep)


# --- checkpoint ---------------------------------------------------------------------------


def gathered(module: Any) -> dict[str, Any]:
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone().cpu()
    return out


def checkpoint(sizes: Sizes, keep: dict) -> dict:
    import torch

    from gspo_trainer.checkpoint import load_state, save_state, write_manifest
    from gspo_trainer.step.old_policy import old_policy
    from gspo_trainer.step.update import update

    if "dense" not in keep:
        raise RuntimeError("needs update_dense's engine, and that section failed")
    engine, policy, packed, advantages, plan, alg = keep["dense"]
    root = Path(tempfile.mkdtemp(prefix="gpu-check-ckpt-"))
    try:
        before = gathered(engine.module)
        synchronize()
        t0 = time.perf_counter()
        save_state(engine, root / "step-000001", 0, {"step": 1})
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = write_manifest(root / "step-000001", 1)
        hash_s = time.perf_counter() - t0
        nbytes = sum(f["bytes"] for f in manifest["files"].values())
        old = old_policy(policy, packed, plan, alg, diagnose=False)  # move the weights on
        update(
            policy,
            packed,
            plan,
            old,
            advantages,
            alg,
            aux_coef=0.0,
            behaviour=False,
            diagnose=False,
        )
        moved = gathered(engine.module)
        t0 = time.perf_counter()
        load_state(engine, root / "step-000001", 0)
        load_s = time.perf_counter() - t0
        after = gathered(engine.module)
        params = sum(t.numel() for t in before.values())
        rate = nbytes / hash_s
        return {
            "bytes": nbytes,
            "bytes_per_param": nbytes / params,
            "save_s": save_s,
            "load_s": load_s,
            "update_moved_weights": any(not torch.equal(before[k], moved[k]) for k in before),
            "resume_bit_exact": all(torch.equal(before[k], after[k]) for k in before),
            "manifest_hash_gb_per_s": rate / 1e9,
            "hash_30b_checkpoint_s": CHECKPOINT_BYTES_PER_PARAM * PARAMS_30B / rate,
        }
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


# --- weight sync --------------------------------------------------------------------------


def sync_moe(sizes: Sizes, keep: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_trainer.rollout.weight_sync import WeightSender, connect_store, open_group

    keep.clear()
    free_memory()
    dev = device()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config_of("moe", sizes), dtype=torch.bfloat16)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    store = connect_store("127.0.0.1", 0, is_master=True, timeout_s=60)  # one rank: any port
    backend = "nccl" if dev.type == "cuda" else "gloo"
    group = open_group(store, "gpu-check", 0, 1, backend=backend, timeout_s=60)
    sender = WeightSender(group, bucket_mb=256 if dev.type == "cuda" else 1)
    sender.send(named, 0)  # the first send lays out the buckets and their buffers
    synchronize()
    t0 = time.perf_counter()
    stats = sender.send(named, 1)
    synchronize()  # NCCL's wait() does not block the host: time the transfer, not the enqueue
    seconds = time.perf_counter() - t0
    with contextlib.suppress(Exception):
        group.pg.shutdown()
    return {
        "backend": backend,
        "bytes": stats.bytes_total,
        "buckets": stats.buckets,
        "tensors": stats.tensors,
        "send_s": seconds,
        "gb_per_s": stats.bytes_total / seconds / 1e9,
    }


SECTIONS: list[tuple[str, Callable[[Sizes, dict], dict]]] = [
    ("pytest_gpu", pytest_gpu),
    ("fused_loss", fused_loss),
    ("update_dense", update_dense),
    ("checkpoint", checkpoint),
    ("update_moe", update_moe),
    ("sync_moe", sync_moe),
]


def environment() -> dict:
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except ImportError as exc:
        out["deepspeed"] = f"missing: {exc}"
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument(
        "--only", nargs="*", choices=[n for n, _ in SECTIONS], help="run these sections alone"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if not args.dry_run else "cpu")
    sizes = Sizes(args.dry_run)
    with contextlib.redirect_stdout(sys.stderr):
        report: dict[str, Any] = {"dry_run": args.dry_run, **environment()}
    keep: dict[str, Any] = {}
    failed = 0
    for name, section in SECTIONS:
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:  # stdout is the report's: what the libraries print goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                report[name] = section(sizes, keep)
        except Exception as exc:  # each section on its own: record it and go on
            failed += 1
            tail = traceback.format_exc().strip().splitlines()[-6:]
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000], "traceback": tail}
        report[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"gpu_check: {name} done in {report[name]['seconds']} s", file=sys.stderr)
    report["failed_sections"] = failed
    print(json.dumps(report, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO / "trainer"), str(REPO / "operator")]
    sys.exit(main())
