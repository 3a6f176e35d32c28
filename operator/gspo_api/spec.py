"""The GSPOJob spec: one set of pydantic models read by the operator, the CRD and the learner.

Nothing here imports torch, so the operator validates a manifest with exactly the models the
learner later reads back from its ConfigMap. Field names are snake_case in Python and
camelCase in manifests (the Kubernetes convention). Defaults are what a user training
Qwen3-30B-A3B on a cluster would start from; `gspo train` overrides them for a laptop.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

API_GROUP = "gspo.dev"
API_VERSION = "v1alpha1"
KIND = "GSPOJob"

LossLevel = Literal["gspo", "gspo-token", "grpo"]
ScaleRewards = Literal["group", "batch", "none"]  # algorithm.scaleRewards (advantages.py)
TokenBaseline = Literal["group", "position"]  # algorithm.tokenBaseline (advantages.py)
OldLogprobSource = Literal["learner", "engine"]
Dtype = Literal["bfloat16", "float16", "float32"]
# model.attnImplementation: transformers' attn_implementation names the learner can run.
AttnImplementation = Literal["sdpa", "flash_attention_2", "flash_attention_3", "eager"]
TrackerName = Literal["tensorboard", "wandb", "mlflow"]  # metrics.reportTo (trackers.py)
# Kubernetes' resource.Quantity, non-negative: 8, "500m", "64Gi", "1e3".
_QUANTITY = re.compile(
    r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?"
)


def _quantity(value: Any) -> Any:
    """One clear error for anything that is not a quantity (not one per union member)."""
    example = 'write it like 8, "500m" or "64Gi"'
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"must be a Kubernetes quantity; {example}")
    valid = value >= 0 if isinstance(value, int) else _QUANTITY.fullmatch(value) is not None
    if not valid:
        raise ValueError(f"{value!r} is not a non-negative Kubernetes quantity; {example}")
    return value


Quantity = Annotated[
    str | int,
    BeforeValidator(_quantity),
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]

# The paper's clip ranges: GSPO's are tiny because the ratio is a per-token geometric mean.
DEFAULT_CLIP = {
    "gspo": (3e-4, 4e-4),
    "gspo-token": (3e-4, 4e-4),
    "grpo": (0.2, 0.27),
}
BUILTIN_MODELS = (
    "builtin:tiny-qwen3-moe",
    "builtin:tiny-qwen3",
    "builtin:small-qwen3-moe",
    "builtin:small-qwen3",
    "builtin:tiny-qwen3-moe-16e",
)
# Bounds on what the CRD's CEL rules iterate or compare (crd_rules.py): the API server refuses a
# CRD whose rules it cannot bound, estimating an unbounded list from the 3 MiB request limit.
# Far above what a pod uses (the operator adds 6 volumes of its own).
MAX_ENV = 256
MAX_VOLUMES = 64
MAX_MOUNT_PATH = 1024
MAX_CONDITIONS = 16  # the status holds one condition per type
MAX_REWARD_FUNCTIONS = 16  # reward.functions: its rules compare every pair of names
MAX_REWARD_NAME = 63
MAX_REWARD_FUNCTION = 256
# reward.sandbox.replicas: `<job>-sandbox-<9>-0` is never longer than the learner's pod name
# `<job>-learner-0-<i>`, so JobSet's name limit (names.longest_pod_name) is unchanged.
MAX_SANDBOX_REPLICAS = 10


class Section(BaseModel):
    """Base for every spec section: camelCase keys, unknown keys are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=False,
    )


class SecretKeySelector(Section):
    name: str = Field(..., min_length=1, description="Secret name (in the job's namespace).")
    key: str = Field(..., min_length=1, description="Key within the Secret.")


class ModelCache(Section):
    claim_name: str = Field(
        ..., min_length=1, description="Existing PersistentVolumeClaim holding the model cache."
    )
    mount_path: str = Field(
        "/models", pattern=r"^/", description="Where pods mount it; HF_HOME points there."
    )
    read_only: bool = Field(
        False, description="Mount it read-only (a cache filled beforehand, shared by many jobs)."
    )


class MoEConfig(Section):
    router_aux_loss_coef: float = Field(
        0.001,
        ge=0,
        description="Weight of the router load-balancing loss added to the policy loss.",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Reserved for expert parallelism; must be 1 in this release (ZeRO-3 shards experts)."
        ),
    )
    report_expert_load: bool = Field(True, description="Export per-expert token load metrics.")


class ModelConfig(Section):
    name: str = Field(
        ...,
        min_length=1,
        description=(
            "HF model name, local path, or a built-in random model: builtin:tiny-qwen3-moe, "
            "builtin:tiny-qwen3 (hidden 64), builtin:small-qwen3-moe, builtin:small-qwen3 "
            "(hidden 128), builtin:tiny-qwen3-moe-16e (hidden 64, 4 layers of 16 experts, "
            "2 routed per token: routing that drifts)."
        ),
    )
    revision: str | None = Field(None, description="HF revision (branch, tag or commit).")
    tokenizer: str | None = Field(None, description="Tokenizer name or path; defaults to name.")
    dtype: Dtype = Field("bfloat16", description="Parameter dtype for training and serving.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model repo.")
    max_model_len: int = Field(
        10240, ge=16, description="Longest prompt plus response, in tokens, served and trained."
    )
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    attn_implementation: AttnImplementation = Field(
        "sdpa",
        description=(
            "Attention kernel of the learner's forward passes (transformers' "
            "attn_implementation). sdpa: PyTorch's scaled-dot-product attention, packed "
            "micro-batches run in rows with a block-diagonal mask. flash_attention_2, "
            "flash_attention_3: the flash-attn package (2.x, or its Hopper build) on the "
            "learner's image and CUDA GPUs; packed micro-batches run as one row through its "
            "varlen kernel with no mask. eager: plain PyTorch, for debugging. The rollout "
            "servers choose their own."
        ),
    )
    moe: MoEConfig | None = Field(
        default_factory=MoEConfig,
        description="Mixture-of-experts settings; ignored for dense models.",
    )
    offline: bool = Field(
        False,
        description=(
            "Never contact the Hugging Face Hub (HF_HUB_OFFLINE=1 on every pod): the model (and "
            "a Hub data set) must be local or already in the cache. Built-in models never "
            "download."
        ),
    )
    hf_token_secret: SecretKeySelector | None = Field(
        None,
        description="Secret key with a Hugging Face token (HF_TOKEN), for gated or private models.",
    )
    cache: ModelCache | None = Field(
        None,
        description="A volume that keeps downloaded models between pods and runs (HF_HOME).",
    )


class DataConfig(Section):
    source: str = Field(
        ...,
        min_length=1,
        description=(
            "jsonl or parquet file, a local HF dataset directory (save_to_disk), a Hugging Face "
            "Hub dataset name (e.g. openai/gsm8k, downloaded once into the HF cache with "
            "HF_TOKEN), or a built-in task: builtin:addition, builtin:sort, builtin:sort3, "
            "builtin:sort-distinct."
        ),
    )
    format: Literal["auto", "jsonl", "parquet", "hf-dataset", "hub", "builtin"] = Field(
        "auto",
        description=(
            "Format of source; auto guesses from the path: a file's extension, a local "
            "directory, else a name like owner/name is a Hub dataset."
        ),
    )
    config: str | None = Field(
        None, description="Configuration of a Hub dataset (load_dataset's name), e.g. main."
    )
    split: str = Field(
        "train",
        description=(
            "Split read from source, for a Hub dataset or a saved DatasetDict (a dictionary "
            "with one split is read whatever its name)."
        ),
    )
    eval_split: str = Field("test", description="Split read from evalSource, like split.")
    prompt_field: str = Field(
        "prompt",
        description=(
            "Row field holding the prompt: text, or a conversation (a list of {role, content} "
            "messages, rendered with the tokenizer's chat template); a dotted path reaches "
            "into nested fields."
        ),
    )
    answer_field: str = Field(
        "answer",
        description=(
            "Row field holding the reference answer; a dotted path reaches into nested fields, "
            "e.g. reward_model.ground_truth for verl's parquet files."
        ),
    )
    chat_template: bool = Field(
        True,
        description=(
            "Wrap text prompts in the tokenizer's chat template (when it has one); a "
            "conversation always goes through it."
        ),
    )
    system_prompt: str | None = Field(
        None,
        description="System message for chat templates (not added to a conversation with one).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra arguments to the chat template, as vLLM's chat_template_kwargs: e.g. "
            "{enable_thinking: false} for Qwen3's non-thinking mode."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    prompt_template: str | None = Field(
        None, description="Python format string applied to the prompt, e.g. '{prompt}\\nAnswer:'."
    )
    shuffle_seed: int = Field(0, description="Seed of the per-epoch shuffle.")
    eval_source: str | None = Field(
        None,
        description=(
            "Held-out evaluation set in the format of source (same fields and templates), "
            "never trained on; needed for algorithm.evalEverySteps with a data set of your own. "
            "builtin:addition evaluates on all of its 100 problems, builtin:sort, "
            "builtin:sort3 and builtin:sort-distinct on 100 held-out ones."
        ),
    )
    max_prompt_tokens: int = Field(
        2048,
        ge=1,
        description="Longer prompts are left out at start, counted in gspo_prompts_dropped_total.",
    )

    @property
    def names_hub_dataset(self) -> bool:
        """Whether source or evalSource may name a Hugging Face Hub dataset (read by its
        spelling alone: the operator cannot see the learner's files). A local path of that
        spelling is read as the path (data.py)."""
        if self.format == "hub":
            return True
        return self.format == "auto" and any(
            looks_like_hub_name(s) for s in (self.source, self.eval_source) if s
        )


# A Hub repository id: "name" or "owner/name" (huggingface_hub's validate_repo_id rules).
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def looks_like_hub_name(source: str) -> bool:
    """`source` is spelled like a Hub dataset id (owner/name), not a file or a builtin."""
    return (
        _HUB_NAME.fullmatch(source) is not None
        and not source.endswith(_FILE_SUFFIXES)
        and ".." not in source
    )


RewardKind = Literal["arithmetic", "positional", "math", "python", "code"]
RewardConvention = Literal["gspo", "trl", "verl"]
_CONVENTION = (
    "How function is called (kind python). gspo: fn(prompt, completion, answer) -> float, "
    "once per response. trl: TRL's reward_funcs, fn(prompts, completions, completion_ids, "
    "**columns) -> list[float | None], once per batch (conversations stay messages; None "
    "scores 0). verl: verl's compute_score(data_source, solution_str, ground_truth, "
    "extra_info) -> float or {score: float}, once per response."
)
RewardComponentKind = Literal[
    "arithmetic", "positional", "math", "python", "code", "format", "length"
]


class CodeConfig(Section):
    """How reward.kind code reads a row's tests and scores a program (code/runner.py)."""

    language: Literal["python"] = Field("python", description="The programs' language.")
    extract: Literal["last-block", "whole"] = Field(
        "last-block",
        description=(
            "last-block: the response's last fenced code block (the whole response when it "
            "has none); whole: the whole response (after any </think>)."
        ),
    )
    tests_field: str = Field(
        "tests",
        min_length=1,
        description=(
            "Row field with stdin/stdout cases, a list of {input, output} (APPS, CodeContests, "
            "LiveCodeBench), or a JSON string of one. A row without it needs testField."
        ),
    )
    test_field: str = Field(
        "test",
        min_length=1,
        description="Row field with assert-style test code appended to the program (MBPP, "
        "HumanEval): it runs after the program, then check(<entryPoint>) when it defines check.",
    )
    entry_point_field: str = Field(
        "entry_point", min_length=1, description="Row field naming the function the test checks."
    )
    scoring: Literal["fraction", "all"] = Field(
        "fraction",
        description="fraction: the share of test cases passed; all: 1 only when every one passes.",
    )
    float_tolerance: float | None = Field(
        None,
        ge=0,
        description=(
            "Output tokens that both parse as numbers match within this absolute or relative "
            "tolerance (contest judges' 1e-6); unset: tokens must be equal."
        ),
    )


class SandboxConfig(Section):
    """Where and how model-written programs run (code/sandbox.py)."""

    isolation: Literal["namespaces", "none"] = Field(
        "namespaces",
        description=(
            "namespaces: each program in its own user, PID, network, mount and IPC namespaces "
            "(no network, its own directory as the only writable place); refused at start "
            "where the machine forbids them. none: resource limits, a process group and a "
            "scrubbed environment only: the program can read what the learner can and reach "
            "the network. Set it only for trusted models."
        ),
    )
    mode: Literal["local", "service"] = Field(
        "local",
        description=(
            "local: programs run in the learner's pod (or process); service: each test case is "
            "sent over HTTP, with the job's token, to sandbox pods the operator runs for the "
            "job (replicas, resources, runtimeClassName), or to the service at serviceUrl."
        ),
    )
    service_url: str | None = Field(
        None,
        max_length=MAX_REWARD_FUNCTION,
        pattern=r"^https?://",
        description=(
            "For mode service: the base URL of a sandbox service you run (code/service.py), "
            "e.g. http://sandbox:8080. Unset on a cluster: the operator runs the sandbox pods."
        ),
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=MAX_SANDBOX_REPLICAS,
        description=(
            "For mode service without serviceUrl: sandbox pods the operator runs (default 1); "
            "the learner sends up to concurrency x replicas test cases at once."
        ),
    )
    runtime_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=(
            "For mode service without serviceUrl: the sandbox pods' RuntimeClass, e.g. gvisor "
            "(a kernel of its own between programs and the node). Unset: the node's default."
        ),
    )
    resources: ResourceRequirements | None = Field(
        None,
        description=(
            "For mode service without serviceUrl: each sandbox pod's requests and limits "
            "(cpu, memory), room for concurrency programs of memoryMib each."
        ),
    )
    concurrency: int = Field(
        4,
        ge=1,
        le=256,
        description=(
            "Programs run at once: in the learner (mode local), or per sandbox pod (mode service)."
        ),
    )
    timeout_seconds: float = Field(
        5.0, gt=0, le=600, description="Wall-clock limit per test case (also its CPU limit)."
    )
    memory_mib: int = Field(
        512, ge=64, le=65536, description="Address-space limit per program, MiB."
    )
    processes: int = Field(16, ge=1, le=4096, description="Processes and threads per program.")
    output_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30, description="stdout or stderr past this is cut off."
    )
    file_bytes: int = Field(
        16 << 20, ge=0, le=1 << 34, description="Largest file a program may write."
    )


class RewardFunctionConfig(Section):
    """One weighted component of the reward (TRL's reward_funcs + reward_weights)."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=MAX_REWARD_NAME,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Unique name: history key reward/<name>, gspo_reward_component{name}.",
    )
    kind: RewardComponentKind = Field(
        ...,
        description=(
            "arithmetic, positional, math, python, code as reward.kind; format: 1 when the "
            "response ended with EOS, is not empty and (with pattern) fully matches pattern, "
            "else 0; length: 0 up to targetTokens response tokens, then linearly down to -1 at "
            "algorithm.maxResponseTokens."
        ),
    )
    function: str | None = Field(
        None, max_length=MAX_REWARD_FUNCTION, description="module:function, for kind python."
    )
    convention: RewardConvention = Field("gspo", description=_CONVENTION)
    weight: float = Field(1.0, description="The reward is the sum of weight x component.")
    pattern: str | None = Field(
        None,
        max_length=MAX_REWARD_FUNCTION,
        description=(
            "For kind format: a regular expression the stripped response must match whole, "
            "e.g. '-?[0-9]+' for builtin:addition (a single answer, then EOS)."
        ),
    )
    target_tokens: int | None = Field(
        None, ge=0, description="For kind length: response tokens allowed before the penalty."
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{value!r} is not a regular expression ({exc})") from exc
        return value


class RewardConfig(Section):
    kind: RewardKind | None = Field(
        None,
        description=(
            "arithmetic: the exact answer, then EOS (builtin:addition); positional: the share "
            "of the answer's positions (each token, then EOS) the response gets right, per "
            "token under lossLevel gspo-token (the builtin:sort tasks); math: boxed/final "
            "answers checked with math-verify; python: the function named in `function`; "
            "code: the response's program run against the row's tests in a sandbox "
            "(reward.code, reward.sandbox). math when neither this nor functions is set; not "
            "with functions."
        ),
    )
    function: str | None = Field(
        None, description="module:function returning a float, for kind python."
    )
    convention: RewardConvention = Field("gspo", description=_CONVENTION)
    functions: list[RewardFunctionConfig] | None = Field(
        None,
        max_length=MAX_REWARD_FUNCTIONS,
        description=(
            "Weighted reward components, instead of kind/function: the reward is the sum of "
            "weight x component, each component logged on its own."
        ),
    )
    timeout_seconds: float = Field(
        10.0, gt=0, description="A reward call that takes longer scores 0 and is counted."
    )
    max_failed_steps: int = Field(
        3,
        ge=0,
        description=(
            "Stop the run (exit 1) once every reward call failed (raised, timed out, or "
            "returned NaN, inf or a value past float32) in this many steps in a row: all-zero "
            "rewards train nothing. 0: never stop."
        ),
    )
    code: CodeConfig = Field(
        default_factory=CodeConfig,
        description="For kind code (or a code component): where the tests are, how to score.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="For kind code (or a code component): how programs are isolated and limited.",
    )

    def scores_code(self) -> bool:
        """Whether a code reward is scored (kind code, or a code component): the sandbox
        settings are read only then."""
        return self.kind == "code" or any(f.kind == "code" for f in self.functions or [])

    @model_validator(mode="after")
    def _fill_kind_default(self) -> RewardConfig:
        if self.kind is None and self.functions is None:
            self.kind = "math"
        return self


class AlgorithmConfig(Section):
    loss_level: LossLevel = Field(
        "gspo",
        description="gspo (sequence ratio), gspo-token (sequence value, token gradient), grpo.",
    )
    group_size: int = Field(16, description="Responses sampled per prompt (G).")
    scale_rewards: ScaleRewards = Field(
        "group",
        description=(
            "What divides each reward less its group's mean, the advantage: group, the "
            "group's standard deviation (the GSPO paper's Eq. 6, TRL's and verl's default); "
            "batch, the whole batch's (PPO Lite); none, nothing (Dr. GRPO), so a group whose "
            "responses score nearly alike moves the policy little instead of as much as any."
        ),
    )
    token_baseline: TokenBaseline = Field(
        "group",
        description=(
            "Under lossLevel gspo-token with a reward that scores each token, what each "
            "token's reward is compared with: group, the mean over the group's responses of "
            "each one's mean token reward; position, the mean reward at the token's position "
            "over the group's responses that reach it, so a step moves only the tokens on "
            "which the responses differ (docs/per-token-rewards.md)."
        ),
    )
    clip_low: float | None = Field(
        None, description="Lower clip epsilon; default 3e-4 for gspo levels, 0.2 for grpo."
    )
    clip_high: float | None = Field(
        None, description="Upper clip epsilon; default 4e-4 for gspo levels, 0.27 for grpo."
    )
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy (beta).")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Entropy bonus: the loss subtracts entropyCoef x the policy's entropy, averaged "
            "over each response's tokens and then over responses (as GSPO averages its "
            "ratio), so a policy keeps sampling alternatives instead of turning "
            "deterministic on a wrong answer; 0 (the default) adds nothing."
        ),
    )
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "Linear learning-rate warm-up, in training steps: update k of the first "
            "warmupSteps x miniBatches runs at lr x (k + 1) / (warmupSteps x miniBatches)."
        ),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description=(
            "Learning rate after the warm-up, over the training steps left to maxSteps: "
            "constant; linear down to 0; cosine (half a cosine) down to 0."
        ),
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(
        0.9, ge=0, lt=1, description="AdamW's decay of its running mean of gradients."
    )
    adam_beta2: float = Field(
        0.999,
        ge=0,
        lt=1,
        description=(
            "AdamW's decay of its running mean of squared gradients, which scales each "
            "parameter's step: 0.999 (torch's and transformers' default) averages about the "
            "last 1,000 updates, 0.95 (OpenRLHF's default) about the last 20, so a step "
            "follows the gradients of the policy as it is now rather than of its first steps."
        ),
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    prompts_per_step: int = Field(64, ge=1, description="Prompts in one rollout batch.")
    mini_batches: int = Field(
        4, ge=1, description="Optimizer updates per rollout batch (the paper uses 4)."
    )
    max_response_tokens: int = Field(8192, ge=1, description="Longest sampled response.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    old_logprob_source: OldLogprobSource = Field(
        "learner",
        description=(
            "learner: recompute pi_old before the first update (the first mini-batch's is its "
            "update's own forward, on the same weights, except on diagnostics steps and with "
            "routingReplay); engine: use rollout logprobs."
        ),
    )
    routing_replay: bool = Field(
        False,
        description=(
            "Routing Replay (the GSPO paper's baseline for GRPO on MoE models): each update's "
            "forward routes every token to the experts the learner's pi_old forward chose for "
            "it, gate weights recomputed by the current router over those experts. For any "
            "lossLevel (the paper uses it with grpo only; gspo needs none); needs a model with "
            "experts and oldLogprobSource learner."
        ),
    )
    max_steps: int = Field(1000, ge=1, description="Training steps (rollout batches).")
    max_staleness: int = Field(
        0,
        ge=0,
        description=(
            "How many steps rollout collection may run ahead of the update (0: synchronous, "
            "each step samples with the weights it updates; 1: the next step's rollouts are "
            "generated while this one updates, one policy version behind). Above 0 the "
            "objective is the decoupled one: clip against the learner's recompute, each "
            "response (each token, where the advantages are per token) weighted by its "
            "importance weight recompute / sampler, truncated at importanceWeightCap."
        ),
    )
    importance_weight_cap: float = Field(
        2.0,
        ge=1,
        description=(
            "Truncation of the importance weight (learner / sampler, the length-normalised "
            "sequence ratio; per token for grpo, and for gspo-token on a per-token reward) "
            "that corrects rollouts sampled by an older policy version: used when "
            "maxStaleness > 0 or weightSync.everySteps > 1."
        ),
    )
    eval_every_steps: int = Field(
        0,
        ge=0,
        description=(
            "Evaluate every N steps and after the last (0: never): greedy accuracy (temperature "
            "0, one answer per prompt) on data.evalSource, by rank 0 through the rollout "
            "servers; with evalMeanAtK, also the mean reward of sampled answers."
        ),
    )
    eval_mean_at_k: int = Field(
        0,
        ge=0,
        description=(
            "At each evaluation also sample k answers per prompt at the training temperature "
            "and report their mean reward as eval_mean_at_k (0: greedy accuracy only, as "
            "verl's validation defaults). k times the generation of the greedy pass: "
            "groupSize shows what training samples."
        ),
    )
    seed: int = Field(0, description="Seed for sampling, shuffling and initialisation.")

    @model_validator(mode="after")
    def _fill_clip_defaults(self) -> AlgorithmConfig:
        low, high = DEFAULT_CLIP[self.loss_level]
        if self.clip_low is None:
            self.clip_low = low
        if self.clip_high is None:
            self.clip_high = high
        return self


class ResourceRequirements(Section):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


_FREE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}  # a pydantic JsonDict


class EnvVar(Section):
    """An environment variable, as in a container: a value, or valueFrom a Secret/ConfigMap."""

    name: str = Field(..., min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        None,
        description="secretKeyRef, configMapKeyRef or fieldRef, as in a container's env.",
        json_schema_extra=_FREE,
    )


class VolumeMount(Section):
    name: str = Field(..., min_length=1, description="A volume of the same pod settings.")
    mount_path: str = Field(
        ..., pattern=r"^/", max_length=MAX_MOUNT_PATH, description="Absolute path in the container."
    )
    read_only: bool = False
    sub_path: str | None = None


# Volume sources a GSPOJob pod may use; hostPath only where the operator's values allow it.
VOLUME_SOURCES = (
    "persistentVolumeClaim",
    "configMap",
    "secret",
    "emptyDir",
    "csi",
    "nfs",
    "projected",
    "ephemeral",
    "hostPath",
)


class Volume(Section):
    """A pod volume: a name and exactly one source, each as in a PodSpec."""

    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    persistent_volume_claim: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    config_map: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    secret: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    empty_dir: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    csi: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    nfs: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    projected: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    ephemeral: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)
    host_path: dict[str, Any] | None = Field(None, json_schema_extra=_FREE)

    def sources(self) -> list[str]:
        """The camelCase names of the sources set (exactly one is valid)."""
        data = self.model_dump(by_alias=True, exclude_none=True)
        return [k for k in VOLUME_SOURCES if k in data]


class PodSettings(Section):
    """What users configure on a role's pods (learner or rollout), beside the fixed contract."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Extra environment variables (value, or valueFrom a Secret or ConfigMap).",
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="configMapRef / secretRef sources of environment variables, as in a container.",
        json_schema_extra={"items": {"type": "object", **_FREE}},
    )
    volumes: list[Volume] = Field(
        default_factory=list, max_length=MAX_VOLUMES, description="Extra pod volumes."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_VOLUMES, description="Where the container mounts them."
    )
    service_account_name: str | None = Field(
        None, description="ServiceAccount of the pods (its token is mounted only when set)."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of Secrets used to pull the image."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")


class LearnerConfig(PodSettings):
    replicas: int = Field(2, ge=1, description="Learner pods (nodes); one process per GPU each.")
    gpus_per_replica: int = Field(8, ge=0, description="GPUs per learner pod; 0 runs on CPU.")
    zero_stage: Literal[0, 1, 2, 3] = Field(3, description="DeepSpeed ZeRO stage.")
    offload_optimizer: bool = Field(False, description="ZeRO optimizer state offload to CPU.")
    micro_batch_tokens: int = Field(
        16384, ge=1, description="Token budget of one forward/backward micro-batch per GPU."
    )
    pack_sequences: bool = Field(
        True,
        description=(
            "Run a micro-batch's responses packed, without padding (verl's "
            "use_remove_padding, TRL's padding_free): each sequence keeps its own position ids "
            "and attends only to itself, and microBatchTokens counts real tokens. With flash "
            "or flex attention a micro-batch is one row of its real tokens; with sdpa or eager "
            "(cost quadratic in a row's length) sequences share rows of the longest one's "
            "length. Saves the padded positions' compute and memory when lengths vary; false "
            "runs rows padded to the longest (a model whose attention cannot isolate packed "
            "sequences runs padded either way)."
        ),
    )
    image: str = Field("ghcr.io/gspo-dev/gspo-learner:0.1.0", description="Learner image.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    shm_size: Quantity = Field("64Gi", description="Size of the memory-backed /dev/shm.")


class RolloutConfig(PodSettings):
    replicas: int = Field(4, ge=0, description="vLLM rollout servers.")
    gpus_per_replica: int = Field(2, ge=0, description="GPUs per server; 0 runs on CPU.")
    tensor_parallel_size: int = Field(2, ge=1, description="vLLM tensor parallel size.")
    image: str = Field("ghcr.io/gspo-dev/gspo-rollout:0.1.0", description="Rollout image.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    backoff_limit: int = Field(
        20,
        ge=0,
        description=(
            "Replacements of each server's pod (its Job's backoffLimit) before the job fails; "
            "a replaced server is synced before it serves, the learner keeps going."
        ),
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM memory share.")
    max_num_seqs: int = Field(256, ge=1, description="vLLM concurrent sequences per server.")
    request_timeout_seconds: float = Field(
        900.0, gt=0, description="A generation request slower than this is retried elsewhere."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra vLLM engine arguments (snake_case keys, each becomes vLLM's own flag), "
            "checked against the pinned vLLM's flags before any pod starts."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class WeightSyncConfig(Section):
    method: Literal["broadcast", "filesystem"] = Field(
        "broadcast",
        description=(
            "broadcast: torch.distributed (NCCL on GPUs, gloo on CPU) from learner rank 0; "
            "filesystem: safetensors on the shared volume, then a reload."
        ),
    )
    bucket_size_mb: int = Field(512, ge=1, description="Flattened bucket size for broadcast.")
    every_steps: int = Field(1, ge=1, description="Sync after every N optimizer steps.")
    timeout_seconds: float = Field(600.0, gt=0, description="A sync slower than this fails.")


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]


class CheckpointConfig(Section):
    claim_name: str | None = Field(
        None, description="Existing PersistentVolumeClaim; otherwise the operator creates one."
    )
    size: Quantity = Field(
        "100Gi",
        description=(
            "Size of the created claim. Plan for `keep` checkpoints of about 16 bytes per "
            "parameter (bf16 weights, fp32 master weights and Adam moments) plus one export."
        ),
    )
    storage_class_name: str | None = Field(None, description="Storage class of the created claim.")
    access_modes: list[AccessMode] | None = Field(
        None,
        description=(
            "Access modes of the created claim; by default ReadWriteOnce when one pod mounts it "
            "(one learner pod, no filesystem weight sync), else ReadWriteMany."
        ),
    )
    retain_claim: bool = Field(
        True,
        description=(
            "Keep the created claim (checkpoints and the exported model) when the job is "
            "deleted, ttlSecondsAfterFinished included, as a StatefulSet keeps its claims; it "
            "is then yours to delete (kubectl delete pvc <job>-checkpoints), or to resume "
            "from with checkpoint.claimName. false: the claim goes with the job. A claim named "
            "by claimName is never deleted by the operator."
        ),
    )
    every_steps: int = Field(50, ge=1, description="Checkpoint every N steps.")
    keep: int = Field(3, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    export_hf: bool = Field(True, description="Export the final policy as HF safetensors.")


class Toleration(Section):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingConfig(Section):
    queue: str | None = Field(None, description="Kueue LocalQueue (kueue.x-k8s.io/queue-name).")
    priority_class_name: str | None = Field(None, description="PriorityClass of every pod.")
    scheduler_name: str | None = Field(None, description="Scheduler of every pod.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(
        None,
        description="Pod affinity, as in a PodSpec.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class RunPolicy(Section):
    backoff_limit: int = Field(
        3,
        ge=0,
        description=(
            "Restarts of the job's pods after a learner failure before the job fails (JobSet's "
            "failurePolicy.maxRestarts); disruptions such as preemption are not counted."
        ),
    )
    max_disruption_restarts: int = Field(
        10,
        ge=0,
        description=(
            "Restarts after disruptions (preemption, eviction, node drain or shutdown) before "
            "the job fails with DisruptionLimitExceeded. JobSet does not count them against "
            "backoffLimit, and a kubelet evicting a learner for node memory pressure is a "
            "disruption too, so without this cap such a learner restarts without end. Raise "
            "it on spot or preemptible nodes."
        ),
    )
    restart_scope: Literal["all", "learner"] = Field(
        "all",
        description=(
            "all: a learner failure restarts learner and rollout servers together (stock "
            "JobSet); learner: only the learner group restarts and servers stay warm (needs "
            "JobSet's alpha RestartJob feature gate; the operator refuses it unless told the "
            "cluster has it)."
        ),
    )
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Fail the job after this long running."
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it finished."
    )
    suspend: bool = Field(False, description="Stop pods after a final checkpoint; resume later.")
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)


class MetricsConfig(Section):
    enabled: bool = Field(True, description="Serve Prometheus metrics from every pod.")
    port: int = Field(
        9090,
        ge=1,
        le=65535,
        description=(
            "Learner status port: /metrics, /progress (rank 0) and the /healthz readiness "
            "probe every learner pod serves."
        ),
    )
    pod_monitor: bool = Field(True, description="Create a PodMonitor for the Prometheus Operator.")
    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval.")
    samples_every_steps: int = Field(
        0,
        ge=0,
        description=(
            "Every N steps (0: never) learner rank 0 logs a few prompts with their responses, "
            "rewards and advantages, and keeps them in history.jsonl under samples."
        ),
    )
    samples_per_log: int = Field(4, ge=1, description="Samples shown each samplesEverySteps.")
    diagnostics_every_steps: int = Field(
        10,
        ge=0,
        description=(
            "At step 1 and every N steps (0: never) the learner measures on the first "
            "mini-batch what needs its own extra work: the engine-learner log-prob mismatch "
            "(a πold forward pass of that mini-batch, which otherwise its update's forward "
            "stands in for, or with algorithm.oldLogprobSource engine none runs) and, "
            "for MoE models, routing drift (a forward after that mini-batch's update)."
        ),
    )
    report_to: list[TrackerName] = Field(
        default_factory=list,
        description=(
            "Experiment trackers learner rank 0 sends each step's history record to "
            "(tensorboard, wandb, mlflow), under the history.jsonl names. Their settings and "
            "secrets come from the learner's env/envFrom (WANDB_API_KEY, WANDB_PROJECT, "
            "MLFLOW_TRACKING_URI, ...); by default they write under the checkpoint volume. "
            "A tracker that fails is counted in gspo_tracker_failures_total, never fatal."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, names: list[str]) -> list[str]:
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} more than once; list each tracker once")
        return names


class GSPOJobSpec(Section):
    model: ModelConfig
    data: DataConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @property
    def hub_offline(self) -> bool:
        """Whether the job's processes run with HF_HUB_OFFLINE=1: when model.offline asks, or
        for a built-in model (built on the spot, nothing to download) unless data.source or
        evalSource may name a Hub dataset, which downloads as the model would."""
        if self.model.offline:
            return True
        return self.model.name.startswith("builtin:") and not self.data.names_hub_dataset

    def to_manifest_dict(self) -> dict[str, Any]:
        """The spec as it appears in a manifest: camelCase keys, defaults filled in."""
        return self.model_dump(mode="json", by_alias=True)


Phase = Literal["Pending", "Blocked", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]


class Condition(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class LearnerFailure(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    restart_attempt: int
    message: str


class GSPOJobStatus(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=MAX_CONDITIONS)
    step: int | None = None
    reward: float | None = None
    last_checkpoint: str | None = None
    restarts: int = 0
    rollout_ready: str | None = Field(None, description="Ready rollout servers, e.g. 3/4.")
    policy_version: int | None = None
    server_versions: dict[str, int | None] | None = Field(
        None, description="Policy version each rollout server holds, by server URL."
    )
    learner_failure: LearnerFailure | None = Field(
        None,
        description=(
            "The newest failed learner pods' words and their group (JobSet's restart "
            "attempt), kept so a restart is reported with them after JobSet deletes the pods."
        ),
    )
    start_time: str | None = None
    completion_time: str | None = None
    observed_generation: int | None = None
