"""The spec's cross-field rules, each declared once: `gspo validate` runs its Python side
(`check`, validation.check_spec), the API server its CEL side (`cel`, the CRD's
x-kubernetes-validations, gspo_operator.crd_rules), and tests/contract/test_crd_cel.py keeps
the two in agreement on hand-written and generated specs.

A `Rule` sits on one object of the spec (`at`, "" for the spec itself): its CEL reads that
object as `self`, its `check` reads the whole validated spec. An `ItemRule` sits on each item
of a list (`at` ends in `[]`): its CEL and its `check` both read one item. Either refuses
`field` (below `at`) with `message`, which names the problem and ends with the fix; where
validate can print the values it judged, `said` words the message with them. The CEL is written for
Kubernetes 1.30+ with the standard library and macros only (crd_rules' docstring says why,
and what else it relies on).

Rules that are not here: those the API server cannot see (validation.py says which, and
why, beside each), and the CRD's own (object names, what may change in flight: crd_rules).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic.alias_generators import to_snake

from gspo_api.ports import RESERVED_PORTS
from gspo_api.spec import (
    BUILTIN_MODELS,
    VOLUME_SOURCES,
    EnvVar,
    GSPOJobSpec,
    LearnerConfig,
    RewardFunctionConfig,
    RolloutConfig,
    Volume,
    VolumeMount,
)

T = TypeVar("T")
# The API server's reasons (field.ErrorType); a rule's `reason` says which one it refuses with.
INVALID, FORBIDDEN = "FieldValueInvalid", "FieldValueForbidden"
# Kubernetes escapes a property named like one of these (apiserver/pkg/cel/escaping.go).
CEL_KEYWORDS = frozenset(
    {
        *("true", "false", "null", "in", "as", "break", "const", "continue", "else", "for"),
        *("function", "if", "import", "let", "loop", "package", "namespace", "return", "var"),
        *("void", "while"),
    }
)


def lit(value: str) -> str:
    """A CEL string literal (JSON's double-quoted form is valid CEL)."""
    return json.dumps(value)


def prop(name: str) -> str:
    """A property as CEL reads it (Kubernetes escapes keywords: `function` -> `__function__`)."""
    return f"__{name}__" if name in CEL_KEYWORDS else name


@dataclass(frozen=True)
class Rule:
    """One cross-field rule: where it sits, what it refuses, and the same test said twice."""

    at: str  # the object the CEL rule sits on, from the spec: "algorithm", "model.moe", ""
    field: str  # the field refused, below `at`: "groupSize" ("" for `at` itself)
    cel: str  # the rule for the API server, reading the object at `at` as `self`
    check: Callable[[GSPOJobSpec], bool]  # the same rule in Python: True when it holds
    message: str  # what is wrong and the fix, in words the API server can say
    # validate's words, given the spec and `message` (default: the message as it is).
    said: Callable[[GSPOJobSpec, str], str] | None = None
    message_expression: str | None = None  # CEL saying validate's very words, where it can
    reason: str = INVALID

    def refusals(self, spec: GSPOJobSpec) -> list[tuple[str, str]]:
        """(path below `spec`, validate's message) when `spec` breaks this rule."""
        if self.check(spec):
            return []
        path = ".".join(p for p in (self.at, self.field) if p)
        return [(path, self.said(spec, self.message) if self.said else self.message)]


@dataclass(frozen=True)
class ItemRule(Generic[T]):
    """A rule on each item of a list (`at` ends in `[]`): its CEL and its `check` both read
    one item; validate names the item by its index (`learner.volumes[2].name`)."""

    at: str  # the list's items, from the spec: "reward.functions[]"
    field: str  # the item's field refused ("" for the item itself)
    cel: str  # the rule for the API server, reading one item as `self`
    items: Callable[[GSPOJobSpec], Sequence[T]]  # the list, read off the validated spec
    check: Callable[[T], bool]  # the same rule in Python, on one item: True when it holds
    message: str
    said: Callable[[T, str], str] | None = None  # validate's words, given the item
    message_expression: str | None = None
    reason: str = INVALID

    def refusals(self, spec: GSPOJobSpec) -> list[tuple[str, str]]:
        """(path below `spec`, validate's message) for each item that breaks this rule."""
        listed = self.at.removesuffix("[]")
        return [
            (
                ".".join(p for p in (f"{listed}[{i}]", self.field) if p),
                self.said(item, self.message) if self.said else self.message,
            )
            for i, item in enumerate(self.items(spec))
            if not self.check(item)
        ]


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


# --- what the pods are given: GPUs, the status port --------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"
ROLES = ("learner", "rollout")
_GPUS_ONCE = (
    "GPUs are stated once: remove this entry (the operator sets requests and limits from "
    "gpusPerReplica) or make them equal"
)


def _pods(spec: GSPOJobSpec, role: str) -> LearnerConfig | RolloutConfig:
    return spec.learner if role == "learner" else spec.rollout


def _gpus_agree(pods: LearnerConfig | RolloutConfig, section: str) -> bool:
    """A GPU count under resources equals gpusPerReplica, as text: 8 and "8" agree, "08" not."""
    gpus = getattr(pods.resources, section).get(GPU_RESOURCE)
    return gpus is None or str(gpus) == str(pods.gpus_per_replica)


def _gpu_rule(role: str, section: str) -> Rule:
    gpus = f"self.resources.{section}[{lit(GPU_RESOURCE)}]"
    # An int-or-string: cel-python raises on comparing an int with a string, so test its type.
    as_int, as_text = f"{gpus} == self.gpusPerReplica", f"{gpus} == string(self.gpusPerReplica)"
    same = f"type({gpus}) == int ? {as_int} : {as_text}"
    return Rule(
        at=role,
        field=f"resources.{section}[{GPU_RESOURCE}]",
        cel=f"!({lit(GPU_RESOURCE)} in self.resources.{section}) || ({same})",
        check=lambda s: _gpus_agree(_pods(s, role), section),
        message=f"disagrees with {role}.gpusPerReplica; {_GPUS_ONCE}",
        said=lambda s, _: (
            f"{getattr(_pods(s, role).resources, section)[GPU_RESOURCE]} disagrees with "
            f"{role}.gpusPerReplica={_pods(s, role).gpus_per_replica}; {_GPUS_ONCE}"
        ),
    )


_PORTS = ", ".join(str(p) for p in RESERVED_PORTS)
# Whole messages as the values of a CEL map: constant strings have a known size, printed
# numbers do not (crd_rules' docstring).
_PORT_MESSAGES = ", ".join(
    f"{p}: {lit(f'{p} is used by {who}; pick another')}" for p, who in RESERVED_PORTS.items()
)
POD_RULES = (
    *(_gpu_rule(role, section) for role in ROLES for section in ("requests", "limits")),
    Rule(
        at="metrics",
        field="port",
        cel=f"!(self.port in [{_PORTS}])",
        check=lambda s: s.metrics.port not in RESERVED_PORTS,
        message=f"is a port the pods use already ({_PORTS}); pick another",
        said=lambda s, _: (
            f"{s.metrics.port} is used by {RESERVED_PORTS[s.metrics.port]}; pick another"
        ),
        message_expression=f"{{{_PORT_MESSAGES}}}[self.port]",
    ),
)


# --- reward.sandbox: where model-written programs run ------------------------------------

SANDBOX_POD_FIELDS = ("replicas", "runtimeClassName", "resources")
SANDBOX_ONLY_IN_SERVICE = (
    "is only read when reward.sandbox.mode is service; remove it or set mode: service"
)
SANDBOX_POD_FIELD_LOCAL = (
    "is only read when reward.sandbox.mode is service (the operator then runs the sandbox "
    "pods); remove it or set mode: service"
)
SANDBOX_POD_FIELD_OWN_SERVICE = (
    "is not read when serviceUrl names your own sandbox service (the operator runs no sandbox "
    "pods then); remove it, or remove serviceUrl to have them run"
)
# The operator's pods run under the container runtime's default seccomp profile with every
# capability dropped; containerd's and CRI-O's refuse unshare and namespace-creating clone to
# a process without CAP_SYS_ADMIN, so isolation namespaces cannot start there. A RuntimeClass
# such as gVisor or Kata gives the pod a kernel of its own (docs/rewards.md).
NAMESPACES_NEED_A_RUNTIME = (
    "is needed with isolation: namespaces in the sandbox pods the operator runs: the node's "
    "default seccomp profile refuses the namespaces to a pod without privileges, so every "
    "sandbox pod would fail. Name a RuntimeClass that isolates the pod (e.g. gvisor, kata), "
    "or set reward.sandbox.isolation: none explicitly (programs then share the sandbox pod, "
    "apart from the job, under process limits only)"
)
_CEL_LOCAL = "(!has(self.mode) || self.mode == 'local')"
# The operator runs the sandbox pods: mode service, and no sandbox service of the author's.
_CEL_OPERATOR_PODS = "(has(self.mode) && self.mode == 'service' && !has(self.serviceUrl))"


def _operator_runs_sandbox_pods(spec: GSPOJobSpec) -> bool:
    sandbox = spec.reward.sandbox
    return sandbox.mode == "service" and sandbox.service_url is None


def _sandbox_pod_field_set(spec: GSPOJobSpec, name: str) -> bool:
    return getattr(spec.reward.sandbox, to_snake(name)) is not None


def _sandbox_pod_field_rules(name: str) -> tuple[Rule, Rule]:
    """A setting of the sandbox pods is read only where the operator runs them."""
    field = f"self.{prop(name)}"
    return (
        Rule(
            at="reward.sandbox",
            field=name,
            cel=f"!has({field}) || !{_CEL_LOCAL}",
            check=lambda s: not _sandbox_pod_field_set(s, name) or s.reward.sandbox.mode != "local",
            message=SANDBOX_POD_FIELD_LOCAL,
            reason=FORBIDDEN,
        ),
        Rule(
            at="reward.sandbox",
            field=name,
            cel=f"!has({field}) || !has(self.serviceUrl)",
            check=lambda s: (
                not _sandbox_pod_field_set(s, name) or s.reward.sandbox.service_url is None
            ),
            message=SANDBOX_POD_FIELD_OWN_SERVICE,
            reason=FORBIDDEN,
        ),
    )


SANDBOX_RULES = (
    Rule(
        at="reward.sandbox",
        field="runtimeClassName",
        cel=f"!{_CEL_OPERATOR_PODS} || has(self.runtimeClassName) || "
        "(has(self.isolation) && self.isolation == 'none')",
        check=lambda s: (
            not _operator_runs_sandbox_pods(s)
            or s.reward.sandbox.runtime_class_name is not None
            or s.reward.sandbox.isolation == "none"
        ),
        message=NAMESPACES_NEED_A_RUNTIME,
    ),
    Rule(
        at="reward.sandbox",
        field="serviceUrl",
        cel=f"!has(self.serviceUrl) || !{_CEL_LOCAL}",
        check=lambda s: s.reward.sandbox.service_url is None or s.reward.sandbox.mode != "local",
        message=SANDBOX_ONLY_IN_SERVICE,
        reason=FORBIDDEN,
    ),
    *(rule for name in SANDBOX_POD_FIELDS for rule in _sandbox_pod_field_rules(name)),
)


# --- reward: reward.kind and reward.function, or reward.functions (never both) ------------

REWARD_EXCLUSIVE = "reward.functions replaces reward.kind and reward.function"
REWARD_EXCLUSIVE_FIX = (
    "remove reward.kind and reward.function, or make them an entry of reward.functions "
    "({name, kind, function, weight})"
)
REWARD_CONVENTION_PER_ENTRY = (
    "is only read with reward.function; with reward.functions give each python entry its own "
    "convention"
)
REWARD_NAMES_UNIQUE = "each reward.functions entry needs a name of its own; rename one"
REWARD_PYTHON_NEEDS = "must be 'module:function' when kind is python"
REWARD_TARGET_FIX = (
    "lower targetTokens below algorithm.maxResponseTokens, or the penalty never applies"
)
_CEL_FUNCTION, _CEL_MANY = f"self.{prop('function')}", "has(self.functions)"
_CEL_MODULE_FUNCTION = "matches('(?s)^[^:]+:.+$')"  # as module_function: text, ':', text
_CEL_PYTHON = "(has(self.kind) && self.kind == 'python')"
_CEL_KIND_SAID = "(has(self.kind) ? self.kind : 'math')"


def module_function(path: str | None) -> bool:
    """'module:function' (a python reward's import path): text, a colon, text."""
    module, _, attr = (path or "").partition(":")
    return bool(module and attr)


def _one_reward(spec: GSPOJobSpec) -> bool:
    """reward.kind/function in use (reward.functions not given)."""
    return spec.reward.functions is None


def _repeated_names(spec: GSPOJobSpec) -> list[str]:
    """reward.functions names given to more than one entry, in order."""
    names = [f.name for f in spec.reward.functions or ()]
    return list(dict.fromkeys(n for i, n in enumerate(names) if n in names[:i]))


def _targets_too_long(spec: GSPOJobSpec) -> list[str]:
    """'name: targetTokens N' of the length components whose target a response cannot reach."""
    limit = spec.algorithm.max_response_tokens
    return [
        f"{f.name}: targetTokens {f.target_tokens}"
        for f in spec.reward.functions or ()
        if f.target_tokens is not None and f.target_tokens >= limit
    ]


REWARD_RULES = (
    Rule(
        at="reward",
        field="function",
        cel=f"{_CEL_MANY} || !has(self.kind) || self.kind != 'python' || "
        f"(has({_CEL_FUNCTION}) && {_CEL_FUNCTION}.{_CEL_MODULE_FUNCTION})",
        check=lambda s: (
            not _one_reward(s) or s.reward.kind != "python" or module_function(s.reward.function)
        ),
        message="must be 'module:function' when reward.kind is python",
        said=lambda s, m: f"{s.reward.function or ''!r} {m}",
        message_expression=(
            f"\"'\" + (has({_CEL_FUNCTION}) ? {_CEL_FUNCTION} : '') + \"' must be "
            "'module:function' when reward.kind is python\""
        ),
    ),
    Rule(
        at="reward",
        field="function",
        cel=f"{_CEL_MANY} || {_CEL_PYTHON} || !has({_CEL_FUNCTION})",
        check=lambda s: (
            not _one_reward(s) or s.reward.kind == "python" or s.reward.function is None
        ),
        message="is only read when reward.kind is python",
        said=lambda s, m: f"{m} (it is {s.reward.kind})",
        message_expression=(
            f"'is only read when reward.kind is python (it is ' + {_CEL_KIND_SAID} + ')'"
        ),
        reason=FORBIDDEN,
    ),
    Rule(
        at="reward",
        field="kind",
        cel=f"!{_CEL_MANY} || !has(self.kind)",
        check=lambda s: _one_reward(s) or s.reward.kind is None,
        message=f"{REWARD_EXCLUSIVE}; {REWARD_EXCLUSIVE_FIX}",
        reason=FORBIDDEN,
    ),
    Rule(
        at="reward",
        field="function",
        cel=f"!{_CEL_MANY} || !has({_CEL_FUNCTION})",
        check=lambda s: _one_reward(s) or s.reward.function is None,
        message=f"{REWARD_EXCLUSIVE}; {REWARD_EXCLUSIVE_FIX}",
        reason=FORBIDDEN,
    ),
    Rule(
        at="reward",
        field="convention",
        cel=f"{_CEL_MANY} || {_CEL_PYTHON} || !has(self.convention) || self.convention == 'gspo'",
        check=lambda s: (
            not _one_reward(s) or s.reward.kind == "python" or s.reward.convention == "gspo"
        ),
        message="is only read when reward.kind is python; remove it",
        said=lambda s, _: (
            f"is only read when reward.kind is python (it is {s.reward.kind}); remove it"
        ),
        message_expression=(
            f"'is only read when reward.kind is python (it is ' + {_CEL_KIND_SAID} + '); remove it'"
        ),
        reason=FORBIDDEN,
    ),
    Rule(
        at="reward",
        field="convention",
        cel=f"!{_CEL_MANY} || !has(self.convention) || self.convention == 'gspo'",
        check=lambda s: _one_reward(s) or s.reward.convention == "gspo",
        message=REWARD_CONVENTION_PER_ENTRY,
        reason=FORBIDDEN,
    ),
    Rule(
        at="reward.functions",
        field="",
        cel="self.all(f, self.exists_one(g, g.name == f.name))",
        check=lambda s: not _repeated_names(s),
        message=REWARD_NAMES_UNIQUE,
        said=lambda s, m: (
            f"{', '.join(map(repr, _repeated_names(s)))} "
            f"{'is' if len(_repeated_names(s)) == 1 else 'are'} used twice: {m}"
        ),
    ),
    Rule(
        at="",
        field="reward.functions",
        cel="!has(self.reward) || !has(self.reward.functions) || self.reward.functions.all(f, "
        "!has(f.targetTokens) || f.targetTokens < self.algorithm.maxResponseTokens)",
        check=lambda s: not _targets_too_long(s),
        message=REWARD_TARGET_FIX,
        said=lambda s, m: (
            f"{', '.join(_targets_too_long(s))} {'is' if len(_targets_too_long(s)) == 1 else 'are'}"
            f" not below algorithm.maxResponseTokens ({s.algorithm.max_response_tokens}); {m}"
        ),
    ),
)


def _entries(spec: GSPOJobSpec) -> Sequence[RewardFunctionConfig]:
    return spec.reward.functions or ()


def _read_by(field: str, kind: str) -> ItemRule[RewardFunctionConfig]:
    """A reward.functions entry's field that only one kind of component reads."""
    return ItemRule(
        at="reward.functions[]",
        field=field,
        cel=f"self.kind == '{kind}' || !has(self.{prop(field)})",
        items=_entries,
        check=lambda f: f.kind == kind or getattr(f, to_snake(field)) is None,
        message=f"is only read when kind is {kind}; remove it",
        said=lambda f, m: f"{m} (kind is {f.kind})",
        reason=FORBIDDEN,
    )


REWARD_ENTRY_RULES: tuple[ItemRule[RewardFunctionConfig], ...] = (
    ItemRule(
        at="reward.functions[]",
        field="function",
        cel=f"self.kind != 'python' || (has({_CEL_FUNCTION}) && "
        f"{_CEL_FUNCTION}.{_CEL_MODULE_FUNCTION})",
        items=_entries,
        check=lambda f: f.kind != "python" or module_function(f.function),
        message=REWARD_PYTHON_NEEDS,
        said=lambda f, m: f"{f.function or ''!r}: {m}",
    ),
    ItemRule(
        at="reward.functions[]",
        field="convention",
        cel="self.kind == 'python' || !has(self.convention) || self.convention == 'gspo'",
        items=_entries,
        check=lambda f: f.kind == "python" or f.convention == "gspo",
        message="is only read when kind is python; remove it",
        said=lambda f, m: f"{m} (kind is {f.kind})",
        reason=FORBIDDEN,
    ),
    _read_by("function", "python"),
    _read_by("pattern", "format"),
    _read_by("targetTokens", "length"),
)


# --- the pods' volumes, mounts and env, each item alone ------------------------------------

# Volumes and mount paths of the pod contract (render.py); user volumes may not reuse them.
RESERVED_VOLUMES = ("config", "checkpoints", "dshm", "home", "tmp", "model-cache")
RESERVED_MOUNT_PATHS = ("/etc/gspo", "/checkpoints", "/dev/shm", "/home/gspo", "/tmp")
_ALLOWED_SOURCES = ", ".join(VOLUME_SOURCES)
_CEL_SOURCES = " + ".join(f"(has(self.{s}) ? 1 : 0)" for s in VOLUME_SOURCES)
# ", ".join(the sources set) or "none", as validate words it.
_CEL_SOURCES_SET = " + ".join(
    f"(has(self.{source}) ? "
    f"({' || '.join(f'has(self.{s})' for s in VOLUME_SOURCES[:i]) or 'false'} ? "
    f"{lit(', ' + source)} : {lit(source)}) : '')"
    for i, source in enumerate(VOLUME_SOURCES)
)
_CEL_RESERVED_MOUNT = "|".join(re.escape(p) for p in RESERVED_MOUNT_PATHS)


def mount_point(mount: VolumeMount) -> str:
    """A mountPath without its trailing slashes (`/data/` and `/data` name one mount point)."""
    return mount.mount_path.rstrip("/") or "/"


def _role_item_rules(role: str) -> tuple[ItemRule[Any], ...]:
    volumes: ItemRule[Volume] = ItemRule(
        at=f"{role}.volumes[]",
        field="",
        cel=f"{_CEL_SOURCES} == 1",
        items=lambda s: _pods(s, role).volumes,
        check=lambda v: len(v.sources()) == 1,
        message=f"needs exactly one volume source; allowed: {_ALLOWED_SOURCES}",
        said=lambda v, _: (
            f"needs exactly one volume source (got {', '.join(v.sources()) or 'none'}); "
            f"allowed: {_ALLOWED_SOURCES}"
        ),
        message_expression=(
            f"'needs exactly one volume source (got ' + ({_CEL_SOURCES} == 0 ? 'none' : "
            f"{_CEL_SOURCES_SET}) + '); allowed: {_ALLOWED_SOURCES}'"
        ),
    )
    names: ItemRule[Volume] = ItemRule(
        at=f"{role}.volumes[]",
        field="name",
        cel=f"!(self.name in [{', '.join(lit(v) for v in RESERVED_VOLUMES)}])",
        items=lambda s: _pods(s, role).volumes,
        check=lambda v: v.name not in RESERVED_VOLUMES,
        message="is a volume the operator adds; rename it",
        said=lambda v, m: f"{v.name!r} {m}",
        message_expression='"\'" + self.name + "\' is a volume the operator adds; rename it"',
    )
    mounts: ItemRule[VolumeMount] = ItemRule(
        at=f"{role}.volumeMounts[]",
        field="mountPath",
        cel=f"!self.mountPath.matches({lit(f'^({_CEL_RESERVED_MOUNT})/*$')})",
        items=lambda s: _pods(s, role).volume_mounts,
        check=lambda m: mount_point(m) not in RESERVED_MOUNT_PATHS,
        message="is mounted by the operator; mount somewhere else",
        said=lambda mount, m: f"{mount_point(mount)} {m}",
    )
    env: ItemRule[EnvVar] = ItemRule(
        at=f"{role}.env[]",
        field="",
        cel="!(has(self.value) && has(self.valueFrom))",
        items=lambda s: _pods(s, role).env,
        check=lambda e: e.value is None or e.value_from is None,
        message="sets both value and valueFrom; keep one",
    )
    return volumes, names, mounts, env


POD_ITEM_RULES = tuple(rule for role in ROLES for rule in _role_item_rules(role))

RULES: tuple[Rule | ItemRule[Any], ...] = (
    *SHAPE_RULES,
    *CHECKPOINT_RULES,
    *POD_RULES,
    *POD_ITEM_RULES,
    *SANDBOX_RULES,
    *REWARD_RULES,
    *REWARD_ENTRY_RULES,
)
