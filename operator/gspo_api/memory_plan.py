"""Per-GPU memory of a GSPOJob, from the model's config.json alone: does the spec fit its GPUs?

`gspo validate` prints the plan and the operator refuses, before any pod starts, a spec whose
learner or rollout servers cannot fit the GPUs it names, with the numbers and the fixes that
would make it fit. Pure arithmetic on a `ModelShape` and the spec: no torch, no weights.

The learner (one rank of learner.replicas x gpusPerReplica), as DeepSpeed 0.19 lays it out
with engine.ds_config (bf16 weights, fp32 master weights, Adam's two fp32 moments, fp32
gradient accumulation; BF16_Optimizer under ZeRO-1, keeping fp32 gradients whole):

    ZeRO   weights   master + Adam   gradients (accumulation dtype)
    0      whole     whole           whole, plus the bf16 .grad of a backward
    1      whole     1/N             whole, plus the bf16 .grad of a backward
    2      whole     1/N             1/N, plus a reduce bucket
    3      1/N       1/N             1/N, plus a reduce bucket; two layers gathered whole

offloadOptimizer moves master weights, Adam and the fp32 gradient partitions to the host.
The KL reference (klCoef > 0) is weights only, sharded like the policy under ZeRO-3. Rank 0
keeps the weight sync's two send buffers. Activations are counted per token of
microBatchTokens, tensor by tensor as autograd saves them in transformers' Qwen3 layers
(RMSNorm upcasts to fp32; flash or memory-efficient attention, no seq x seq term): all layers'
without gradient checkpointing; with it, each layer's input plus one layer recomputed. The
fused loss's gradient of the output head is whole and fp32 on every rank (fused_loss.py).

A rollout server's GPU (one of tensorParallelSize ranks): vLLM takes gpuMemoryUtilization of
the GPU; weights (1/TP of them), its profile run's activations and a runtime reserve come
first, the KV cache gets the rest. vLLM refuses to start when the rest cannot hold one
maxModelLen sequence (refused here too); fewer than maxNumSeqs full-length sequences at once
only queues requests (a note).

Not modelled: memory fragmentation beyond the reserve, the πold / reference forwards (below
the training step's peak), MoE token imbalance (experts' activations at their mean load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gspo_api.chunking import GPU_CHUNK_BYTES_PER_LOGIT, chunk_tokens
from gspo_api.model_shape import (
    ModelConfigError,
    ModelShape,
    find_model_config,
    hub_cache_dir,
)
from gspo_api.spec import GSPOJobSpec

GiB = 2**30
MiB = 2**20
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP32 = 4
# The per-GPU capacity when the spec does not say which GPU: an H100 SXM's 80 GB.
DEFAULT_GPU = ("NVIDIA H100 80GB", 80 * GiB)
# GPU feature discovery's node labels (NVIDIA gpu-feature-discovery): the memory in MiB, and
# the product name (NVIDIA-H100-80GB-HBM3, NVIDIA-A100-SXM4-40GB, NVIDIA-H200...).
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_PRODUCT = "nvidia.com/gpu.product"
PRODUCTS_GIB = {"H200": 141, "B200": 180, "GH200": 96, "H100-NVL": 94, "L40S": 48, "L4": 24}
# CUDA context, NCCL's buffers, the caching allocator's slack: a stated allowance, not measured.
RUNTIME_RESERVE = 2 * GiB
# DeepSpeed's defaults that size buffers (deepspeed/runtime/zero/config.py).
REDUCE_BUCKET_ELEMENTS = 500_000_000
# vLLM's profile run batches this many tokens unless engineArgs sets max_num_batched_tokens.
VLLM_BATCHED_TOKENS = 8192
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int


@dataclass(frozen=True)
class RolePlan:
    """One role's GPU: what it holds, row by row, against what it has."""

    role: str  # "learner" or "rollout"
    title: str
    rows: tuple[Row, ...]
    capacity: int  # bytes this role may use on one GPU
    notes: tuple[str, ...] = ()
    refusal: str | None = None  # why it cannot run (None: it fits)

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    source: str  # where the config.json came from
    params: int
    gpu: str  # the GPU and where its size came from
    roles: tuple[RolePlan, ...] = field(default_factory=tuple)

    def table(self) -> str:
        lines = [
            f"memory plan, per GPU: {self.gpu}",
            f"model {self.model}: {_count(self.params)} parameters (config: {self.source})",
        ]
        for plan in self.roles:
            lines.append(f"{plan.role}: {plan.title}")
            lines += [f"  {r.name:<54} {gib(r.bytes):>10}" for r in plan.rows]
            verdict = "fits" if plan.refusal is None else "DOES NOT FIT"
            lines.append(
                f"  {'total':<54} {gib(plan.total):>10} of {gib(plan.capacity)}: {verdict}"
            )
            lines += [f"  note: {n}" for n in plan.notes]
        return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# --- the GPU --------------------------------------------------------------------------------
def gpu_capacity(spec: GSPOJobSpec, override_gib: float | None = None) -> tuple[int, str]:
    """(bytes per GPU, a description saying where the figure came from): `override_gib`, else
    the nodeSelector's GPU feature discovery labels, else DEFAULT_GPU."""
    if override_gib is not None:
        return int(override_gib * GiB), f"{override_gib:g} GiB (--gpu-memory)"
    selector = spec.run_policy.scheduling.node_selector
    where = "spec.runPolicy.scheduling.nodeSelector"
    memory = selector.get(LABEL_MEMORY, "")
    if memory.isdigit():
        return int(memory) * MiB, f"{int(memory) * MiB / GiB:.1f} GiB ({where}[{LABEL_MEMORY}])"
    product = selector.get(LABEL_PRODUCT, "")
    if product:
        sized = re.search(r"(\d+)GB", product)
        known = [g for key, g in PRODUCTS_GIB.items() if key in product.upper()]
        size = int(sized.group(1)) if sized else (max(known) if known else None)
        if size is not None:
            return size * GiB, f"{product}: {size} GiB ({where}[{LABEL_PRODUCT}])"
    name, size = DEFAULT_GPU
    return size, (
        f"{name}: {size / GiB:.0f} GiB, the default (set {where}[{LABEL_PRODUCT}] or "
        f"[{LABEL_MEMORY}] to plan for another GPU)"
    )


# --- the learner ----------------------------------------------------------------------------
def rms_norm_bytes(width: int, b: int) -> int:
    """What transformers' RMSNorm keeps for backward per token: its fp32 upcast input and the
    normalised result cast back (bytes)."""
    return width * (FP32 + b)


def layer_activation_bytes(shape: ModelShape, sparse: bool, b: int) -> int:
    """Bytes one decoder layer keeps for backward per token (without recomputation)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = rms_norm_bytes(shape.hidden, b)  # input norm (its output feeds q/k/v)
    attention += rms_norm_bytes(q + kv, b) if shape.qk_norm else 0  # per-head q/k norms
    attention += b * (q + kv)  # rotated q, k
    attention += b * kv + b * q  # v, the attention output (o_proj's input)
    mlp = rms_norm_bytes(shape.hidden, b)
    if not sparse:
        return attention + mlp + 4 * b * shape.intermediate  # gate, up, silu(gate), product
    mlp += 2 * FP32 * shape.experts  # router logits, their softmax
    per_copy = 2 * b * shape.hidden + 4 * b * shape.expert_intermediate
    mlp += shape.experts_per_token * per_copy + 4 * b * shape.shared_expert_intermediate
    return attention + mlp


def activation_bytes(
    shape: ModelShape, tokens: int, b: int, checkpointing: bool, head_chunk: int
) -> int:
    """Activations of one micro-batch of `tokens` tokens: every layer's (checkpointing off),
    or every layer's input plus one layer recomputed and its gradients (on); plus the
    embeddings' output and the fused loss's chunk of `head_chunk` tokens over the vocabulary
    (logprobs.chunk_tokens sizes it by the GPU)."""
    dense = shape.layers - shape.sparse_layers
    per_layer = [layer_activation_bytes(shape, True, b)] * shape.sparse_layers
    per_layer += [layer_activation_bytes(shape, False, b)] * dense
    if checkpointing:
        body = shape.layers * b * shape.hidden + 2 * max(per_layer)
    else:
        body = sum(per_layer) + max(per_layer)  # and the gradient of the layer in backward
    head = GPU_CHUNK_BYTES_PER_LOGIT * min(tokens, head_chunk) * shape.vocab
    return tokens * (body + rms_norm_bytes(shape.hidden, b) + b * shape.hidden) + head


@dataclass(frozen=True)
class LearnerSetup:
    """What the learner's memory depends on (from the spec; fixes change one of these)."""

    gpus: int
    zero_stage: int
    dtype: str
    offload: bool
    checkpointing: bool
    micro_batch_tokens: int
    reference: bool
    sync_buffers: int  # bytes of rank 0's send buffers
    gpu_bytes: int  # one GPU's memory: the fused loss sizes its chunks by it

    @classmethod
    def of(cls, spec: GSPOJobSpec, gpu_bytes: int) -> LearnerSetup:
        learner = spec.learner
        sync = 0
        if spec.weight_sync.method == "broadcast" and spec.rollout.replicas > 0:
            sync = 2 * spec.weight_sync.bucket_size_mb * MiB
        return cls(
            gpus=learner.replicas * max(learner.gpus_per_replica, 1),
            zero_stage=learner.zero_stage,
            dtype=spec.model.dtype,
            offload=learner.offload_optimizer and learner.zero_stage > 0,
            checkpointing=spec.model.gradient_checkpointing,
            micro_batch_tokens=learner.micro_batch_tokens,
            reference=spec.algorithm.kl_coef > 0,
            sync_buffers=sync,
            gpu_bytes=gpu_bytes,
        )


def learner_rows(shape: ModelShape, s: LearnerSetup) -> tuple[Row, ...]:
    """One learner GPU's memory, row by row (rank 0's: the sync buffers are its own)."""
    P, n, b = shape.params, s.gpus, DTYPE_BYTES[s.dtype]
    accum = FP32 if s.dtype == "bfloat16" else b  # engine.ds_config: fp32 accumulation for bf16
    shard = n if s.zero_stage == 3 else 1
    optimizer_shard = n if s.zero_stage >= 1 else 1
    grad_shard = n if s.zero_stage >= 2 else 1
    rows = [Row(f"weights ({s.dtype}, {_part(shard)})", P * b // shard)]
    if s.zero_stage == 3 and shard > 1:  # on one rank a layer's partition is the layer
        rows.append(
            Row("two layers gathered (running, prefetched)", 2 * shape.largest_layer_params * b)
        )
    on = "on the host" if s.offload else _part(optimizer_shard)
    if b != FP32:
        master = 0 if s.offload else FP32 * P // optimizer_shard
        rows.append(Row(f"fp32 master weights ({on})", master))
    rows.append(
        Row(f"Adam moments, fp32 ({on})", 0 if s.offload else 2 * FP32 * P // optimizer_shard)
    )
    host_grads = s.offload and s.zero_stage >= 2  # ZeRO-2/3 offload moves fp32 grads too
    grads = 0 if host_grads else accum * P // grad_shard
    kind = "fp32" if accum == FP32 else s.dtype
    rows.append(
        Row(f"gradients, {kind} ({'on the host' if host_grads else _part(grad_shard)})", grads)
    )
    if s.zero_stage >= 2:  # allocated whole whatever the model's size (stage3.py, stage_1_and_2.py)
        rows.append(Row("gradient reduce bucket", REDUCE_BUCKET_ELEMENTS * b))
    elif accum != b:
        rows.append(Row(f"{s.dtype} gradients of a backward", P * b))
    if s.reference:
        rows.append(Row(f"KL reference weights ({_part(shard)})", P * b // shard))
    if s.sync_buffers:
        rows.append(Row("weight-sync send buffers (rank 0)", s.sync_buffers))
    tokens = s.micro_batch_tokens
    how = "gradient checkpointing" if s.checkpointing else "no gradient checkpointing"
    rows.append(
        Row(
            f"activations, {tokens} tokens, {how}",
            activation_bytes(
                shape, tokens, b, s.checkpointing, chunk_tokens("cuda", shape.vocab, s.gpu_bytes)
            ),
        )
    )
    # The fused loss computes the output head's gradient in its forward, in fp32 for the whole
    # (vocabulary, hidden) weight, and holds it through the backward, where autograd casts it
    # to the weights' dtype (fused_loss.py): with the body's activations at their peak.
    head_grad = shape.vocab * shape.hidden * (FP32 + (b if b != FP32 else 0))
    rows.append(Row("output head's gradient (fp32, whole; the fused loss)", head_grad))
    rows.append(Row("CUDA context, NCCL, allocator (allowance)", RUNTIME_RESERVE))
    return tuple(rows)


def _part(shards: int) -> str:
    return "whole" if shards == 1 else f"1/{shards}"


def plan_learner(spec: GSPOJobSpec, shape: ModelShape, capacity: int) -> RolePlan | None:
    """The learner's GPU, or None when it runs on CPU (gpusPerReplica 0)."""
    if spec.learner.gpus_per_replica == 0:
        return None
    s = LearnerSetup.of(spec, capacity)
    rows = learner_rows(shape, s)
    pods = f"{spec.learner.replicas} x {spec.learner.gpus_per_replica}"
    title = f"{s.gpus} GPU{'s' if s.gpus > 1 else ''} ({pods}), ZeRO-{s.zero_stage}, {s.dtype}"
    total = sum(r.bytes for r in rows)
    if total <= capacity:
        return RolePlan("learner", title, rows, capacity)
    fixes = learner_fixes(spec, shape, s, capacity)
    refusal = (
        f"the learner needs {gib(total)} per GPU and the GPU has {gib(capacity)} "
        f"({_largest(rows)}); " + fixes
    )
    return RolePlan("learner", title, rows, capacity, refusal=refusal)


def _largest(rows: tuple[Row, ...]) -> str:
    top = sorted(rows, key=lambda r: -r.bytes)[:3]
    return ", ".join(f"{r.name}: {gib(r.bytes)}" for r in top)


def _fits(shape: ModelShape, s: LearnerSetup, capacity: int) -> bool:
    return sum(r.bytes for r in learner_rows(shape, s)) <= capacity


def learner_fixes(spec: GSPOJobSpec, shape: ModelShape, s: LearnerSetup, capacity: int) -> str:
    """The changes of the spec that would make the learner fit, each alone, or else the
    fewest replicas with every memory saving on."""
    per_pod = max(spec.learner.gpus_per_replica, 1)
    out: list[str] = []
    more = _replicas_to_fit(spec, shape, s, capacity)
    if more is not None and s.zero_stage > 0:
        out.append(f"learner.replicas: {more} ({more * per_pod} GPUs)")
    if s.zero_stage < 3 and _fits(shape, replace(s, zero_stage=3), capacity):
        out.append("learner.zeroStage: 3")
    if not s.offload and s.zero_stage > 0 and _fits(shape, replace(s, offload=True), capacity):
        out.append("learner.offloadOptimizer: true")
    if not s.checkpointing and _fits(shape, replace(s, checkpointing=True), capacity):
        out.append("model.gradientCheckpointing: true")
    tokens = s.micro_batch_tokens // 2
    while tokens >= 256 and not _fits(shape, replace(s, micro_batch_tokens=tokens), capacity):
        tokens //= 2
    if tokens >= 256:
        out.append(f"learner.microBatchTokens: {tokens}")
    if out:
        return "any one of these fits: " + "; ".join(out)
    saving = replace(s, zero_stage=3, offload=True, checkpointing=True)
    combined = _replicas_to_fit(spec, shape, saving, capacity)
    if combined is not None:
        return (
            f"nothing alone fits; learner.zeroStage: 3 with offloadOptimizer: true, "
            f"model.gradientCheckpointing: true and learner.replicas: {combined} "
            f"({combined * per_pod} GPUs) fits"
        )
    return "no setting of this spec fits this GPU: use GPUs with more memory"


def _replicas_to_fit(
    spec: GSPOJobSpec, shape: ModelShape, s: LearnerSetup, capacity: int, most: int = 512
) -> int | None:
    """The fewest learner pods (more than now) that fit and over whose processes a
    mini-batch's responses split evenly (as validation requires), or None within `most`."""
    alg, per_pod = spec.algorithm, max(spec.learner.gpus_per_replica, 1)
    responses = alg.prompts_per_step * alg.group_size // alg.mini_batches
    for replicas in range(s.gpus // per_pod + 1, most + 1):
        gpus = replicas * per_pod
        if responses % gpus == 0 and _fits(shape, replace(s, gpus=gpus), capacity):
            return replicas
    return None


# --- a rollout server -----------------------------------------------------------------------
def plan_rollout(spec: GSPOJobSpec, shape: ModelShape, capacity: int) -> RolePlan | None:
    """One GPU of a vLLM server, or None when no server runs on GPUs."""
    rollout = spec.rollout
    if rollout.replicas == 0 or rollout.gpus_per_replica == 0:
        return None
    args: Mapping[str, Any] = rollout.engine_args
    tp, b = rollout.tensor_parallel_size, DTYPE_BYTES[spec.model.dtype]
    kv_b = 1 if str(args.get("kv_cache_dtype", "auto")) in FP8_KV else b
    budget = int(rollout.gpu_memory_utilization * capacity)
    weights = shape.params * b // tp
    batched = int(args.get("max_num_batched_tokens") or VLLM_BATCHED_TOKENS)
    mlp = (
        shape.experts_per_token * shape.expert_intermediate
        if shape.sparse_layers
        else shape.intermediate
    )
    act = batched * (4 * b * shape.hidden + 4 * b * mlp // tp)
    act += rollout.max_num_seqs * shape.vocab * FP32  # the sampler's fp32 logits
    kv_heads = max(1, shape.kv_heads // tp)  # vLLM replicates kv heads when TP > kv heads
    per_token = 2 * shape.layers * kv_heads * shape.head_dim * kv_b
    max_len = spec.model.max_model_len
    kv_left = budget - weights - act - RUNTIME_RESERVE
    wanted = rollout.max_num_seqs * max_len * per_token
    rows = (
        Row(f"weights ({spec.model.dtype}, 1/{tp})", weights),
        Row(f"activations ({batched} batched tokens, {rollout.max_num_seqs} seqs' logits)", act),
        Row("CUDA context, graphs, allocator (allowance)", RUNTIME_RESERVE),
        Row("KV cache (the rest of the budget)", max(kv_left, 0)),
    )
    title = (
        f"{rollout.replicas} servers x tensor parallel {tp}; gpuMemoryUtilization "
        f"{rollout.gpu_memory_utilization:g} of the GPU"
    )
    at_once = max(kv_left, 0) // max(max_len * per_token, 1)
    notes = (
        f"KV cache for maxNumSeqs x maxModelLen ({rollout.max_num_seqs} x {max_len}) is "
        f"{gib(wanted)} per GPU; the rest holds {at_once} full-length sequences at once, so "
        f"{'all of them fit' if at_once >= rollout.max_num_seqs else 'longer batches queue'}",
    )
    refusal = None
    if kv_left < max_len * per_token:
        one = max_len * per_token
        fixes = [
            f"rollout.tensorParallelSize and gpusPerReplica: {2 * tp}",
            f"model.maxModelLen: {max(int(max_len * max(kv_left, 0) / one), 16)}",
        ]
        if rollout.gpu_memory_utilization < 0.95:
            fixes.append("rollout.gpuMemoryUtilization: 0.95")
        refusal = (
            f"a rollout server's GPU has {gib(budget)} (gpuMemoryUtilization "
            f"{rollout.gpu_memory_utilization:g} of {gib(capacity)}); after weights "
            f"{gib(weights)} and activations {gib(act)} its KV cache cannot hold one "
            f"maxModelLen sequence ({gib(one)}), and vLLM refuses to start; try " + "; ".join(fixes)
        )
    return RolePlan("rollout", title, rows, budget, notes, refusal)


# --- the whole spec -------------------------------------------------------------------------
def plan(
    spec: GSPOJobSpec, shape: ModelShape, source: str, gpu_memory_gib: float | None = None
) -> MemoryPlan:
    capacity, gpu = gpu_capacity(spec, gpu_memory_gib)
    roles = [plan_learner(spec, shape, capacity), plan_rollout(spec, shape, capacity)]
    return MemoryPlan(
        spec.model.name, source, shape.params, gpu, tuple(r for r in roles if r is not None)
    )


def refusals(memory: MemoryPlan) -> list[tuple[str, str]]:
    """(field path, message) for each role that does not fit."""
    return [(f"spec.{r.role}", r.refusal) for r in memory.roles if r.refusal is not None]


def plan_spec(
    spec: GSPOJobSpec, gpu_memory_gib: float | None = None
) -> tuple[MemoryPlan | None, str]:
    """The spec's memory plan, or None and why it was skipped: no config.json for the model
    here (a Hub name neither cached nor shipped), or one without the fields a shape needs."""
    name = spec.model.name
    try:
        found = find_model_config(name, spec.model.revision)
        if found is None:
            return None, (
                f"memory plan skipped: no config.json for {name!r} here (not a built-in model, "
                f"a local directory, in the Hugging Face cache at {hub_cache_dir()}, or among "
                "the shipped model configs)"
            )
        shape = ModelShape.from_config(found[0])
    except ModelConfigError as exc:
        return None, f"memory plan skipped: {exc}"
    return plan(spec, shape, found[1], gpu_memory_gib), ""
