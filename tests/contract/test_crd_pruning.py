"""Every field a user can write survives the API server's pruning of the CRD's schema.

kube-apiserver keeps a field of a custom resource only where the CRD's structural schema
declares it (properties, additionalProperties, x-kubernetes-preserve-unknown-fields); the rest
is dropped, or refused under kubectl's default strict field validation (schema_admission.py
models it from apiextensions-apiserver's pruning/algorithm.go). These tests walk the CRD
against the models (a document holding every field they define, with nested content in each
free-form object) and against every example; JobSets the operator renders from the examples
survive the pruning of JobSet's CRD (built from JobSet's published models, jobset_crd.py).
The chart's values hold no GSPOJob, so no chart file is walked here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cel_admission import default
from jobset_crd import render_jobset_crd
from schema_admission import prune, validate

from gspo_api.spec import GSPOJobSpec
from gspo_operator.crd import render_crd, structural
from gspo_operator.render_cli import render_source

REPO = Path(__file__).resolve().parents[2]
SCHEMA = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
JOBSET = render_jobset_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
# What a user writes inside a free-form object (volume sources, valueFrom, affinity, ...).
NESTED = {"someField": {"deeper": ["a", {"deepest": 1}]}}


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_no_object_loses_its_fields() -> None:
    """No `type: object` without properties, additionalProperties or preserve-unknown-fields:
    the API server would prune every key under it."""
    bare = [
        path
        for path, node in _nodes(SCHEMA)
        if node.get("type") == "object"
        and "properties" not in node
        and not isinstance(node.get("additionalProperties"), dict)
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert bare == []


def test_the_generator_refuses_an_object_it_would_empty() -> None:
    with pytest.raises(ValueError, match="prune every field"):
        structural({"type": "object", "title": "Bare"}, {})
    branches = [{"type": "object", "additionalProperties": True}, {"type": "null"}]
    free = {"anyOf": branches, "default": None}  # dict[str, Any] | None = None
    assert structural(free, {}) == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    beside = {**free, "x-kubernetes-preserve-unknown-fields": True}
    assert structural(beside, {})["x-kubernetes-preserve-unknown-fields"] is True


def _sample(node: dict[str, Any], defs: dict[str, Any]) -> Any:
    """A value holding every field of a pydantic JSON Schema node (free-form: NESTED)."""
    if "$ref" in node:
        return _sample(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        free = node.get("x-kubernetes-preserve-unknown-fields")
        return copy.deepcopy(NESTED) if free else _sample(branches[0], defs)
    if "enum" in node or "const" in node:
        return node.get("enum", [node.get("const")])[0]
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        return {name: _sample(sub, defs) for name, sub in node["properties"].items()}
    if kind == "object":
        extra = node.get("additionalProperties", True)
        if extra is True or node.get("x-kubernetes-preserve-unknown-fields"):
            return copy.deepcopy(NESTED)
        return {"key": _sample(extra, defs)}
    if kind == "array":
        items = node.get("items", {})
        return [copy.deepcopy(NESTED) if not items else _sample(items, defs)]
    return {"string": "x", "integer": 1, "number": 0.5, "boolean": True}.get(kind, "x")


def _every_field_spec() -> dict[str, Any]:
    raw = GSPOJobSpec.model_json_schema(by_alias=True)
    return _sample(raw, raw.get("$defs", {}))


def test_every_field_of_the_models_survives_pruning() -> None:
    spec = _every_field_spec()
    assert spec["learner"]["volumes"][0]["persistentVolumeClaim"] == NESTED
    assert spec["runPolicy"]["scheduling"]["affinity"] == NESTED
    assert spec["learner"]["env"][0]["valueFrom"] == NESTED
    doc = {"apiVersion": "gspo.dev/v1alpha1", "kind": "GSPOJob", "metadata": {"name": "j"}}
    stored, unknown = prune({**doc, "spec": spec}, SCHEMA)
    assert unknown == []
    assert stored["spec"] == spec


def _examples() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "GSPOJob":
                yield path.name, doc


EXAMPLES = list(_examples())


@pytest.mark.parametrize(("name", "doc"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_every_example_survives_pruning_and_the_schema(name: str, doc: dict[str, Any]) -> None:
    stored, unknown = prune(doc, SCHEMA)
    assert unknown == [], f"{name}: the API server would drop {unknown}"
    assert stored == doc
    assert validate(SCHEMA, default(SCHEMA, stored)) == []


@pytest.mark.parametrize(("name", "doc"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_the_jobset_rendered_from_every_example_survives_jobsets_crd(
    name: str, doc: dict[str, Any]
) -> None:
    jobsets = [o for o in render_source(str(REPO / "examples" / name), "default", False)]
    jobsets = [o for o in jobsets if o["kind"] == "JobSet"]
    assert len(jobsets) == 1
    stored, unknown = prune(jobsets[0], JOBSET)
    assert unknown == [], f"{name}: JobSet's CRD would drop {unknown}"
    assert stored == jobsets[0]
    assert validate(JOBSET, stored) == []
