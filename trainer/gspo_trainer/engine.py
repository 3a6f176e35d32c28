"""The DeepSpeed engine around an HF causal LM: process group, ZeRO config, MoE leaf modules.

`gspo train` and CPU tests run on gloo with DeepSpeed's CPU accelerator; a cluster runs NCCL.
The optimizer is AdamW (`optimizer_config`): torch's, except with learner.offloadOptimizer on
GPUs, where it is DeepSpeedCPUAdam. Under ZeRO-3, whole MoE blocks are leaf modules: their
parameters are gathered once per block rather than per expert, which keeps routing
(data-dependent expert calls) from tripping ZeRO-3's prefetch trace.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gspo_api.ports import free_port
from gspo_api.spec import GSPOJobSpec

if TYPE_CHECKING:
    import torch


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the learner group (one process alone when no launcher set RANK/WORLD_SIZE), on
    this rank's device (selected first: device.select_device). `timeout_s`: the default
    group's (ranks.data_timeout_s; None: DeepSpeed's 10 minutes)."""
    from datetime import timedelta

    import torch.distributed as dist

    from gspo_trainer.deepspeed_import import import_deepspeed
    from gspo_trainer.device import select_device

    deepspeed = import_deepspeed()  # the learner's first import of it

    select_device()
    if dist.is_available() and dist.is_initialized():
        return
    if not has_gpu():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    timeout: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    backend = "nccl" if has_gpu() else "gloo"
    if os.environ["WORLD_SIZE"] == "1":
        # A lone process has no peer to meet: its group's store stays in memory. env://
        # would host a TCPStore for it on every interface (`::`, whatever MASTER_ADDR says;
        # torch 2.13, TCPStoreLibUvBackend.cpp), reachable from the network for the whole
        # run; DeepSpeed then adopts the group as it finds it.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    if not has_gpu():
        skip_cpu_shared_memory_op()
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **timeout)


def skip_cpu_shared_memory_op() -> None:
    """Keep DeepSpeed's communication backend from compiling its CPU shared-memory op.

    On the CPU accelerator, DeepSpeed's TorchBackend JIT-compiles `deepspeed_shm_comm` (a C++
    extension, about a minute of compiler time) on the first start on every machine, under a
    lock file in ~/.cache/torch_extensions that torch waits on without a deadline: a learner
    killed during that compile (a Ctrl-C on a first run) leaves the lock, and every later
    learner on the machine hangs before its first step. The op serves only
    `inference_all_reduce`, which the learner never calls (its collectives are
    torch.distributed's), so it is marked incompatible in DeepSpeed's per-process table of
    compatible ops, the table deepspeed.ops keeps so that edits to it persist (DeepSpeed 0.19,
    deepspeed/ops/__init__.py; comm/torch.py's build_shm_op reads it)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def exit_rank(code: int) -> NoReturn:
    """End a rank of a torch.distributed.run group with `code`, skipping interpreter teardown.

    Call it only once the rank's work is done (its last collective behind it, its files
    closed). Left to interpreter exit, gloo's worker threads and the work they still hold are
    torn down with the interpreter, and a rank of a clean run could abort (SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#179291) after everything
    succeeded, which its launcher reports as a failed group; destroying the group first did
    not make it go away. The OS closes the sockets; logs and standard streams are flushed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def offloads_optimizer(spec: GSPOJobSpec) -> bool:
    """Whether the optimizer state and step live on the CPU (ZeRO 1-3 only)."""
    return spec.learner.offload_optimizer and spec.learner.zero_stage > 0


def optimizer_config(spec: GSPOJobSpec, gpu: bool) -> dict[str, Any]:
    """DeepSpeed's optimizer entry: AdamW either way; which implementation it builds
    (DeepSpeedEngine.get_optimizer_configuration) follows from `torch_adam`.

    Offloaded on a GPU machine: DeepSpeedCPUAdam (no `torch_adam`), its vectorised C++ step
    on every core; torch's Adam would step a 30B model's fp32 state on one thread, for
    minutes per update. Everywhere else `torch_adam`: on GPUs without offload torch's
    multi-tensor AdamW on the device (DeepSpeed's FusedAdam would compile a CUDA kernel at
    start-up), and on a CPU-only machine torch's (no C++ op compiled for a tiny run)."""
    alg = spec.algorithm
    params: dict[str, Any] = {
        "lr": alg.learning_rate,
        "betas": [alg.adam_beta1, alg.adam_beta2],
        "eps": 1e-8,
        "weight_decay": alg.weight_decay,
    }
    if not (gpu and offloads_optimizer(spec)):
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def ds_config(spec: GSPOJobSpec, gpu: bool | None = None) -> dict[str, Any]:
    """DeepSpeed config from the spec: one micro-batch per optimizer step, per rank. `gpu`:
    whether the learner runs on GPUs (None: whether this process has one)."""
    alg, learner = spec.algorithm, spec.learner
    zero: dict[str, Any] = {"stage": learner.zero_stage}
    if offloads_optimizer(spec):
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": alg.max_grad_norm,
        "zero_optimization": zero,
        "optimizer": optimizer_config(spec, has_gpu() if gpu is None else gpu),
        "bf16": {"enabled": spec.model.dtype == "bfloat16"},
        "fp16": {"enabled": spec.model.dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.model.dtype == "bfloat16":
        # A mini-batch's gradient sums ~16 micro-batches; in bf16 (8 bits of mantissa) the
        # small ones vanish into the sum. fp32 accumulation: ZeRO-1 takes DeepSpeed's
        # BF16_Optimizer, ZeRO-2/3 fp32 gradient partitions; master weights and Adam state
        # are fp32. Without ZeRO DeepSpeed refuses the mix: validation refuses zeroStage 0.
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def lr_factor(
    update: int, warmup_updates: int, total_updates: int, schedule: str = "constant"
) -> float:
    """The lr multiplier of optimizer update `update` (0-based): (update + 1) / warmup_updates
    during the warm-up (the first update already moves: DeepSpeed's WarmupLR starts at its
    minimum, 0, and would spend the first updates at lr 0), then by `schedule` over the
    updates left: "constant" 1; "linear" from 1 down to 0 at the last update's end;
    "cosine" half a cosine from 1 to 0, as transformers' get_cosine_schedule_with_warmup."""
    if update < warmup_updates:
        return (update + 1) / warmup_updates
    if schedule == "constant":
        return 1.0
    left = max(total_updates - warmup_updates, 1)
    done = min(update - warmup_updates, left) / left  # 0 at the first update after warm-up
    if schedule == "linear":
        return 1.0 - done
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * done))
    raise ValueError(f"unknown lr schedule {schedule!r}; valid: constant, linear, cosine")


def schedule_updates(spec: GSPOJobSpec) -> tuple[int, int]:
    """(warm-up updates, total updates): algorithm.warmupSteps and maxSteps count training
    steps; the scheduler counts optimizer updates, one per mini-batch (every rank steps
    together on each mini-batch's share)."""
    per_step = spec.algorithm.mini_batches
    return spec.algorithm.warmup_steps * per_step, spec.algorithm.max_steps * per_step


def resumed_updates(
    step: int, mini_batches: int, position: int | None, saved_mini_batches: int | None
) -> int:
    """The lr schedule's position on a resume at `step`: the checkpoint's `position` (the
    updates its scheduler counted: under fp16 DeepSpeed does not count an update skipped
    for a loss-scale overflow, so it may trail step x miniBatches, and the run goes on as
    it would have), rescaled when the checkpoint's run made `saved_mini_batches` updates a
    step and the spec now makes `mini_batches`, so the schedule stands at the same share of
    its warm-up and decay as the step does (a checkpoint an earlier release wrote records no
    miniBatches: read off its count when that is a whole number a step); step x miniBatches
    for a checkpoint without a position (an earlier release's, under a constant rate)."""
    if position is None:
        return step * mini_batches
    if saved_mini_batches is None and step > 0 and position % step == 0:
        saved_mini_batches = position // step  # an earlier release's checkpoint: no record
    if saved_mini_batches and saved_mini_batches != mini_batches:
        return round(position * mini_batches / saved_mini_batches)
    return position


def apply_optimizer_settings(engine: Any, spec: GSPOJobSpec, updates: int) -> None:
    """The spec's learning rate, betas, weight decay, gradient clip and schedule position on
    an engine just resumed. torch's Optimizer.load_state_dict restores every group's
    hyperparameters, LambdaLR its base rates and position, and DeepSpeed's ZeRO-1/2 and bf16
    optimizers their clip, from the checkpoint: without this, `gspo train` run again on an
    edited job file (a lower learningRate, another adamBeta2) would go on with the old values
    and say nothing. `updates`: the schedule's position (resumed_updates)."""
    alg, scheduler = spec.algorithm, engine.lr_scheduler
    scheduler.last_epoch = updates
    for i, group in enumerate(engine.optimizer.param_groups):
        group["betas"] = (alg.adam_beta1, alg.adam_beta2)
        group["weight_decay"] = alg.weight_decay
        scheduler.base_lrs[i] = alg.learning_rate  # lr = base x factor(updates made)
        group["lr"] = alg.learning_rate * scheduler.lr_lambdas[i](scheduler.last_epoch)
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = alg.max_grad_norm


def _lr_scheduler(spec: GSPOJobSpec) -> Any:
    """A callable deepspeed.initialize turns into the lr scheduler: a LambdaLR, whose state
    (the update count) goes into DeepSpeed's checkpoints and resumes. Built for a constant
    rate too (a factor of 1), so that every checkpoint holds the schedule's position and a
    run resumed under another lrSchedule or warmupSteps finds it."""
    from functools import partial

    import torch

    warmup, total = schedule_updates(spec)
    schedule = spec.algorithm.lr_schedule
    factor = partial(lr_factor, warmup_updates=warmup, total_updates=total, schedule=schedule)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resolve_model_path(spec: GSPOJobSpec, cache_dir: str | None = None) -> str:
    name = spec.model.name
    if name.startswith("builtin:"):
        from gspo_trainer.tiny import materialize

        return str(materialize(name, cache_dir, seed=spec.algorithm.seed))
    return name


# What from_pretrained reads of a Hub repository: config and generation config, safetensors
# weights and their index, tokenizer files, chat template, remote code.
FETCHED = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def fetch_model(spec: GSPOJobSpec, path: str) -> None:
    """A Hub model's files into the local cache, before the load's collectives: from_pretrained
    downloads them before it builds the model, so a rank whose download is slow would keep
    its peers waiting in the first collective of the load (zero.Init's broadcasts, or the
    engine's) on the default group, whose watchdog (NCCL's) ends them after
    ranks.data_timeout_s. Each rank downloads (a pod's ranks share its cache; huggingface_hub
    locks each file, so one fetches it), then the ranks meet on the control group. Nothing
    to do for a local directory, a built-in model, or with HF_HUB_OFFLINE."""
    from huggingface_hub import constants, snapshot_download

    local = path.startswith(("/", ".", "~")) or Path(path).is_dir()  # from_pretrained says why
    if spec.model.name.startswith("builtin:") or local or constants.HF_HUB_OFFLINE:
        return
    snapshot_download(path, revision=spec.model.revision, allow_patterns=FETCHED)


def load_model(spec: GSPOJobSpec, path: str, *, shard: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) from `path`. With `shard` under learner.zeroStage 3 (the learner's
    policy) the model is built and loaded sharded (`_from_pretrained`): each rank keeps its
    own partition of every parameter, and `build_engine` takes it as it is. Otherwise whole
    on this rank (stages 0-2, or a model that generates in process), and a ZeRO-3 engine
    partitions it only when it is built."""
    from transformers import AutoTokenizer

    model = _from_pretrained(spec, path, shard=shard and spec.learner.zero_stage == 3)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer or path, **_hf_kwargs(spec))
    checkpointing = getattr(model, "supports_gradient_checkpointing", False)
    if spec.model.gradient_checkpointing and checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model, tokenizer


def build_reference(spec: GSPOJobSpec, path: str, device: Any) -> tuple[Any, Any]:
    """The KL reference (algorithm.klCoef > 0): the starting policy, loaded again from `path`
    (the weights the run started from, whatever a resume later restores into the policy),
    frozen and in eval mode. Returns (model, engine). Under ZeRO-3 it is loaded sharded and
    wrapped in a DeepSpeed engine of its own, ZeRO-3 with no optimizer (as TRL and OpenRLHF
    prepare theirs), whose hooks gather each layer for its forward and free it after: keep
    the engine alive, its hooks go with it. Under stages 0-2 a whole copy on `device`, and no
    engine."""
    shard = spec.learner.zero_stage == 3
    model = _from_pretrained(spec, path, shard=shard)
    model.config.use_cache = False
    model.requires_grad_(False).eval()
    if not shard:
        return model.to(device), None
    import deepspeed

    _prepare_zero3(model)
    engine, *_ = deepspeed.initialize(model=model, config=reference_ds_config(spec))
    engine.eval()
    return engine.module, engine


def reference_ds_config(spec: GSPOJobSpec) -> dict[str, Any]:
    """The KL reference's engine: the policy's precision and ZeRO-3 partitioning, nothing to
    train (no optimizer, no gradient clipping or accumulation dtype, no optimizer offload)."""
    cfg = ds_config(spec)
    for key in ("optimizer", "gradient_clipping", "data_types"):
        cfg.pop(key, None)
    cfg["zero_optimization"] = {"stage": 3}
    return cfg


def _hf_kwargs(spec: GSPOJobSpec) -> dict[str, Any]:
    kw: dict[str, Any] = {"trust_remote_code": spec.model.trust_remote_code}
    if spec.model.revision:
        kw["revision"] = spec.model.revision
    return kw


def _from_pretrained(spec: GSPOJobSpec, path: str, *, shard: bool) -> Any:
    """AutoModelForCausalLM.from_pretrained(path) in spec.model.dtype. With `shard` (ZeRO-3),
    inside `zero3_loading`: transformers builds the model under deepspeed.zero.Init, so every
    parameter is partitioned over the ranks as it is created (never whole on a rank), then,
    `zero3_load.streamed`, fills it a decoder layer at a time (the layer gathered, filled on
    rank 0 from the safetensors file, partitioned again): no rank reads the whole checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_trainer.zero3_load import streamed

    dtype = getattr(torch, spec.model.dtype)
    if not shard:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **_hf_kwargs(spec))
    init_distributed()  # zero.Init partitions over the process group
    with zero3_loading(ds_config(spec)), streamed():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **_hf_kwargs(spec))


@contextlib.contextmanager
def zero3_loading(config: dict[str, Any]) -> Iterator[None]:
    """While open, transformers sees DeepSpeed ZeRO-3 `config` (`is_deepspeed_zero3_enabled`,
    `deepspeed_config`) and builds models under deepspeed.zero.Init with it. transformers
    holds the config by a weak reference, so it is held here while open; on leaving, the
    registration is undone (`unset_hf_deepspeed_config`) and one that was there before is
    put back, so nothing loaded later in the process (a tokenizer, a model at another stage)
    sees ZeRO-3 by accident. `config` is a resolved ds_config (no "auto")."""
    from transformers.integrations import deepspeed as hf_ds

    before = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    held = _hf_ds_config(config)
    try:
        yield
    finally:
        hf_ds.unset_hf_deepspeed_config()
        if before is not None and before() is not None:
            hf_ds.set_hf_deepspeed_config(before())
        del held


def _hf_ds_config(config: dict[str, Any]) -> Any:
    """transformers' HfDeepSpeedConfig around `config`, registered (it builds on accelerate's
    DeepSpeed plugin: accelerate is one of the learner's dependencies for it)."""
    from transformers.integrations import deepspeed as hf_ds

    return hf_ds.HfDeepSpeedConfig(config)


def moe_leaf_classes(model: Any) -> list[type]:
    """Classes of the model's sparse MoE blocks (Qwen2/3-MoE, Mixtral, ...)."""
    seen: dict[str, type] = {}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(("SparseMoeBlock", "SparseMoEBlock")):
            seen[name] = type(module)
    return list(seen.values())


def _prepare_zero3(model: Any) -> None:
    """Before a ZeRO-3 engine is built around `model`: whole MoE blocks as leaf modules, and
    the head scorer (`score_with_head`) with lm_head's weight as its external parameter."""
    import deepspeed

    leaves = moe_leaf_classes(model)
    if leaves:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, leaves)
    head = model.get_output_embeddings()
    model.add_module(HEAD_SCORER, _head_scorer(head))
    deepspeed.zero.register_external_parameter(getattr(model, HEAD_SCORER), head.weight)


def build_engine(spec: GSPOJobSpec, model: Any) -> Any:
    """deepspeed.initialize around `model` (whole, or already partitioned by a sharded
    `load_model`: ZeRO-3 keeps the partitions zero.Init made); returns the engine."""
    import deepspeed

    init_distributed()
    if spec.learner.zero_stage == 3:
        _prepare_zero3(model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=params,
        config=ds_config(spec),
        lr_scheduler=_lr_scheduler(spec),
    )
    # from_pretrained returns the model in eval mode, and transformers recomputes activations
    # (model.gradientCheckpointing) only in training mode: without this it silently kept
    # every activation. The models trained here have no dropout, so nothing else changes.
    engine.train()
    return engine


def begin_forward(engine: Any) -> None:
    """What `engine.forward` does first. The learner runs the base model itself (for hidden
    states, not logits), so it does this too: ZeRO counts the micro-batches of a gradient
    accumulation here (ZeRO-3 would otherwise overwrite, not add, each micro-batch's grads)."""
    clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if clear is not None:
        clear()


HEAD_SCORER = "gspo_head_scorer"


def _head_scorer(head: Any) -> Any:
    import torch

    class HeadScorer(torch.nn.Module):
        """Calls fn(hidden, lm_head.weight, ...) inside a module's forward: ZeRO-3 gathers the
        partitioned weight for it and again for its backward, so the fused, chunked scoring
        serves ZeRO-3 too (no (tokens, vocab) logits)."""

        def __init__(self, head: Any) -> None:
            super().__init__()
            self._head = (head,)  # a reference, not a submodule: the weight stays lm_head's

        def forward(self, fn: Any, hidden: Any, *args: Any, **kw: Any) -> Any:
            return fn(hidden, self._head[0].weight, *args, **kw)

    return HeadScorer(head)


def score_with_head(model: Any, fn: Any, hidden: Any, *args: Any, **kw: Any) -> Any:
    """fn(hidden, lm_head weight, *args, **kw), with the weight gathered under ZeRO-3."""
    scorer = getattr(model, HEAD_SCORER, None)
    if scorer is not None:
        return scorer(fn, hidden, *args, **kw)
    return fn(hidden, lm_head_weight(model), *args, **kw)


def lm_head_weight(model: Any) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the fused policy loss needs an lm_head without bias")
    return head.weight
