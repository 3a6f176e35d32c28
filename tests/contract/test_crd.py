"""The CRD is generated from the models, structural, current in the chart, and agrees with them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gspo_api.spec import GSPOJobSpec
from gspo_operator.crd import CHART_CRD_PATH, render_crd, render_crd_yaml, structural

REPO = Path(__file__).resolve().parents[2]
JUNCTORS = ("anyOf", "allOf", "oneOf", "not")
FORBIDDEN_IN_JUNCTORS = {"description", "type", "default", "additionalProperties", "nullable"}


def _schema() -> dict[str, Any]:
    return render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_every_node_is_structural() -> None:
    for path, node in _walk(_schema()):
        assert "$ref" not in node, path
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert "type" in node or special, f"{path} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, (
                f"{path}: properties and additionalProperties"
            )
        for junctor in JUNCTORS:
            for branch in node.get(junctor, []):
                bad = FORBIDDEN_IN_JUNCTORS & set(branch)
                assert not bad or node.get("x-kubernetes-int-or-string"), (path, bad)


def test_status_subresource_printer_columns_and_short_name() -> None:
    crd = render_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Phase", "Step", "Reward", "Rollout Ready", "Age"]
    assert crd["spec"]["names"]["shortNames"] == ["gspo"]
    assert _schema()["properties"]["status"]["x-kubernetes-preserve-unknown-fields"] is True


def test_chart_copy_is_current() -> None:
    chart = REPO / CHART_CRD_PATH
    assert chart.read_text() == render_crd_yaml(), (
        f"{CHART_CRD_PATH} is stale; regenerate it with `gspo crd --write {CHART_CRD_PATH}`"
    )


def _aliases(model: type, prefix: str = "") -> set[str]:
    from gspo_api.validation import _model_of

    out = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        out.add(path)
        inner = _model_of(field.annotation)
        if inner is not None:
            out |= _aliases(inner, path + ("[]" if "list" in str(field.annotation) else ""))
    return out


def test_every_model_field_is_in_the_crd() -> None:
    spec_node = _schema()["properties"]["spec"]
    in_crd = {path for path, _ in _walk(spec_node) if path}
    missing = _aliases(GSPOJobSpec) - in_crd
    assert not missing


def _as_json_schema(node: Any) -> Any:
    """OpenAPI v3 node -> JSON Schema that also rejects unknown fields (kubectl's strict mode)."""
    if not isinstance(node, dict):
        return node
    out = {k: _as_json_schema(v) for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {k: _as_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        out["type"] = [
            *([out["type"]] if isinstance(out.get("type"), str) else out["type"]),
            "null",
        ]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if node.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    return out


def _crd_validator() -> jsonschema.Draft202012Validator:
    schema = copy.deepcopy(_schema())
    schema["properties"]["status"] = {"type": "object"}
    return jsonschema.Draft202012Validator(_as_json_schema(schema))


def test_examples_pass_the_crd_schema() -> None:
    validator = _crd_validator()
    examples = sorted((REPO / "examples").glob("*.yaml"))
    manifests = [
        doc
        for path in examples
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "GSPOJob"
    ]
    assert manifests, "examples/ holds no GSPOJob"
    for doc in manifests:
        errors = list(validator.iter_errors(doc))
        assert not errors, [e.message for e in errors]


def test_full_default_spec_passes_and_bad_values_fail_the_crd_schema() -> None:
    validator = _crd_validator()
    # Without its nulls: the API server prunes a null where the field is not nullable (a field
    # whose default is None: crd.structural), before it validates.
    spec = GSPOJobSpec.model_validate(
        {"model": {"name": "Qwen/Qwen3-30B-A3B-Base"}, "data": {"source": "/data/train.jsonl"}}
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    doc = {"apiVersion": "gspo.dev/v1alpha1", "kind": "GSPOJob", "metadata": {}, "spec": spec}
    assert not list(validator.iter_errors(doc))

    bad = copy.deepcopy(doc)
    bad["spec"]["algorithm"]["lossLevel"] = "ppo"
    assert any("ppo" in e.message for e in validator.iter_errors(bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["learner"]["replicas"] = 0
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["rollout"]["bogus"] = 1
    assert list(validator.iter_errors(bad))


def test_exclusive_bounds_become_openapi_booleans() -> None:
    node = structural({"type": "number", "exclusiveMinimum": 0}, {})
    assert node == {"type": "number", "minimum": 0, "exclusiveMinimum": True}


def test_unions_that_kubernetes_cannot_express_are_refused() -> None:
    with pytest.raises(ValueError, match="structural"):
        structural({"anyOf": [{"type": "boolean"}, {"type": "integer"}]}, {})


@pytest.mark.parametrize("kube_version", ["1.30.0", "1.32.0"])  # floor (Chart.yaml), later
def test_crd_is_a_valid_kubernetes_object(kube_version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(render_crd(), kube_version, strict=True)
