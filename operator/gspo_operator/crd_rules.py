"""The CRD's CEL rules (x-kubernetes-validations): the API server refuses at `kubectl apply`
what the operator would otherwise accept and then fail with InvalidSpec.

Each rule mirrors one check of `gspo validate` (gspo_api.validation.check_spec,
check_pod_settings, gspo_operator.names.check_job_name), names the same field and ends with
the same fix; `status.MUTABLE_FIELDS` decides which spec fields may change while the job
exists. A `messageExpression` repeats validate's words exactly where it needs only strings the
schema bounds: the API server gives `string(<number>)` an unbounded size and refuses a CRD
whose messageExpression concatenates one (kubernetes/kubernetes#124234), so messages that
would print a number say which fields to compare instead. What CEL cannot see stays the
operator's alone: the cluster's policy (hostPath, restartScope: learner, images, priority
classes), env valueFrom and envFrom contents (preserved unknown fields are invisible to
CEL), quantity syntax, and mount paths that differ only by two or more trailing slashes.

Written for Kubernetes 1.30+ CEL with nothing beyond the standard library and macros (no
Kubernetes extension library, no cel.bind), so that cel-python evaluates every rule in the
tests exactly as written. Kubernetes specifics the rules rely on:
- properties named like CEL keywords are escaped: reward.function is `self.__function__`;
- a null-valued property reads as absent to has(), but an object holding one is unequal even
  to itself, so transition rules compare whole objects only where no nullable field lies
  below (crd.structural keeps `nullable` on model.moe alone) and compare field by field above;
- the root sees only metadata.name of the metadata; the name rules set `optionalOldSelf` and
  pass when an old object exists (names cannot change, and a root rule is never ratcheted, so
  a rule the stored name broke would otherwise block every later patch, finalizers included);
- every list a rule iterates or is declared in has maxItems, and every string a rule scans
  or compares inside a loop has maxLength (gspo_api.spec states the bounds), so the API server
  can bound each rule's cost (tests/contract/cel_cost.py estimates it as the API server does,
  4 bytes a character of maxLength);
- numbers and strings never compare equal (no error), where cel-python raises: the rules
  test the type of an int-or-string before comparing it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from gspo_api.ports import RESERVED_PORTS
from gspo_api.spec import BUILTIN_MODELS, VOLUME_SOURCES
from gspo_api.validation import (
    GPU_RESOURCE,
    NAMESPACES_NEED_A_RUNTIME,
    RESERVED_MOUNT_PATHS,
    RESERVED_VOLUMES,
    REWARD_CONVENTION_PER_ENTRY,
    REWARD_EXCLUSIVE,
    REWARD_EXCLUSIVE_FIX,
    REWARD_NAMES_UNIQUE,
    REWARD_PYTHON_NEEDS,
    REWARD_TARGET_FIX,
    SANDBOX_ONLY_IN_SERVICE,
    SANDBOX_POD_FIELD_LOCAL,
    SANDBOX_POD_FIELD_OWN_SERVICE,
    SANDBOX_POD_FIELDS,
)
from gspo_operator import names
from gspo_operator.status import MUTABLE_FIELDS

Rule = dict[str, Any]
Node = dict[str, Any]

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


def rule(
    expr: str,
    message: str,
    *,
    message_expression: str | None = None,
    field_path: str | None = None,
    reason: str = INVALID,
    optional_old_self: bool = False,
) -> Rule:
    out: Rule = {"rule": expr, "message": message}
    if message_expression:
        out["messageExpression"] = message_expression
    if field_path:
        out["fieldPath"] = field_path
    out["reason"] = reason
    if optional_old_self:
        out["optionalOldSelf"] = True
    return out


def add_rules(root: Node) -> None:
    """Attach every rule to its node of the CRD's openAPIV3Schema (changes `root`)."""
    spec = root["properties"]["spec"]
    sections = spec["properties"]
    _attach(root, [*_name_rules(), *_immutable_rules(spec)])
    _attach(spec, _spec_rules())
    _attach(sections["algorithm"], _algorithm_rules())
    _attach(sections["model"], _model_rules())
    _attach(sections["model"]["properties"]["moe"], _moe_rules())
    _attach(sections["reward"], _reward_rules())
    functions = sections["reward"]["properties"]["functions"]
    _attach(functions, _reward_functions_rules())
    _attach(functions["items"], _reward_function_rules())
    _attach(spec, _reward_target_rules())
    _attach(sections["reward"]["properties"]["sandbox"], _sandbox_rules())
    _attach(sections["checkpoint"], _checkpoint_rules())
    _attach(sections["metrics"], _metrics_rules())
    _attach(sections["rollout"], _rollout_rules())
    for role in ("learner", "rollout"):
        pods = sections[role]
        _attach(pods, _pod_rules(role))
        _attach(pods["properties"]["volumes"]["items"], _volume_rules())
        _attach(pods["properties"]["volumeMounts"]["items"], _mount_rules())
        _attach(pods["properties"]["env"]["items"], _env_rules())


def _attach(node: Node, rules: Iterable[Rule]) -> None:
    node.setdefault("x-kubernetes-validations", []).extend(rules)


# --- metadata.name (names.check_job_name) --------------------------------------------------


def _name_rules() -> list[Rule]:
    name = "self.metadata.name"
    dns = names.DNS_LABEL.pattern
    # The longest pod name JobSet generates: `<job>-learner-0-<L-1>` or `<job>-rollout-<R-1>-0`
    # (names.longest_pod_name; the learner's on a tie, as max() picks the first).
    learner_fixed = len(names.learner_host("", 0)) - 1
    rollout_fixed = len(f"{names.child_job('', names.ROLLOUT, 0)}-0") - 1
    learners, servers = "self.spec.learner.replicas", "self.spec.rollout.replicas"
    learner_len = f"({learner_fixed} + string({learners} - 1).size())"
    rollout_len = f"({servers} > 0 ? {rollout_fixed} + string({servers} - 1).size() : 0)"
    learner_wins = f"{learner_len} >= {rollout_len}"
    suffix = f"({learner_wins} ? {learner_len} : {rollout_len})"
    limit = names.MAX_GENERATED_POD_NAME
    pods = (
        f"<name>{names.learner_host('', 0)[:-3]}-0-<i> and "
        f"<name>{names.child_job('', names.ROLLOUT, 0)[:-2]}-<i>-0"
    )
    return [
        rule(
            f"oldSelf.hasValue() || {name}.matches({lit(dns)})",
            "must be lower-case letters, digits and '-', start with a letter and end with a "
            "letter or digit (it names Services, which are DNS labels)",
            message_expression=(
                f"\"name '\" + {name} + \"' must be lower-case letters, digits and '-', start "
                "with a letter and end with a letter or digit (it names Services, which are "
                'DNS labels)"'
            ),
            field_path=".metadata.name",
            optional_old_self=True,
        ),
        rule(
            f"oldSelf.hasValue() || {name}.size() + {suffix} <= {limit}",
            f"is too long: with spec.learner.replicas and spec.rollout.replicas, JobSet would "
            f"name a pod {pods} with more than {limit} characters (JobSet's limit); shorten "
            "the name",
            field_path=".metadata.name",
            optional_old_self=True,
        ),
    ]


# --- what may change while the job exists (status.MUTABLE_FIELDS) -------------------------

# The operator's rejected_at_creation (status.py): a job refused before any child existed may
# still be fixed by editing it (the operator then starts it), so no field is frozen yet. No
# Created condition: a job that failed after an invalid edit had its children created.
REJECTED_AT_CREATION = (
    "has(oldSelf.status) && has(oldSelf.status.phase) && oldSelf.status.phase == 'Failed' && "
    "has(oldSelf.status.conditions) && oldSelf.status.conditions.exists(c, "
    "c.type == 'InvalidSpec' && has(c.reason) && c.reason == 'InvalidSpec' && "
    "c.status == 'True') && !oldSelf.status.conditions.exists(c, c.type == 'Created')"
)


def _immutable_rules(spec: Node) -> list[Rule]:
    """One transition rule per spec section (`self == oldSelf` on what may not change).

    At the root, because only there the rule sees the status: a job the operator refused at
    creation stays editable. A section holding a mutable field (runPolicy) compares its other
    fields; one holding a nullable field (model) compares field by field.
    """
    mutable = {tuple(f.split(".")) for f in MUTABLE_FIELDS}
    allowed = ", ".join(f"spec.{f}" for f in MUTABLE_FIELDS)
    out = []
    for section, node in spec["properties"].items():
        present = section in spec.get("required", ()) or "default" in node
        terms, fields = _unchanged(node, (section,), mutable, present)
        if not terms:
            continue
        paths = ", ".join(f"spec.{'.'.join(f)}" for f in fields)
        out.append(
            rule(
                f"{REJECTED_AT_CREATION} || ({' && '.join(terms)})",
                f"cannot change {paths} of a job that exists; only {allowed} change in flight; "
                "revert the edit, or delete and re-create the job",
                field_path=f".spec.{section}",
            )
        )
    return out


def _unchanged(
    node: Node, path: tuple[str, ...], mutable: set[tuple[str, ...]], present: bool
) -> tuple[list[str], list[tuple[str, ...]]]:
    """CEL terms saying the value at `path` is unchanged, and the paths they cover."""
    if path in mutable:
        return [], []
    split = any(m[: len(path)] == path for m in mutable) or _nullable_below(node)
    if split and "properties" in node:
        terms: list[str] = []
        covered: list[tuple[str, ...]] = []
        for name, sub in node["properties"].items():
            always = name in node.get("required", ()) or "default" in sub
            t, c = _unchanged(sub, (*path, name), mutable, always and not sub.get("nullable"))
            terms += t
            covered += c
        covered = covered if len(covered) < len(node["properties"]) else [path]
        return terms, covered
    new = "self.spec." + ".".join(prop(p) for p in path)
    old = "oldSelf.spec." + ".".join(prop(p) for p in path)
    if present:
        return [f"{new} == {old}"], [path]
    return [f"has({new}) == has({old}) && (!has({new}) || {new} == {old})"], [path]


def _nullable_below(node: Node) -> bool:
    subs = [*node.get("properties", {}).values()]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            subs.append(node[key])
    return any(s.get("nullable") or _nullable_below(s) for s in subs)


# --- check_spec ----------------------------------------------------------------------------


def _spec_rules() -> list[Rule]:
    alg, learner = "self.algorithm", "self.learner"
    responses = f"({alg}.promptsPerStep * {alg}.groupSize)"
    mini = f"{alg}.miniBatches"
    # validation.py divides with Python's floor division; CEL's `/` truncates toward zero.
    exact = f"{responses} >= 0 || {responses} % {mini} == 0"
    per_update = f"({exact} ? {responses} / {mini} : {responses} / {mini} - 1)"
    world = f"({learner}.replicas * ({learner}.gpusPerReplica > 0 ? {learner}.gpusPerReplica : 1))"
    longest = "(self.data.maxPromptTokens + self.algorithm.maxResponseTokens)"
    return [
        rule(
            f"{per_update} == 0 || {per_update} % {world} == 0",
            "each mini-batch's responses (promptsPerStep x groupSize / miniBatches) do not "
            "split evenly over the learner processes (learner.replicas x gpusPerReplica); make "
            "promptsPerStep x groupSize / miniBatches a multiple of it",
            field_path=".algorithm.promptsPerStep",
        ),
        rule(
            f"{learner}.zeroStage != 0 || self.model.dtype != 'bfloat16'",
            "0 cannot train model.dtype bfloat16: bf16 gradients accumulate in fp32, which "
            "DeepSpeed offers under ZeRO stages 1-3 only; set learner.zeroStage to 1 or more, "
            "or model.dtype to float32",
            field_path=".learner.zeroStage",
        ),
        rule(
            f"{longest} <= self.model.maxModelLen",
            "is shorter than data.maxPromptTokens + algorithm.maxResponseTokens; raise it or "
            "shorten those",
            field_path=".model.maxModelLen",
        ),
    ]


def _algorithm_rules() -> list[Rule]:
    responses = "(self.promptsPerStep * self.groupSize)"
    return [
        rule(
            "self.groupSize >= 2",
            "leaves every response with zero advantage (advantages compare responses to the "
            "same prompt); set it to 2 or more",
            field_path=".groupSize",
        ),
        rule(
            "!has(self.clipLow) || (self.clipLow > 0.0 && self.clipLow < 1.0)",
            "must be in (0, 1); the paper uses 3e-4 for GSPO",
            field_path=".clipLow",
        ),
        rule(
            "!has(self.clipHigh) || self.clipHigh > 0.0",
            "must be > 0; the paper uses 4e-4 for GSPO",
            field_path=".clipHigh",
        ),
        rule(
            f"{responses} % self.miniBatches == 0",
            "promptsPerStep x groupSize responses do not split into miniBatches equal "
            "mini-batches; choose a divisor of promptsPerStep x groupSize",
            field_path=".miniBatches",
        ),
    ]


def _model_rules() -> list[Rule]:
    builtins = ", ".join(lit(m) for m in BUILTIN_MODELS)
    return [
        rule(
            f"!self.name.startsWith('builtin:') || self.name in [{builtins}]",
            f"names an unknown built-in model; use one of {', '.join(BUILTIN_MODELS)}",
            message_expression=(
                f'"unknown built-in model \'" + self.name + '
                f'"\'; use one of {", ".join(BUILTIN_MODELS)}"'
            ),
            field_path=".name",
        )
    ]


def _moe_rules() -> list[Rule]:
    words = (
        "expert parallelism is not available in this release; the learner shards experts "
        "with ZeRO-3 (learner.zeroStage: 3, whole expert blocks gathered as leaf modules); set "
        "it to 1"
    )
    return [rule("self.expertParallelSize == 1", words, field_path=".expertParallelSize")]


def _rollout_rules() -> list[Rule]:
    return [
        rule(
            "self.gpusPerReplica != 0 || self.tensorParallelSize == 1",
            "must be 1 when rollout.gpusPerReplica is 0 (CPU)",
            field_path=".tensorParallelSize",
        ),
        rule(
            "self.gpusPerReplica == 0 || self.gpusPerReplica % self.tensorParallelSize == 0",
            "must divide rollout.gpusPerReplica; each server's GPUs form whole tensor-parallel "
            "groups",
            field_path=".tensorParallelSize",
        ),
    ]


def _reward_rules() -> list[Rule]:
    fn, many = f"self.{prop('function')}", "has(self.functions)"
    exclusive = f"{REWARD_EXCLUSIVE}; {REWARD_EXCLUSIVE_FIX}"
    return [
        rule(
            f"{many} || !has(self.kind) || self.kind != 'python' || "
            f"(has({fn}) && {fn}.matches('(?s)^[^:]+:.+$'))",
            "must be 'module:function' when reward.kind is python",
            message_expression=(
                f"\"'\" + (has({fn}) ? {fn} : '') + \"' must be 'module:function' when "
                'reward.kind is python"'
            ),
            field_path=".function",
        ),
        rule(
            f"{many} || (has(self.kind) && self.kind == 'python') || !has({fn})",
            "is only read when reward.kind is python",
            message_expression=(
                "'is only read when reward.kind is python (it is ' + "
                "(has(self.kind) ? self.kind : 'math') + ')'"
            ),
            field_path=".function",
            reason=FORBIDDEN,
        ),
        rule(f"!{many} || !has(self.kind)", exclusive, field_path=".kind", reason=FORBIDDEN),
        rule(f"!{many} || !has({fn})", exclusive, field_path=".function", reason=FORBIDDEN),
        rule(
            f"{many} || (has(self.kind) && self.kind == 'python') || "
            "!has(self.convention) || self.convention == 'gspo'",
            "is only read when reward.kind is python; remove it",
            message_expression=(
                "'is only read when reward.kind is python (it is ' + "
                "(has(self.kind) ? self.kind : 'math') + '); remove it'"
            ),
            field_path=".convention",
            reason=FORBIDDEN,
        ),
        rule(
            f"!{many} || !has(self.convention) || self.convention == 'gspo'",
            REWARD_CONVENTION_PER_ENTRY,
            field_path=".convention",
            reason=FORBIDDEN,
        ),
    ]


def _sandbox_rules() -> list[Rule]:
    """On reward.sandbox (validation._sandbox_problems): the sandbox pods' settings only where
    the operator runs them, and a RuntimeClass for their namespaces."""
    local = "(!has(self.mode) || self.mode == 'local')"
    pods = "(has(self.mode) && self.mode == 'service' && !has(self.serviceUrl))"
    out = [
        rule(
            f"!{pods} || has(self.runtimeClassName) || "
            "(has(self.isolation) && self.isolation == 'none')",
            NAMESPACES_NEED_A_RUNTIME,
            field_path=".runtimeClassName",
        ),
        rule(
            f"!has(self.serviceUrl) || !{local}",
            SANDBOX_ONLY_IN_SERVICE,
            field_path=".serviceUrl",
            reason=FORBIDDEN,
        ),
    ]
    for name in SANDBOX_POD_FIELDS:
        field = f"self.{prop(name)}"
        out.append(
            rule(
                f"!has({field}) || !{local}",
                SANDBOX_POD_FIELD_LOCAL,
                field_path=f".{name}",
                reason=FORBIDDEN,
            )
        )
        out.append(
            rule(
                f"!has({field}) || !has(self.serviceUrl)",
                SANDBOX_POD_FIELD_OWN_SERVICE,
                field_path=f".{name}",
                reason=FORBIDDEN,
            )
        )
    return out


def _reward_functions_rules() -> list[Rule]:
    """On reward.functions: names are unique."""
    return [rule("self.all(f, self.exists_one(g, g.name == f.name))", REWARD_NAMES_UNIQUE)]


def _reward_function_rules() -> list[Rule]:
    """On each reward.functions entry: what its kind reads, and only that."""
    fn = f"self.{prop('function')}"
    out = [
        rule(
            f"self.kind != 'python' || (has({fn}) && {fn}.matches('(?s)^[^:]+:.+$'))",
            REWARD_PYTHON_NEEDS,
            field_path=".function",
        )
    ]
    out.append(
        rule(
            "self.kind == 'python' || !has(self.convention) || self.convention == 'gspo'",
            "is only read when kind is python; remove it",
            field_path=".convention",
            reason=FORBIDDEN,
        )
    )
    for field, kind in (("function", "python"), ("pattern", "format"), ("targetTokens", "length")):
        out.append(
            rule(
                f"self.kind == '{kind}' || !has(self.{prop(field)})",
                f"is only read when kind is {kind}; remove it",
                field_path=f".{field}",
                reason=FORBIDDEN,
            )
        )
    return out


def _reward_target_rules() -> list[Rule]:
    """At the spec: a length component's targetTokens below algorithm.maxResponseTokens."""
    return [
        rule(
            "!has(self.reward) || !has(self.reward.functions) || self.reward.functions.all(f, "
            "!has(f.targetTokens) || f.targetTokens < self.algorithm.maxResponseTokens)",
            REWARD_TARGET_FIX,
            field_path=".reward.functions",
        )
    ]


def _checkpoint_rules() -> list[Rule]:
    claim = "(has(self.claimName) && self.claimName != '')"
    return [
        rule(
            f"!{claim} || !has(self.storageClassName) || self.storageClassName == ''",
            "is ignored when checkpoint.claimName names an existing claim; remove one of them",
            field_path=".storageClassName",
            reason=FORBIDDEN,
        ),
        rule(
            f"!{claim} || !has(self.accessModes) || size(self.accessModes) == 0",
            "names an existing claim, so accessModes (a setting of a claim the operator "
            "creates) does not apply; remove it",
            field_path=".claimName",
        ),
    ]


def _metrics_rules() -> list[Rule]:
    ports = ", ".join(str(p) for p in RESERVED_PORTS)
    # Whole messages as map values: constant strings have a known size, numbers printed do not.
    said = ", ".join(
        f"{p}: {lit(f'{p} is used by {who}; pick another')}" for p, who in RESERVED_PORTS.items()
    )
    return [
        rule(
            f"!(self.port in [{ports}])",
            f"is a port the pods use already ({ports}); pick another",
            message_expression=f"{{{said}}}[self.port]",
            field_path=".port",
        )
    ]


# --- check_pod_settings, per role ----------------------------------------------------------


def _pod_rules(role: str) -> list[Rule]:
    out = []
    for section in ("requests", "limits"):
        where = f"self.resources.{section}"
        gpus = f"{where}[{lit(GPU_RESOURCE)}]"
        # validate compares str(quantity) with str(gpusPerReplica): 8 and "8" agree, "08" not.
        as_int, as_text = f"{gpus} == self.gpusPerReplica", f"{gpus} == string(self.gpusPerReplica)"
        same = f"(type({gpus}) == int ? {as_int} : {as_text})"
        out.append(
            rule(
                f"!({lit(GPU_RESOURCE)} in {where}) || {same}",
                f"disagrees with {role}.gpusPerReplica; GPUs are stated once: remove this entry "
                "(the operator sets requests and limits from gpusPerReplica) or make them equal",
                field_path=f".resources.{section}['{GPU_RESOURCE}']",
            )
        )
    twice = "self.volumes.filter(v, self.volumes.filter(w, w.name == v.name).size() > 1)"
    undeclared = "self.volumeMounts.filter(m, !self.volumes.exists(v, v.name == m.name))"
    # A trailing slash names the same mount point (validate strips every trailing slash). Two
    # rules, not one comparing every pair three ways: the API server sizes a mountPath at 4
    # bytes a character, and the pairwise rule with its concatenations cost 85% of the
    # per-rule limit; here only the exact comparison is pairwise, the slash appended once per
    # mount and looked up with `in` (cost: the list's size).
    exact = "self.volumeMounts.all(m, self.volumeMounts.exists_one(n, n.mountPath == m.mountPath))"
    paths = "self.volumeMounts.map(n, n.mountPath)"
    slashed = f"!self.volumeMounts.exists(m, m.mountPath + '/' in {paths})"
    return [
        *out,
        rule(
            f"{twice}.size() == 0",
            "a volume name is used twice; names are unique",
            field_path=".volumes",
        ),
        rule(
            f"{undeclared}.size() == 0",
            f"a mount names a volume that is not one of spec.{role}.volumes; declare the "
            "volume there",
            field_path=".volumeMounts",
        ),
        rule(exact, "a mountPath is mounted twice", field_path=".volumeMounts"),
        rule(slashed, "a mountPath is mounted twice", field_path=".volumeMounts"),
    ]


def _volume_rules() -> list[Rule]:
    allowed = ", ".join(VOLUME_SOURCES)
    count = " + ".join(f"(has(self.{s}) ? 1 : 0)" for s in VOLUME_SOURCES)
    # ", ".join(the sources set) or "none", as validate words it.
    got = []
    for i, source in enumerate(VOLUME_SOURCES):
        before = " || ".join(f"has(self.{s})" for s in VOLUME_SOURCES[:i]) or "false"
        got.append(f"(has(self.{source}) ? ({before} ? {lit(', ' + source)} : {lit(source)}) : '')")
    reserved = ", ".join(lit(v) for v in RESERVED_VOLUMES)
    return [
        rule(
            f"{count} == 1",
            f"needs exactly one volume source; allowed: {allowed}",
            message_expression=(
                f"'needs exactly one volume source (got ' + ({count} == 0 ? 'none' : "
                f"{' + '.join(got)}) + '); allowed: {allowed}'"
            ),
        ),
        rule(
            f"!(self.name in [{reserved}])",
            "is a volume the operator adds; rename it",
            message_expression='"\'" + self.name + "\' is a volume the operator adds; rename it"',
            field_path=".name",
        ),
    ]


def _mount_rules() -> list[Rule]:
    reserved = "|".join(re.escape(p) for p in RESERVED_MOUNT_PATHS)
    return [
        rule(
            f"!self.mountPath.matches({lit(f'^({reserved})/*$')})",
            "is mounted by the operator; mount somewhere else",
            field_path=".mountPath",
        )
    ]


def _env_rules() -> list[Rule]:
    return [
        rule(
            "!(has(self.value) && has(self.valueFrom))",
            "sets both value and valueFrom; keep one",
        )
    ]
