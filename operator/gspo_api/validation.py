"""Turn a raw spec into a GSPOJobSpec or a list of problems that each name a field and a fix.

Used by `gspo validate`, the operator (before any child object exists) and the learner at
start-up, so every entry point refuses the same specs with the same words.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from gspo_api.engine_args import engine_arg_problems
from gspo_api.model_shape import TINY_KINDS
from gspo_api.rules import RESERVED_MOUNT_PATHS, RULES, mount_point
from gspo_api.spec import GSPOJobSpec, PodSettings, SandboxConfig
from gspo_api.tasks import BUILTIN_TASKS


@dataclass(frozen=True)
class Problem:
    path: str  # e.g. "spec.algorithm.groupSize"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """A spec that failed validation; carries every problem, not just the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


class ConfigError(ValueError):
    """The job cannot run as configured, found by the learner once it reads its inputs (a
    data row, prompts too long for the model, a reward that does not import): permanent, so
    the learner exits with ports.INVALID_CONFIG_EXIT_CODE and JobSet does not retry it."""


def parse_spec(raw: Any, *, prefix: str = "spec") -> GSPOJobSpec:
    """Validate `raw` (a manifest's spec mapping); raise SpecError naming every bad field."""
    if not isinstance(raw, dict):
        raise SpecError([Problem(prefix, f"must be a mapping, got {type(raw).__name__}")])
    try:
        spec = GSPOJobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(_pydantic_problems(exc, prefix)) from exc
    problems = check_spec(spec, prefix=prefix)
    if problems:
        raise SpecError(problems)
    return spec


def _routing_replay_problems(spec: GSPOJobSpec) -> list[tuple[str, str]]:
    """What algorithm.routingReplay needs that the spec shows: experts in a built-in model (a
    Hub or local model's config is read by the learner, which refuses it there) and a
    learner pi_old forward to record the experts in."""
    alg, name = spec.algorithm, spec.model.name
    if not alg.routing_replay:
        return []
    out = []
    if name in TINY_KINDS and TINY_KINDS[name].kind == "qwen3":
        out.append(
            (
                "algorithm.routingReplay",
                f"{name} is dense: it has no experts to replay; "
                "use a built-in MoE (e.g. builtin:tiny-qwen3-moe-16e) or set it to false",
            )
        )
    if alg.old_logprob_source == "engine":
        out.append(
            (
                "algorithm.routingReplay",
                "replays the experts the learner's pi_old forward "
                "chose, which oldLogprobSource engine skips (the rollout servers' routing "
                "is not sent back); set oldLogprobSource to learner or routingReplay to "
                "false",
            )
        )
    return out


def _join(prefix: str, loc: tuple[Any, ...]) -> str:
    """spec.a.b[0], with map keys that are not plain names in brackets: requests[nvidia.com/gpu];
    an empty key or one holding a bracket or a quote is quoted as JSON (x["a]b"], x[""]), so
    the path reads one way."""
    path = prefix
    for part in loc:
        plain = isinstance(part, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", part)
        if isinstance(part, str) and (not part or re.search(r'[\[\]"]', part)):
            path += f"[{json.dumps(part)}]"
        else:
            path += f".{part}" if plain else f"[{part}]"
    return path


def _fields_at(loc: tuple[Any, ...]) -> list[str] | None:
    """camelCase field names of the model found by walking `loc` down from GSPOJobSpec."""
    model: type[BaseModel] = GSPOJobSpec
    for part in loc:
        if isinstance(part, int):
            continue
        by_alias = {f.alias or n: f for n, f in model.model_fields.items()}
        field = by_alias.get(str(part))
        if field is None:
            return None
        inner = _model_of(field.annotation)
        if inner is None:
            return None
        model = inner
    return sorted(f.alias or n for n, f in model.model_fields.items())


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _pydantic_problems(exc: ValidationError, prefix: str) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        allowed = _fields_at(loc[:-1]) if err["type"] == "extra_forbidden" else None
        problems.append(Problem(_join(prefix, loc), explain_error(err, allowed)))
    return problems


def _shown(value: Any) -> str:
    """A value as the manifest's author wrote it in YAML, with what kind of value it is."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        return f"{value!r} (a string)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value} (a number)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"


def _plain(value: Any) -> str:
    """A bound from pydantic's context (ge=1, gt=0.0): 1, 0 (not 0.0)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


# pydantic error type -> (what was expected, the fix); `{...}` are filled from the error's ctx.
_EXPLAINED: dict[str, tuple[str, str]] = {
    "int_parsing": ("an integer", "write a whole number such as 8, without quotes"),
    "int_type": ("an integer", "write a whole number such as 8, without quotes"),
    "int_from_float": ("an integer", "write a whole number such as 8, without a fraction"),
    "float_parsing": ("a number", "write a number such as 0.5 or 1e-6, without quotes"),
    "float_type": ("a number", "write a number such as 0.5 or 1e-6, without quotes"),
    "bool_parsing": ("true or false", "write true or false"),
    "bool_type": ("true or false", "write true or false"),
    "string_type": ("a string", 'quote the value, e.g. "8" instead of 8'),
    "dict_type": ("a mapping", "write its keys below it, indented (key: value)"),
    "model_type": ("a mapping", "write its fields below it, indented (field: value)"),
    "model_attributes_type": ("a mapping", "write its fields below it, indented (field: value)"),
    "list_type": ("a list", "write one '- item' per line below it, or [] for none"),
    "literal_error": ("one of {expected}", "use one of those values"),
    "enum": ("one of {expected}", "use one of those values"),
    "greater_than": ("a number greater than {gt}", "raise it above {gt}"),
    "greater_than_equal": ("a number of at least {ge}", "set it to {ge} or more"),
    "less_than": ("a number below {lt}", "lower it below {lt}"),
    "less_than_equal": ("a number of at most {le}", "set it to {le} or less"),
    "string_too_short": ("at least {min_length} character(s)", "fill it in"),
    "string_too_long": ("at most {max_length} characters", "shorten it"),
    "string_pattern_mismatch": ("text matching {pattern}", "change it to match"),
    "too_short": ("at least {min_length} item(s)", "add items"),
    "too_long": ("at most {max_length} item(s)", "remove items"),
}


def explain_error(err: Mapping[str, Any], allowed: Sequence[str] | None = None) -> str:
    """One pydantic error (an item of ValidationError.errors()) in plain words with its fix:
    "expected an integer, got 'abc' (a string); fix: ...". `allowed` lists the field names
    valid beside an unknown field. Pure: the path is the caller's."""
    kind, value = err["type"], err.get("input")
    ctx = {k: _plain(v) for k, v in (err.get("ctx") or {}).items()}
    if kind == "extra_forbidden":
        hint = f"; allowed here: {', '.join(allowed)}" if allowed else ""
        return f"unknown field; remove it or fix its spelling{hint}"
    if kind == "missing":
        return "required field is missing; add it"
    if kind in _EXPLAINED:
        expected, fix = _EXPLAINED[kind]
        try:
            expected, fix = expected.format(**ctx), fix.format(**ctx)
        except (KeyError, IndexError):
            expected = err["msg"].removeprefix("Input should be ")  # an unexpected ctx
        return f"expected {expected}, got {_shown(value)}; fix: {fix}"
    # value_error from the models' own validators already says what is wrong and the fix.
    return f"{err['msg'].removeprefix('Value error, ')} (got {value!r})"


def builtin_task_problems(spec: GSPOJobSpec) -> list[tuple[str, str]]:
    """(field, message) for a data.source or data.evalSource naming no built-in task, and,
    with a built-in model (one token per character, tasks.py), limits too short for the
    task's longest prompt or answer (prompts past data.maxPromptTokens would be left out, an
    answer past algorithm.maxResponseTokens could never be right)."""
    out: list[tuple[str, str]] = []
    data, alg = spec.data, spec.algorithm
    for field, source in (("source", data.source), ("evalSource", data.eval_source)):
        if source and source.startswith("builtin:") and source not in BUILTIN_TASKS:
            tasks = ", ".join(BUILTIN_TASKS)
            out.append((f"data.{field}", f"{source!r} is not a built-in task; use one of {tasks}"))
    if not spec.model.name.startswith("builtin:"):
        return out
    names = dict.fromkeys(s for s in (data.source, data.eval_source) if s in BUILTIN_TASKS)
    for task in map(BUILTIN_TASKS.__getitem__, names):
        prompt, response = task.longest_prompt, task.longest_answer + 1  # the answer, then EOS
        also = "(and model.maxModelLen with it)"
        if data.max_prompt_tokens < prompt:
            message = (
                f"{data.max_prompt_tokens} is shorter than {task.name}'s longest prompt "
                f"({prompt} tokens); raise it to {prompt} {also}"
            )
            out.append(("data.maxPromptTokens", message))
        if alg.max_response_tokens < response:
            message = (
                f"{alg.max_response_tokens} is shorter than {task.name}'s longest answer and "
                f"its EOS ({response} tokens), which could never be right; raise it to "
                f"{response} or more {also}"
            )
            out.append(("algorithm.maxResponseTokens", message))
    return out


def check_spec(spec: GSPOJobSpec, *, prefix: str = "spec") -> list[Problem]:
    """Cross-field rules that no single field can express: the rules' table (gspo_api.rules,
    whose CEL the CRD carries), then what only validate checks. Pure; returns every problem."""
    rollout = spec.rollout
    found = [refusal for rule in RULES for refusal in rule.refusals(spec)]
    # No CEL rule for these: they read the built-in models' and tasks' tables, or (a
    # sandbox's GPUs) are the operator's to refuse; each function's docstring says what.
    found += _routing_replay_problems(spec)
    found += builtin_task_problems(spec)
    found += _sandbox_problems(spec.reward.sandbox)
    out = [Problem(f"{prefix}.{path}", message) for path, message in found]
    for role, pods in (("learner", spec.learner), ("rollout", rollout)):
        out.extend(check_pod_settings(pods, f"{prefix}.{role}"))
    # engineArgs is a map of preserved unknown fields, checked against vLLM's flag table:
    # invisible to CEL.
    engine = [(f"rollout.engineArgs.{k}", m) for k, m in engine_arg_problems(rollout.engine_args)]
    if rollout.gpus_per_replica == 0:
        engine += _cpu_engine_problems(rollout.engine_args, spec.model.max_model_len)
    out.extend(Problem(f"{prefix}.{path}", message) for path, message in engine)
    return out


def _cpu_engine_problems(engine_args: dict[str, Any], max_model_len: int) -> list[tuple[str, str]]:
    """vLLM's CPU build cannot split a seeded prompt over two engine steps (its generator
    cannot rewind: the engine dies), so gspo turns chunked prefill off there
    (serve_command.py): what would split a prompt anyway, or stop a server that cannot
    chunk from starting, is refused."""
    why = "vLLM's CPU build cannot split a seeded prompt over two engine steps"
    out: list[tuple[str, str]] = []
    if engine_args.get("enable_chunked_prefill") is True:
        fix = "remove it (gspo turns it off on CPU) or give the rollout servers GPUs"
        out.append(("enable_chunked_prefill", f"{why} (its engine dies on it): {fix}"))
    threshold = _int_or_none(engine_args.get("long_prefill_token_threshold"))
    if threshold is not None and threshold > 0:
        out.append(("long_prefill_token_threshold", f"{why}, which it makes it do: remove it"))
    budget = _int_or_none(engine_args.get("max_num_batched_tokens"))
    if budget is not None and budget < max_model_len:
        message = (
            f"{budget} is below model.maxModelLen ({max_model_len}): without chunked prefill "
            "(off on CPU rollout servers) vLLM needs a whole prompt in one step; raise it or "
            "remove it"
        )
        out.append(("max_num_batched_tokens", message))
    return [(f"rollout.engineArgs.{key}", message) for key, message in out]


def _int_or_none(value: Any) -> int | None:
    """An engine argument's whole number (engine_args.py has refused other values)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# Volumes and mount paths of the pod contract (render.py); user volumes may not reuse them.
ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")


def check_pod_settings(pods: PodSettings, path: str) -> list[Problem]:
    """What the rules' table cannot say of one role's pods: where a CEL rule on one item
    cannot see its siblings, the CRD's rule sits on the list (crd_rules) and validate names
    the item; env valueFrom and envFrom contents are invisible to CEL (preserved unknown
    fields)."""
    out: list[Problem] = []
    names = [v.name for v in pods.volumes]
    for i, volume in enumerate(pods.volumes):
        if names.count(volume.name) > 1 and names.index(volume.name) != i:
            out.append(
                Problem(
                    f"{path}.volumes[{i}].name", f"{volume.name!r} is used twice; names are unique"
                )
            )
    points = [mount_point(m) for m in pods.volume_mounts]
    for i, mount in enumerate(pods.volume_mounts):
        where = f"{path}.volumeMounts[{i}]"
        if mount.name not in names:
            known = ", ".join(names) or "none declared"
            out.append(
                Problem(
                    f"{where}.name",
                    f"{mount.name!r} is not one of {path}.volumes "
                    f"({known}); declare the volume there",
                )
            )
        # A mount point of the operator's is refused by the table's rule already.
        if points[i] not in RESERVED_MOUNT_PATHS and points.index(points[i]) != i:
            out.append(Problem(f"{where}.mountPath", f"{points[i]} is mounted twice"))
    for i, env in enumerate(pods.env):
        if env.value_from is not None:
            keys = [k for k in env.value_from if k in ENV_SOURCES]
            if len(keys) != 1 or len(env.value_from) != 1:
                out.append(
                    Problem(
                        f"{path}.env[{i}].valueFrom",
                        "needs exactly one of "
                        f"{', '.join(ENV_SOURCES)} (got {sorted(env.value_from)})",
                    )
                )
    for i, source in enumerate(pods.env_from):
        keys = [k for k in source if k in ("configMapRef", "secretRef")]
        if len(keys) != 1 or not (source[keys[0]] or {}).get("name"):
            out.append(
                Problem(
                    f"{path}.envFrom[{i}]",
                    "needs one configMapRef or secretRef with a name, and an optional prefix",
                )
            )
    return out


def _sandbox_problems(sandbox: SandboxConfig) -> list[tuple[str, str]]:
    """GPUs named for the sandbox pods (no CEL rule says it: the operator refuses them).
    Mode service with neither a serviceUrl nor a cluster (`gspo train`) is the learner's
    preflight's to refuse: on a cluster the operator points the learner at the pods it runs."""
    out: list[tuple[str, str]] = []
    for section, values in (sandbox.resources.model_dump() if sandbox.resources else {}).items():
        for name in values:
            if name.endswith("/gpu"):  # render_resources writes GPUs from gpusPerReplica only
                why = "sandbox pods run programs on CPUs and get no GPU; remove it"
                out.append((f"reward.sandbox.resources.{section}[{name}]", why))
    return out
