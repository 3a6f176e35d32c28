"""What kube-apiserver does with a CRD's schema on a write, with cel-python as the CEL engine.

`admit` is the API stand-in's admission of a custom resource (every write): prune unknown
fields under the request's fieldValidation, prune nulls the schema does not allow, apply the
schema's defaults, validate against the OpenAPI schema (schema_admission.py says how, from
which source, and what not), evaluate every x-kubernetes-validations rule (writes of the main
resource; transition rules against the stored object), and refuse with a Status worded as
kube-apiserver words it. `failures` is the CEL evaluation alone, for tests.

Modelled as in k8s.io/apiextensions-apiserver (schema/cel/validation.go, schema/defaulting)
and k8s.io/apiserver/pkg/cel/common/values.go:
- values are typed by the schema: `number` is always a double, int-or-string stays int or
  string; the root sees apiVersion, kind, metadata.name and metadata.generateName only;
- a null-valued property of an object reads as absent (has() is false); rules on a null value
  do not run; property names that are CEL keywords are escaped (`function` -> `__function__`);
- transition rules run only where an old value correlates (object properties and map values,
  not list items) and are skipped on create; with optionalOldSelf they always run, oldSelf an
  optional (`hasValue()`, `value()`);
- a false rule yields the rule's `reason` (Invalid unless set) at the rule's path plus its
  fieldPath, with its messageExpression's text (its message when that fails); an evaluation
  error yields Invalid "<error> evaluating rule: <message>".
Not modelled: type-checking of rules (cel-python is dynamically typed: a rule that would not
compile in Kubernetes may still run here; the contract tests compile and cost every rule),
runtime cost limits, validation ratcheting (1.30+: unchanged values are not re-validated),
CEL rules on status writes, and access to fields of preserved unknown objects (here they read
as maps; Kubernetes refuses such a rule at CRD creation: the rules never do it).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import schema_admission
from celpy import celtypes

from gspo_operator.crd_rules import prop

Obj = dict[str, Any]
Schema = dict[str, Any]
_ABSENT = object()


@dataclass(frozen=True)
class Failure:
    """One rule that refused a value, as kube-apiserver reports it."""

    field: str  # e.g. spec.algorithm.groupSize
    reason: str  # FieldValueInvalid | FieldValueForbidden | FieldValueRequired
    message: str
    rule: str

    def body(self) -> str:
        """field.Error.ErrorBody(): the cause's message."""
        if self.reason == "FieldValueForbidden":
            return f"Forbidden: {self.message}"
        if self.reason == "FieldValueRequired":
            return f"Required value: {self.message}"
        return f'Invalid value: "object": {self.message}'

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


# --- schema defaults ---------------------------------------------------------------------


def default(schema: Schema, value: Any) -> Any:
    """`value` with nulls the schema does not allow pruned and the schema's defaults filled in,
    top-down as the API server does (a defaulted object gets its fields' defaults too)."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name in out and out[name] is None and not sub.get("nullable"):
                del out[name]
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = default(sub, out[name])
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: default(schema["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [default(schema["items"], v) for v in value]
    return value


# --- values as Kubernetes types them -------------------------------------------------------


def to_cel(value: Any, schema: Schema, *, root: bool = False) -> Any:
    """A JSON value as CEL sees it through `schema` (UnstructuredToVal)."""
    if value is None:
        return None
    if schema.get("x-kubernetes-int-or-string"):
        return celtypes.StringType(value) if isinstance(value, str) else celtypes.IntType(value)
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        fields = schema["properties"]
        if root:  # only these of the metadata (schema.WithTypeAndObjectMeta)
            meta = value.get("metadata") or {}
            value = {
                **value,
                "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta},
            }
            fields = {**fields, "metadata": _META}
        return celtypes.MapType(
            {
                celtypes.StringType(prop(k)): to_cel(v, fields[k])
                for k, v in value.items()
                if k in fields and v is not None  # a null property reads as absent
            }
        )
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        inner = schema["additionalProperties"]
        return celtypes.MapType(
            {celtypes.StringType(k): to_cel(v, inner) for k, v in value.items()}
        )
    if kind == "array":
        return celtypes.ListType([to_cel(v, schema["items"]) for v in value])
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "string":
        return celtypes.StringType(value)
    return celpy.json_to_cel(value)  # preserved unknown fields: compared as a whole only


_META = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
}


class _Optional:
    """oldSelf of an optionalOldSelf rule: CEL's optional type, as far as rules use it."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _has_value(opt: _Optional) -> celtypes.BoolType:
    return celtypes.BoolType(opt.value is not None)


def _value(opt: _Optional) -> Any:
    if opt.value is None:
        raise ValueError("optional.none() dereference")
    return opt.value


_ENV = celpy.Environment()
_FUNCTIONS = {"hasValue": _has_value, "value": _value}


@cache
def program(text: str) -> celpy.Runner:
    """A rule or messageExpression, parsed once (celpy.CELParseError when it is not CEL)."""
    return _ENV.program(_ENV.compile(text), functions=_FUNCTIONS)


def evaluate(text: str, self_value: Any, old_value: Any = _ABSENT) -> Any:
    """One expression with `self` (and `oldSelf`) bound, as CEL values (see `to_cel`)."""
    activation: dict[str, Any] = {"self": self_value}
    if old_value is not _ABSENT:
        activation["oldSelf"] = old_value
    return program(text).evaluate(activation)


# --- walking the schema and the object together -------------------------------------------


def rules_of(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema, Obj]]:
    """(schema path, node, rule) of every rule: paths like `.spec.learner.volumes[]`."""
    for r in schema.get("x-kubernetes-validations", []):
        yield path, schema, r
    for name, sub in schema.get("properties", {}).items():
        yield from rules_of(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from rules_of(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from rules_of(schema["additionalProperties"], f"{path}{{}}")


def uses_old_self(r: Obj) -> bool:
    return re.search(r"\boldSelf\b", r["rule"]) is not None


def failures(schema: Schema, new: Obj, old: Obj | None = None) -> list[Failure]:
    """Every rule of `schema` that refuses `new` (an update of `old` when given)."""
    out: list[Failure] = []
    _walk(schema, new, old, "", True, out)
    return out


def _walk(schema: Schema, value: Any, old: Any, path: str, root: bool, out: list[Failure]) -> None:
    if value is None:
        return
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        self_value = to_cel(value, schema, root=root)
        old_value = None if old is None else to_cel(old, schema, root=root)
        for r in rules:
            failure = _check(r, path, self_value, old_value)
            if failure is not None:
                out.append(failure)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value:
                before = old.get(name) if isinstance(old, dict) else None
                _walk(sub, value[name], before, _join(path, name), False, out)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            before = old.get(key) if isinstance(old, dict) else None
            _walk(schema["additionalProperties"], item, before, f"{path}[{key}]", False, out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):  # atomic lists: items have no old value
            _walk(schema["items"], item, None, f"{path}[{i}]", False, out)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check(r: Obj, path: str, self_value: Any, old_value: Any) -> Failure | None:
    transition = uses_old_self(r)
    optional = bool(r.get("optionalOldSelf"))
    if transition and old_value is None and not optional:
        return None  # transition rules run only where there is an old value
    where = path + _field_path(r.get("fieldPath", ""))
    where = where.removeprefix(".")
    message = r.get("message") or f"failed rule: {r['rule']}"
    old: Any = _ABSENT
    if transition:
        old = _Optional(old_value) if optional else old_value
    try:
        verdict = evaluate(r["rule"], self_value, old)
    except celpy.CELEvalError as exc:
        return Failure(
            where, "FieldValueInvalid", f"{exc.args[0]} evaluating rule: {message}", r["rule"]
        )
    if isinstance(verdict, celpy.CELEvalError):
        return Failure(
            where, "FieldValueInvalid", f"{verdict.args[0]} evaluating rule: {message}", r["rule"]
        )
    if isinstance(verdict, celtypes.BoolType) and bool(verdict):
        return None
    if r.get("messageExpression"):
        try:
            said = evaluate(r["messageExpression"], self_value, old)
            if isinstance(said, str) and said.strip() and "\n" not in said.strip():
                message = said.strip()
        except celpy.CELEvalError:
            pass  # kube-apiserver falls back to the message
    return Failure(where, r.get("reason") or "FieldValueInvalid", message, r["rule"])


def _field_path(field_path: str) -> str:
    """`.resources.requests['nvidia.com/gpu']` -> `.resources.requests[nvidia.com/gpu]`."""
    return re.sub(r"\['((?:[^'\\]|\\.)*)'\]", lambda m: f"[{m.group(1)}]", field_path)


# --- the API stand-in's admission ----------------------------------------------------------


def crd_schema(crds: Iterable[Obj], group: str, version: str, plural: str) -> Schema | None:
    """The openAPIV3Schema the stored CRDs give (group, version, plural), if any."""
    for crd in crds:
        spec = crd.get("spec") or {}
        if spec.get("group") != group or (spec.get("names") or {}).get("plural") != plural:
            continue
        for v in spec.get("versions") or []:
            if v.get("name") == version:
                return (v.get("schema") or {}).get("openAPIV3Schema")
    return None


def admit(
    crds: Iterable[Obj],
    key: tuple[str, str, str],
    old: Obj | None,
    new: Obj,
    *,
    params: Any = None,
    status: bool = False,
    patch: bool = False,
) -> tuple[Obj, list[str]]:
    """`new` as the API server stores it, and the Warning headers of the answer; or
    kmock.KubernetesError: 400 for unknown fields under fieldValidation=Strict, 422 with
    kube-apiserver's Status when the OpenAPI schema or a rule refuses it. Objects of kinds
    no CRD defines pass untouched. A write of the status subresource (`status`) is pruned,
    defaulted and validated against the schema; the rules run on writes of the main resource.
    Order as kube-apiserver's: decode (prune), default, validate (schema, then CEL)."""
    import kmock

    crd_list = list(crds)
    schema = crd_schema(crd_list, *key)
    if schema is None:
        return new, []
    kind = next(
        c["spec"]["names"]["kind"]
        for c in crd_list
        if c["spec"]["group"] == key[0] and c["spec"]["names"]["plural"] == key[2]
    )
    new, unknown = schema_admission.prune(new, schema)
    mode = schema_admission.directive(params or {})
    if unknown and mode == schema_admission.STRICT:
        raise kmock.KubernetesError(
            status=400,
            reason="BadRequest",
            message=schema_admission.unknown_field_message(kind, key[1], unknown, patch),
        )
    said = schema_admission.warnings(unknown) if mode == schema_admission.WARN else []
    new = default(schema, new)
    causes = schema_admission.validate(schema, new)
    if not status and not any(c.blocking for c in causes):
        before = None if old is None else default(schema, old)
        causes += [
            schema_admission.Cause(f.field, f.reason, f.body())
            for f in failures(schema, new, before)
        ]
    if not causes:
        return new, said
    meta = new.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or ""
    errors = [str(c) for c in causes]
    listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    raise kmock.KubernetesError(
        status=422,
        reason="Invalid",
        message=f'{kind}.{key[0]} "{name}" is invalid: {listed}',
        details={
            "name": name,
            "group": key[0],
            "kind": kind,
            "causes": [{"reason": c.reason, "message": c.detail, "field": c.field} for c in causes],
        },
    )


def predating_rules(crd: Obj) -> Obj:
    """`crd` without its CEL rules and defaults, as this chart's CRD was before them: what a
    cluster keeps when its CRD is not upgraded (crds.enabled false, or a release installed
    from an earlier chart's crds/, which Helm never upgrades, not yet adopted).
    There the operator's own checks are what refuses a bad job or a frozen field's change."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: strip(v)
                for k, v in node.items()
                if k not in ("x-kubernetes-validations", "default")
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out = copy.deepcopy(crd)
    for version in out["spec"]["versions"]:
        version["schema"] = strip(version["schema"])
    return out
