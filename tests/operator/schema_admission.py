"""What kube-apiserver does to a custom resource with its CRD's structural schema on a write,
before the CEL rules (cel_admission.py) run: prune, apply the field-validation directive,
default, validate against the OpenAPI schema.

Modelled on kubernetes/kubernetes (staging/src/k8s.io, read at its 2026 master):
- pruning: apiextensions-apiserver/pkg/apiserver/schema/pruning/algorithm.go and its
  successor apiserver/pkg/cel/apivalidation/pruning/algorithm.go (PruneWithOptions): an
  object keeps a key only where the schema declares it in `properties`, or has
  `additionalProperties`, or is under `x-kubernetes-preserve-unknown-fields: true` (which
  still prunes inside the properties it declares); the root and
  `x-kubernetes-embedded-resource` nodes keep apiVersion, kind and metadata; the pruned keys
  come back as paths (`spec.learner.volumes[0].x`). Root metadata keeps ObjectMeta's own
  fields (apiextensions-apiserver's objectmeta coercion);
- field validation: the `fieldValidation` query parameter kubectl sends (--validate=strict,
  its default: Strict; =warn: Warn; =false: Ignore; a request without one gets Warn, the
  server's default). Strict refuses the write with 400 BadRequest worded as
  apiserver/pkg/endpoints/handlers/rest.go's transformDecodeError around apimachinery's strict
  decoding error: `<Kind> in version "<v>" cannot be handled as a <Kind>: strict decoding
  error: unknown field "spec.x", ...`; Warn stores the pruned object with a
  `Warning: 299 - "unknown field \"spec.x\""` header each; Ignore stores it silently;
- defaulting (apiextensions-apiserver/pkg/apiserver/schema/defaulting: nulls the schema does
  not allow pruned, then defaults top-down): cel_admission.default;
- OpenAPI validation (k8s.io/kube-openapi/pkg/validation/validate, as
  apiextensions-apiserver/pkg/apiserver/validation reports it): type (int-or-string,
  nullable, `number` taking integers), enum, required, minimum/maximum (exclusive too),
  min/maxLength, pattern, min/maxItems, min/maxProperties, with field.Error's wording; a type
  or required error keeps the CEL rules from running (the strategy's hasBlockingErr).
A PATCH's Strict refusal is the bare `strict decoding error: ...` (patch.go).
Not modelled: formats (date-time, byte, ...); x-kubernetes-list-type/map-keys
uniqueness; metadata validation beyond the schema's name rules; ratcheting of unchanged
invalid values (1.30+); allOf/anyOf/oneOf/not value validation; CRD versions and
conversion; server-side apply; the schemas of built-in kinds (they are stored as sent).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

Obj = dict[str, Any]
Schema = dict[str, Any]

META_FIELDS = ("apiVersion", "kind", "metadata")
# ObjectMeta's fields (k8s.io/apimachinery/pkg/apis/meta/v1 types.go): what root metadata keeps.
OBJECT_META = frozenset(
    {
        *("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion"),
        *("generation", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"),
        *("labels", "annotations", "ownerReferences", "finalizers", "managedFields"),
    }
)
STRICT, WARN, IGNORE = "Strict", "Warn", "Ignore"


# --- pruning -------------------------------------------------------------------------------


def prune(obj: Obj, schema: Schema) -> tuple[Obj, list[str]]:
    """`obj` without the fields `schema` does not declare, and the sorted paths pruned."""
    out = copy.deepcopy(obj)
    unknown: list[str] = []
    _prune(out, {**schema, "x-kubernetes-embedded-resource": True}, "", unknown)
    meta = out.get("metadata")
    if isinstance(meta, dict):
        for key in [k for k in meta if k not in OBJECT_META]:
            unknown.append(f"metadata.{key}")
            del meta[key]
    return out, sorted(unknown)


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _prune(value: Any, schema: Schema | None, path: str, unknown: list[str]) -> None:
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        _skip_prune(value, schema, path, unknown)
        return
    if isinstance(value, dict):
        embedded = schema is not None and schema.get("x-kubernetes-embedded-resource")
        props = (schema or {}).get("properties", {})
        extra = (schema or {}).get("additionalProperties")
        for key in list(value):
            if embedded and key in META_FIELDS:
                continue
            if key in props:
                _prune(value[key], props[key], _key(path, key), unknown)
            elif isinstance(extra, dict) or extra is True:
                _prune(
                    value[key], extra if isinstance(extra, dict) else None, _key(path, key), unknown
                )
            else:
                if key not in META_FIELDS or path:
                    unknown.append(_key(path, key))
                del value[key]
    elif isinstance(value, list):
        items = (schema or {}).get("items")
        for i, item in enumerate(value):
            _prune(item, items if isinstance(items, dict) else None, f"{path}[{i}]", unknown)


def _skip_prune(value: Any, schema: Schema, path: str, unknown: list[str]) -> None:
    """Under preserve-unknown-fields: keep unknown keys, prune inside the declared ones."""
    if isinstance(value, dict):
        embedded = schema.get("x-kubernetes-embedded-resource")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if embedded and key in META_FIELDS:
                continue
            if key in props:
                _prune(item, props[key], _key(path, key), unknown)
            elif isinstance(extra, dict):
                _prune(item, extra, _key(path, key), unknown)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _skip_prune(item, schema["items"], f"{path}[{i}]", unknown)


# --- field validation ----------------------------------------------------------------------


def directive(params: Any) -> str:
    """The request's fieldValidation (kubectl sends it; a request without one gets Warn)."""
    value = str(params.get("fieldValidation") or WARN)
    return value if value in (STRICT, WARN, IGNORE) else WARN


def unknown_field_message(kind: str, version: str, paths: list[str], patch: bool = False) -> str:
    """A create's or replace's decode error (rest.go's transformDecodeError); a patch's is
    the bare strict decoding error (patch.go's applyPatchToCurrentObject)."""
    said = "strict decoding error: " + ", ".join(f"unknown field {json.dumps(p)}" for p in paths)
    return said if patch else f'{kind} in version "{version}" cannot be handled as a {kind}: {said}'


def warnings(paths: list[str]) -> list[str]:
    """Warning header values (RFC 7234 code 299), one per pruned field."""
    return [f"299 - {json.dumps(f'unknown field {json.dumps(p)}')}" for p in paths]


# --- OpenAPI validation --------------------------------------------------------------------


@dataclass(frozen=True)
class Cause:
    """One field.Error as kube-apiserver reports it in a 422's details.causes."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    detail: str  # the cause's message (field.Error.ErrorBody)
    blocking: bool = False  # a type or required error: the CEL rules do not run

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


def _show(value: Any) -> str:
    """A value as field.Error prints it (%#v of the decoded JSON, near enough)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return '"null"'
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _invalid(value: Any, where: str, words: str) -> str:
    """kube-openapi's errors as field.Invalid prints them."""
    return f"Invalid value: {_show(value)}: {where} in body {words}"


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _type_ok(value: Any, schema: Schema) -> bool:
    have = _type_of(value)
    if have == "null":
        return bool(schema.get("nullable"))
    if schema.get("x-kubernetes-int-or-string"):
        return have in ("integer", "string")
    want = schema.get("type")
    if not want:
        return True
    return have == want or (want == "number" and have == "integer")


@cache
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def validate(schema: Schema, value: Any, path: str = "") -> list[Cause]:
    """Every OpenAPI violation of `value` (the whole object at the root)."""
    return list(_validate(schema, value, path))


def _validate(schema: Schema, value: Any, path: str) -> Iterator[Cause]:
    where = path or "<root>"
    if not _type_ok(value, schema):
        want = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema["type"]
        have = _show(_type_of(value))
        body = _invalid(_type_of(value), where, f"must be of type {want}: {have}")
        yield Cause(where, "FieldValueTypeInvalid", body, blocking=True)
        return
    if value is None:
        return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(_show(v) for v in schema["enum"])
        yield Cause(
            where,
            "FieldValueNotSupported",
            f"Unsupported value: {_show(value)}: supported values: {allowed}",
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        yield from _bounds(schema, value, where)
    if isinstance(value, str):
        yield from _string(schema, value, where)
    if isinstance(value, list):
        yield from _items(schema, value, where, path)
    if isinstance(value, dict):
        yield from _object(schema, value, where, path)


def _bounds(schema: Schema, value: float, where: str) -> Iterator[Cause]:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None:
        strict = bool(schema.get("exclusiveMinimum"))
        if value < low or (strict and value == low):
            words = "greater than" if strict else "greater than or equal to"
            yield Cause(
                where,
                "FieldValueInvalid",
                _invalid(value, where, f"should be {words} {_show(low)}"),
            )
    if high is not None:
        strict = bool(schema.get("exclusiveMaximum"))
        if value > high or (strict and value == high):
            words = "less than" if strict else "less than or equal to"
            yield Cause(
                where,
                "FieldValueInvalid",
                _invalid(value, where, f"should be {words} {_show(high)}"),
            )


def _string(schema: Schema, value: str, where: str) -> Iterator[Cause]:
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        yield Cause(
            where,
            "FieldValueTooLong",
            f"Too long: may not be more than {schema['maxLength']} bytes",
        )
    if "minLength" in schema and len(value) < schema["minLength"]:
        yield Cause(
            where,
            "FieldValueInvalid",
            _invalid(value, where, f"should be at least {schema['minLength']} chars long"),
        )
    if "pattern" in schema and not _regex(schema["pattern"]).search(value):
        yield Cause(
            where,
            "FieldValueInvalid",
            _invalid(value, where, f"should match '{schema['pattern']}'"),
        )


def _items(schema: Schema, value: list[Any], where: str, path: str) -> Iterator[Cause]:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        yield Cause(
            where,
            "FieldValueTooMany",
            f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
        )
    if "minItems" in schema and len(value) < schema["minItems"]:
        yield Cause(
            where,
            "FieldValueInvalid",
            _invalid(len(value), where, f"should have at least {schema['minItems']} items"),
        )
    if isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _validate(schema["items"], item, f"{path}[{i}]")


def _object(schema: Schema, value: Obj, where: str, path: str) -> Iterator[Cause]:
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        yield Cause(
            where,
            "FieldValueTooMany",
            f"Too many: {len(value)}: must have at most {schema['maxProperties']} items",
        )
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        yield Cause(
            where,
            "FieldValueInvalid",
            _invalid(
                len(value), where, f"should have at least {schema['minProperties']} properties"
            ),
        )
    for name in schema.get("required", ()):
        if name not in value:
            yield Cause(_key(path, name), "FieldValueRequired", "Required value", blocking=True)
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        if name in props:
            yield from _validate(props[name], item, _key(path, name))
        elif isinstance(extra, dict):
            yield from _validate(extra, item, f"{path}[{name}]" if path else name)
