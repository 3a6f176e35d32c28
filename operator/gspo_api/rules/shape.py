"""The rules on the run's shape: the algorithm's batch arithmetic, the model, the learner's
ZeRO stage, the rollout servers' tensor parallelism, and the checkpoint claim."""

from __future__ import annotations

from gspo_api.rules.rule import FORBIDDEN, Rule, lit
from gspo_api.spec import BUILTIN_MODELS, GSPOJobSpec


def _responses(spec: GSPOJobSpec) -> int:
    """Responses a step generates: promptsPerStep x groupSize."""
    return spec.algorithm.prompts_per_step * spec.algorithm.group_size


def _learner_processes(spec: GSPOJobSpec) -> int:
    """learner.replicas x gpusPerReplica (one process on a CPU replica)."""
    return spec.learner.replicas * max(spec.learner.gpus_per_replica, 1)


def _per_update(spec: GSPOJobSpec) -> int:
    """Responses in one mini-batch (floor division, as the learner splits them)."""
    return _responses(spec) // spec.algorithm.mini_batches


def _expert_parallel_size(spec: GSPOJobSpec) -> int:
    """model.moe.expertParallelSize (1 for a dense model: no experts to place)."""
    return spec.model.moe.expert_parallel_size if spec.model.moe else 1


# CEL's `/` truncates toward zero where Python's `//` floors: the CEL form floors the same way.
_CEL_RESPONSES = "(self.algorithm.promptsPerStep * self.algorithm.groupSize)"
_CEL_EXACT = f"{_CEL_RESPONSES} >= 0 || {_CEL_RESPONSES} % self.algorithm.miniBatches == 0"
_CEL_PER_UPDATE = (
    f"({_CEL_EXACT} ? {_CEL_RESPONSES} / self.algorithm.miniBatches : "
    f"{_CEL_RESPONSES} / self.algorithm.miniBatches - 1)"
)
_CEL_LEARNER_PROCESSES = (
    "(self.learner.replicas * (self.learner.gpusPerReplica > 0 ? self.learner.gpusPerReplica : 1))"
)
_CEL_LONGEST = "(self.data.maxPromptTokens + self.algorithm.maxResponseTokens)"

# The learner accumulates bf16 gradients in fp32 (engine.ds_config); DeepSpeed 0.19.8 does that
# under ZeRO 1-3 only: without ZeRO its engine refuses the mix (_do_optimizer_sanity_check).
ZERO0_BF16 = (
    "0 cannot train model.dtype bfloat16: bf16 gradients accumulate in fp32, which DeepSpeed "
    "offers under ZeRO stages 1-3 only; set learner.zeroStage to 1 or more, or model.dtype "
    "to float32"
)
_BUILTIN_MODELS = ", ".join(BUILTIN_MODELS)


# --- the algorithm, the model and the learner's and rollout servers' shapes --------------

SHAPE_RULES = (
    Rule(
        at="algorithm",
        field="groupSize",
        cel="self.groupSize >= 2",
        check=lambda s: s.algorithm.group_size >= 2,
        message="leaves every response with zero advantage (advantages compare responses to "
        "the same prompt); set it to 2 or more",
        said=lambda s, m: f"{s.algorithm.group_size} {m}",
    ),
    Rule(
        at="algorithm",
        field="clipLow",
        cel="!has(self.clipLow) || (self.clipLow > 0.0 && self.clipLow < 1.0)",
        check=lambda s: s.algorithm.clip_low is None or 0 < s.algorithm.clip_low < 1,
        message="must be in (0, 1); the paper uses 3e-4 for GSPO",
        said=lambda s, m: f"{s.algorithm.clip_low} {m}",
    ),
    Rule(
        at="algorithm",
        field="clipHigh",
        cel="!has(self.clipHigh) || self.clipHigh > 0.0",
        check=lambda s: s.algorithm.clip_high is None or s.algorithm.clip_high > 0,
        message="must be > 0; the paper uses 4e-4 for GSPO",
        said=lambda s, m: f"{s.algorithm.clip_high} {m}",
    ),
    Rule(
        at="algorithm",
        field="tokenBaseline",
        cel="self.tokenBaseline == 'group' || self.lossLevel == 'gspo-token'",
        check=lambda s: (
            s.algorithm.token_baseline == "group" or s.algorithm.loss_level == "gspo-token"
        ),
        message="position compares per-token rewards, which only lossLevel gspo-token trains "
        "on; set lossLevel to gspo-token or tokenBaseline to group",
        reason=FORBIDDEN,
    ),
    Rule(
        at="algorithm",
        field="miniBatches",
        cel="(self.promptsPerStep * self.groupSize) % self.miniBatches == 0",
        check=lambda s: _responses(s) % s.algorithm.mini_batches == 0,
        message="promptsPerStep x groupSize responses do not split into miniBatches equal "
        "mini-batches; choose a divisor of promptsPerStep x groupSize",
        said=lambda s, _: (
            f"promptsPerStep x groupSize = {_responses(s)} responses do not split into "
            f"{s.algorithm.mini_batches} equal mini-batches; choose a divisor of {_responses(s)}"
        ),
    ),
    Rule(
        at="",
        field="algorithm.promptsPerStep",
        cel=f"{_CEL_PER_UPDATE} == 0 || {_CEL_PER_UPDATE} % {_CEL_LEARNER_PROCESSES} == 0",
        check=lambda s: _per_update(s) == 0 or _per_update(s) % _learner_processes(s) == 0,
        message="each mini-batch's responses (promptsPerStep x groupSize / miniBatches) do not "
        "split evenly over the learner processes (learner.replicas x gpusPerReplica); make "
        "promptsPerStep x groupSize / miniBatches a multiple of it",
        said=lambda s, _: (
            f"each mini-batch holds {_per_update(s)} responses, which do not split evenly over "
            f"{_learner_processes(s)} learner processes (replicas x gpusPerReplica); make "
            "promptsPerStep x groupSize / miniBatches a multiple of it"
        ),
    ),
    Rule(
        at="",
        field="learner.zeroStage",
        cel="self.learner.zeroStage != 0 || self.model.dtype != 'bfloat16'",
        check=lambda s: s.learner.zero_stage != 0 or s.model.dtype != "bfloat16",
        message=ZERO0_BF16,
    ),
    Rule(
        at="model.moe",
        field="expertParallelSize",
        cel="self.expertParallelSize == 1",
        check=lambda s: _expert_parallel_size(s) == 1,
        message="expert parallelism is not available in this release; the learner shards "
        "experts with ZeRO-3 (learner.zeroStage: 3, whole expert blocks gathered as leaf "
        "modules); set it to 1",
        said=lambda s, m: f"{_expert_parallel_size(s)}: {m}",
    ),
    Rule(
        at="model",
        field="name",
        cel="!self.name.startsWith('builtin:') || "
        f"self.name in [{', '.join(lit(m) for m in BUILTIN_MODELS)}]",
        check=lambda s: not s.model.name.startswith("builtin:") or s.model.name in BUILTIN_MODELS,
        message=f"names an unknown built-in model; use one of {_BUILTIN_MODELS}",
        said=lambda s, _: f"unknown built-in model {s.model.name!r}; use one of {_BUILTIN_MODELS}",
        message_expression=(
            f'"unknown built-in model \'" + self.name + "\'; use one of {_BUILTIN_MODELS}"'
        ),
    ),
    Rule(
        at="",
        field="model.maxModelLen",
        cel=f"{_CEL_LONGEST} <= self.model.maxModelLen",
        check=lambda s: (
            s.data.max_prompt_tokens + s.algorithm.max_response_tokens <= s.model.max_model_len
        ),
        message="is shorter than data.maxPromptTokens + algorithm.maxResponseTokens; raise it "
        "or shorten those",
        said=lambda s, _: (
            f"{s.model.max_model_len} is shorter than data.maxPromptTokens + "
            "algorithm.maxResponseTokens = "
            f"{s.data.max_prompt_tokens + s.algorithm.max_response_tokens}; raise it or "
            "shorten those"
        ),
    ),
    Rule(
        at="rollout",
        field="tensorParallelSize",
        cel="self.gpusPerReplica != 0 || self.tensorParallelSize == 1",
        check=lambda s: s.rollout.gpus_per_replica != 0 or s.rollout.tensor_parallel_size == 1,
        message="must be 1 when rollout.gpusPerReplica is 0 (CPU)",
    ),
    Rule(
        at="rollout",
        field="tensorParallelSize",
        cel="self.gpusPerReplica == 0 || self.gpusPerReplica % self.tensorParallelSize == 0",
        check=lambda s: (
            s.rollout.gpus_per_replica == 0
            or s.rollout.gpus_per_replica % s.rollout.tensor_parallel_size == 0
        ),
        message="must divide rollout.gpusPerReplica; each server's GPUs form whole "
        "tensor-parallel groups",
        said=lambda s, _: (
            f"{s.rollout.tensor_parallel_size} must divide rollout.gpusPerReplica "
            f"({s.rollout.gpus_per_replica}); each server's GPUs form whole tensor-parallel "
            "groups"
        ),
    ),
)


# --- the checkpoint claim ----------------------------------------------------------------

_CLAIM = "(has(self.claimName) && self.claimName != '')"
CHECKPOINT_RULES = (
    Rule(
        at="checkpoint",
        field="storageClassName",
        cel=f"!{_CLAIM} || !has(self.storageClassName) || self.storageClassName == ''",
        check=lambda s: not (s.checkpoint.claim_name and s.checkpoint.storage_class_name),
        message="is ignored when checkpoint.claimName names an existing claim; remove one of them",
        reason=FORBIDDEN,
    ),
    Rule(
        at="checkpoint",
        field="claimName",
        cel=f"!{_CLAIM} || !has(self.accessModes) || size(self.accessModes) == 0",
        check=lambda s: not (s.checkpoint.claim_name and s.checkpoint.access_modes),
        message="names an existing claim, so accessModes (a setting of a claim the operator "
        "creates) does not apply; remove it",
    ),
)
