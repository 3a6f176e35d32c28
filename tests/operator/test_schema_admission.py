"""The API stand-in's pruning, field validation and OpenAPI validation of custom resources,
on hand-worked cases from apiextensions-apiserver's pruning/algorithm.go and kube-openapi."""

from __future__ import annotations

import kmock
import pytest
from cel_admission import admit
from jobset_crd import render_jobset_crd
from schema_admission import STRICT, WARN, directive, prune, validate, warnings

OBJ = {"type": "object"}
SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "bare": OBJ,
                "free": {**OBJ, "x-kubernetes-preserve-unknown-fields": True},
                "mixed": {
                    **OBJ,
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"typed": {**OBJ, "properties": {"n": {"type": "integer"}}}},
                },
                "map": {**OBJ, "additionalProperties": {"type": "string"}},
                "list": {
                    "type": "array",
                    "items": {**OBJ, "properties": {"a": {"type": "string"}}},
                },
                "embedded": {**OBJ, "x-kubernetes-embedded-resource": True, "properties": {}},
            },
        }
    },
}


def test_pruning_follows_the_algorithm() -> None:
    doc = {
        "apiVersion": "x/v1",
        "kind": "X",
        "metadata": {"name": "a", "bogus": 1},
        "spec": {
            "bare": {"gone": 1},
            "free": {"kept": {"deep": [1]}},
            "mixed": {"kept": 1, "typed": {"n": 1, "gone": 2}},
            "map": {"k": "v"},
            "list": [{"a": "x", "gone": 1}],
            "embedded": {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "gone": 1},
            "gone": True,
        },
        "top": 1,
    }
    stored, unknown = prune(doc, SCHEMA)
    assert unknown == [
        "metadata.bogus",
        "spec.bare.gone",
        "spec.embedded.gone",
        "spec.gone",
        "spec.list[0].gone",
        "spec.mixed.typed.gone",
        "top",
    ]
    assert stored["spec"]["bare"] == {}
    assert stored["spec"]["free"] == {"kept": {"deep": [1]}}
    assert stored["spec"]["mixed"] == {"kept": 1, "typed": {"n": 1}}
    assert stored["spec"]["embedded"] == {"apiVersion": "v1", "kind": "Pod", "metadata": {}}
    assert stored["metadata"] == {"name": "a"} and stored["apiVersion"] == "x/v1"


def test_field_validation_directives_as_kubectl_sends_them() -> None:
    assert directive({"fieldValidation": "Strict"}) == STRICT
    assert directive({}) == WARN  # the server's default
    assert warnings(["spec.x"]) == ['299 - "unknown field \\"spec.x\\""']


def test_validation_words_errors_as_kube_apiserver() -> None:
    schema = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "n": {"type": "integer", "minimum": 1},
            "level": {"type": "string", "enum": ["a", "b"]},
            "s": {"type": "string", "maxLength": 3, "pattern": "^x"},
            "q": {"x-kubernetes-int-or-string": True},
            "f": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        },
    }
    found = validate(schema, {"n": 0, "level": "c", "s": "yyyy", "q": 1.5, "f": 0}, "spec")
    assert [str(c) for c in found] == [
        "spec.name: Required value",
        "spec.n: Invalid value: 0: spec.n in body should be greater than or equal to 1",
        'spec.level: Unsupported value: "c": supported values: "a", "b"',
        "spec.s: Too long: may not be more than 3 bytes",
        "spec.s: Invalid value: \"yyyy\": spec.s in body should match '^x'",
        'spec.q: Invalid value: "number": spec.q in body must be of type integer or string: '
        '"number"',
        "spec.f: Invalid value: 0: spec.f in body should be greater than 0",
    ]
    assert validate(schema, {"name": "x", "n": 2, "q": "1Gi", "f": 1}) == []


def _jobset(**spec: object) -> dict:
    meta = {"name": "j", "namespace": "default"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": meta,
        "spec": spec,
    }


def test_a_jobset_is_pruned_and_refused_by_its_crd() -> None:
    crds = [render_jobset_crd()]
    key = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
    stored, said = admit(crds, key, None, _jobset(replicatedJobs=[], suspnd=True))
    assert "suspnd" not in stored["spec"] and said == ['299 - "unknown field \\"spec.suspnd\\""']
    with pytest.raises(kmock.KubernetesError) as strict:
        admit(crds, key, None, _jobset(suspnd=True), params={"fieldValidation": "Strict"})
    assert strict.value.status == 400
    assert strict.value.message == (
        'JobSet in version "v1alpha2" cannot be handled as a JobSet: strict decoding error: '
        'unknown field "spec.suspnd"'
    )
    with pytest.raises(kmock.KubernetesError) as patched:
        strict_patch = {"fieldValidation": "Strict"}
        admit(crds, key, None, _jobset(suspnd=True), params=strict_patch, patch=True)
    assert patched.value.message == 'strict decoding error: unknown field "spec.suspnd"'
    with pytest.raises(kmock.KubernetesError) as invalid:
        admit(crds, key, None, _jobset(suspend="yes"))
    assert invalid.value.status == 422
    assert "spec.suspend in body must be of type boolean" in str(invalid.value.message)
