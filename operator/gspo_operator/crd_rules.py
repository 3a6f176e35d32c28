"""The CRD's CEL rules (x-kubernetes-validations): the API server refuses at `kubectl apply`
what the operator would otherwise accept and then fail with InvalidSpec.

The spec's cross-field rules come from their table (gspo_api.rules), where each is declared
once with its Python side. The others written here each mirror one check of `gspo validate`
(gspo_api.validation.check_spec, check_pod_settings, gspo_operator.names.check_job_name),
name the same field and end with the same fix; `status.MUTABLE_FIELDS` decides which spec
fields may change while the job exists. A `messageExpression` repeats validate's words
exactly where it needs only strings the schema bounds: the API server gives
`string(<number>)` an unbounded size and refuses a CRD whose messageExpression concatenates
one (kubernetes/kubernetes#124234), so messages that would print a number say which fields
to compare instead. What CEL cannot see stays the operator's alone: the cluster's policy
(hostPath, restartScope: learner, images, priority classes), env valueFrom and envFrom
contents (preserved unknown fields are invisible to CEL), quantity syntax, and mount paths
that differ only by two or more trailing slashes.

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

import re
from collections.abc import Iterable
from typing import Any

from gspo_api.rules import INVALID, ROLES, RULES, ItemRule, Rule, lit, prop
from gspo_operator import names
from gspo_operator.status import MUTABLE_FIELDS

Validation = dict[str, Any]  # one entry of x-kubernetes-validations
Node = dict[str, Any]


def rule(
    expr: str,
    message: str,
    *,
    message_expression: str | None = None,
    field_path: str | None = None,
    reason: str = INVALID,
    optional_old_self: bool = False,
) -> Validation:
    out: Validation = {"rule": expr, "message": message}
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
    for declared in RULES:
        _attach(_node(spec, declared.at), [_from_table(declared)])
    for role in ROLES:
        _attach(sections[role], _pod_rules(role))


def _attach(node: Node, validations: Iterable[Validation]) -> None:
    node.setdefault("x-kubernetes-validations", []).extend(validations)


def _node(spec: Node, at: str) -> Node:
    """The schema node of `at` ("model.moe", "reward.functions[]"; "" is the spec)."""
    node = spec
    for name in filter(None, at.split(".")):
        node = node["properties"][name.removesuffix("[]")]
        if name.endswith("[]"):
            node = node["items"]
    return node


def _from_table(declared: Rule | ItemRule[Any]) -> Validation:
    """A rule of gspo_api.rules as the API server reads it: its fieldPath is the refused
    field below the node, with map keys quoted (`requests['nvidia.com/gpu']`)."""
    field_path = re.sub(r"\[([^\]]+)\]", r"['\1']", f".{declared.field}")
    return rule(
        declared.cel,
        declared.message,
        message_expression=declared.message_expression,
        field_path=field_path if declared.field else None,
        reason=declared.reason,
    )


# --- metadata.name (names.check_job_name) --------------------------------------------------


def _name_rules() -> list[Validation]:
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


def _immutable_rules(spec: Node) -> list[Validation]:
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


# --- check_pod_settings, per role ----------------------------------------------------------


def _pod_rules(role: str) -> list[Validation]:
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
