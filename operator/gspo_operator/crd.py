"""The GSPOJob CustomResourceDefinition, generated from the pydantic models.

The CRD is never edited by hand: `render_crd()` turns the models' JSON Schema into the
structural OpenAPI v3 subset Kubernetes accepts (no $ref, a type on every node, nullable
instead of a null branch, int-or-string for quantities). The chart's copy is this output;
a contract test fails when it is stale.

The spec's pydantic defaults become schema defaults (the API server fills them in, so what
is stored is what the operator reads), and `crd_rules` adds the CEL rules
(x-kubernetes-validations) that refuse at `kubectl apply` what the operator would refuse.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from gspo_api.spec import API_GROUP, API_VERSION, KIND, GSPOJobSpec, GSPOJobStatus
from gspo_operator import crd_rules, names

PLURAL = "gspojobs"
SINGULAR = "gspojob"
SHORT_NAMES = ["gspo"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"
# The chart templates it (templates/crd.yaml), so helm upgrade carries a changed CRD.
CHART_CRD_PATH = Path("charts/gspo-operator/files") / f"{API_GROUP}_{PLURAL}.yaml"

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.reward"},
    {"name": "Rollout Ready", "type": "string", "jsonPath": ".status.rolloutReady"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# JSON Schema keywords that OpenAPI v3 (as Kubernetes reads it) does not take.
_DROPPED = {"title", "$defs", "default", "const"}


class _FactoryDefaults(GenerateJsonSchema):
    """Pydantic's JSON Schema, with `default_factory` defaults stated too.

    A section (a sub-model) defaults to `{}`: the API server then fills in the section's own
    field defaults, as it does for any object it defaults. Lists and maps default to empty.
    """

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        # Not default_factory_takes_data: a factory of no arguments.
        value = factory()  # type: ignore[call-arg]
        return {} if isinstance(value, BaseModel) else value


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON Schema node -> a structural OpenAPI v3 node. Pure.

    A field whose default is None is not nullable: the API server then prunes an explicit
    null, which means what leaving the field out means. Only a field with another default
    (model.moe) keeps `nullable`, because there null and absent differ. Stored objects thus
    hold no nulls where the CEL rules compare whole objects (see crd_rules: Kubernetes' CEL
    finds an object holding a null unequal even to itself).
    """
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)

    out: dict[str, Any] = {}
    description = schema.get("description")
    if "default" in schema and schema["default"] not in (None, {}, []):
        default = yaml.safe_dump(schema["default"], default_flow_style=True).strip()
        default = default.removesuffix("\n...").strip()
        description = f"{description or ''} Default: {default}.".strip()

    branches = schema.get("anyOf")
    if branches is not None:
        non_null = [b for b in branches if b.get("type") != "null"]
        nullable = len(non_null) < len(branches) and schema.get("default", NoDefault) is not None
        if schema.get("x-kubernetes-int-or-string") or _is_int_or_string(non_null):
            out = {"x-kubernetes-int-or-string": True}
        elif len(non_null) == 1:
            out = structural(non_null[0], defs)
        else:
            raise ValueError(f"cannot express a union of {non_null} in a structural schema")
        # pydantic writes a field's json_schema_extra beside the anyOf, not in the branch.
        out.update({k: v for k, v in schema.items() if k.startswith("x-kubernetes-")})
        if nullable:
            out["nullable"] = True
    else:
        for key, value in schema.items():
            if key in _DROPPED or key in ("description", "anyOf"):
                continue
            if key == "properties":
                out[key] = {name: structural(sub, defs) for name, sub in value.items()}
            elif key == "items":
                out[key] = structural(value, defs)
            elif key == "additionalProperties":
                if isinstance(value, dict):
                    out[key] = structural(value, defs)
                elif value is True:  # a free-form map (dict[str, Any]): keep what it holds
                    out["x-kubernetes-preserve-unknown-fields"] = True
                # `false` is the default for typed objects.
            elif key == "exclusiveMinimum":
                out["minimum"], out["exclusiveMinimum"] = value, True
            elif key == "exclusiveMaximum":
                out["maximum"], out["exclusiveMaximum"] = value, True
            else:
                out[key] = value
        if "const" in schema:
            out["enum"] = [schema["const"]]
        if out.get("x-kubernetes-preserve-unknown-fields"):
            out.pop("additionalProperties", None)
        if out.get("type") == "object" and not _keeps_its_fields(out):
            raise ValueError(
                f"an object without properties, additionalProperties or "
                f"x-kubernetes-preserve-unknown-fields ({schema.get('title', schema)}): the API "
                "server would prune every field written under it"
            )
    if schema.get("default") is not None:
        out["default"] = copy.deepcopy(schema["default"])  # shared $defs: no YAML anchors
    if description:
        out["description"] = description
    first: dict[str, Any] = {k: out[k] for k in ("type", "description") if k in out}
    return {**first, **{k: v for k, v in out.items() if k not in first}}


def _keeps_its_fields(node: dict[str, Any]) -> bool:
    """Whether the API server keeps the keys of an object under this node (pruning keeps
    only declared properties, additionalProperties' keys, or anything under
    x-kubernetes-preserve-unknown-fields: apiextensions-apiserver schema/pruning)."""
    return (
        "properties" in node
        or isinstance(node.get("additionalProperties"), dict)
        or bool(node.get("x-kubernetes-preserve-unknown-fields"))
    )


def _is_int_or_string(branches: list[dict[str, Any]]) -> bool:
    return sorted(b.get("type", "") for b in branches) == ["integer", "string"]


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, schema_generator=_FactoryDefaults)
    return structural(raw, raw.get("$defs", {}))


def _without_defaults(node: Any) -> Any:
    """The status is the operator's to write: no defaults there (they would appear in every
    status patch's result and hide what the operator actually wrote)."""
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def render_crd() -> dict[str, Any]:
    """The CustomResourceDefinition for GSPOJob, as a plain dict."""
    status = _without_defaults(_model_schema(GSPOJobStatus))
    status["x-kubernetes-preserve-unknown-fields"] = True  # kopf keeps its progress here
    status.pop("additionalProperties", None)
    root = {
        "type": "object",
        "description": "A GSPO reinforcement-learning run: learner, rollout servers, checkpoints.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # The root may restrict metadata.name only; the bound keeps the name rules cheap.
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": names.DNS_LABEL_MAX}},
            },
            "spec": _model_schema(GSPOJobSpec),
            "status": status,
        },
    }
    crd_rules.add_rules(root)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "gspo-operator"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


class _NoAliases(yaml.SafeDumper):
    """Every node written out in full: no `&id001`/`*id001` where the models share a node."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd_yaml() -> str:
    header = "# Generated by `gspo crd` from the pydantic models; do not edit by hand.\n"
    return header + yaml.dump(render_crd(), Dumper=_NoAliases, sort_keys=False, width=100)
