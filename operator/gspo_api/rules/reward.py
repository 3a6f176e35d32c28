"""The rules on the reward: reward.sandbox (where model-written programs run), reward.kind
and reward.function or reward.functions (never both), and each reward.functions entry."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic.alias_generators import to_snake

from gspo_api.rules.rule import FORBIDDEN, ItemRule, Rule, prop
from gspo_api.spec import GSPOJobSpec, RewardFunctionConfig

# --- reward.sandbox: where model-written programs run ------------------------------------
# The rules that also read what the reward scores sit on reward, the rest on reward.sandbox.

SANDBOX_POD_FIELDS = ("replicas", "runtimeClassName", "resources")
SANDBOX_NEEDS_CODE = (
    "is only read when a code reward is scored (reward.kind code or a code component); remove it"
)
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
_CEL_LOCAL = "(!has(self.mode) || self.mode == 'local')"  # on reward.sandbox
# On reward: a code reward is scored (RewardConfig.scores_code); mode service.
_CEL_SCORES_CODE = (
    "((has(self.kind) && self.kind == 'code') || "
    "(has(self.functions) && self.functions.exists(f, f.kind == 'code')))"
)
_CEL_SERVICE = "(has(self.sandbox) && has(self.sandbox.mode) && self.sandbox.mode == 'service')"
# On reward: the operator runs the sandbox pods (render.runs_sandbox_pods): a code reward,
# scored in mode service, and no sandbox service of the author's.
_CEL_OPERATOR_PODS = f"({_CEL_SCORES_CODE} && {_CEL_SERVICE} && !has(self.sandbox.serviceUrl))"


def _operator_runs_sandbox_pods(spec: GSPOJobSpec) -> bool:
    sandbox = spec.reward.sandbox
    return spec.reward.scores_code() and sandbox.mode == "service" and sandbox.service_url is None


def _sandbox_pod_field_set(spec: GSPOJobSpec, name: str) -> bool:
    return getattr(spec.reward.sandbox, to_snake(name)) is not None


def _sandbox_pod_field_rules(name: str) -> tuple[Rule, Rule]:
    """A setting of the sandbox pods is read only where the operator runs them: in mode
    service, and there only with no serviceUrl (in mode local the first rule alone speaks:
    removing serviceUrl would not run the pods)."""
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
            cel=f"!has({field}) || !has(self.serviceUrl) || {_CEL_LOCAL}",
            check=lambda s: (
                not _sandbox_pod_field_set(s, name)
                or s.reward.sandbox.service_url is None
                or s.reward.sandbox.mode == "local"
            ),
            message=SANDBOX_POD_FIELD_OWN_SERVICE,
            reason=FORBIDDEN,
        ),
    )


SANDBOX_RULES = (
    Rule(
        at="reward",
        field="sandbox.mode",
        cel=f"{_CEL_SCORES_CODE} || !{_CEL_SERVICE}",
        check=lambda s: s.reward.scores_code() or s.reward.sandbox.mode != "service",
        message=SANDBOX_NEEDS_CODE,
        reason=FORBIDDEN,
    ),
    Rule(  # not where no code reward is scored: the rule above says remove mode
        at="reward",
        field="sandbox.runtimeClassName",
        cel=f"!{_CEL_OPERATOR_PODS} || has(self.sandbox.runtimeClassName) || "
        "(has(self.sandbox.isolation) && self.sandbox.isolation == 'none')",
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
REWARD_ONE_CODE = "reward.code and reward.sandbox serve one; keep one of them"
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


def _code_components(spec: GSPOJobSpec) -> list[str]:
    """The names of the reward.functions entries of kind code, in order."""
    return [f.name for f in spec.reward.functions or () if f.kind == "code"]


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
        at="reward.functions",
        field="",
        cel="self.filter(f, f.kind == 'code').size() <= 1",
        check=lambda s: len(_code_components(s)) <= 1,
        message=f"more than one entry is of kind code, and {REWARD_ONE_CODE}",
        said=lambda s, _: (
            f"{', '.join(map(repr, _code_components(s)))} are of kind code, and {REWARD_ONE_CODE}"
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
