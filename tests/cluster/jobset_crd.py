"""JobSet's CustomResourceDefinition for the API stand-in, built from JobSet's published models.

The schema comes from the pydantic models PyPI's kubeflow-trainer-api 2.3.0 ships for
jobset.x-k8s.io/v1alpha2 (`kubeflow_trainer_api.models.jobset_v1alpha2_job_set`, generated
from JobSet's OpenAPI), turned into a structural schema by the same generator as GSPOJob's
CRD (gspo_operator.crd.structural), so the stand-in prunes and validates a JobSet as a cluster
running JobSet's CRD would: a field JobSet does not define is dropped (or refused under
kubectl's Strict field validation), a wrong type is a 422.

Where it departs from JobSet's own CRD (config/components/crd/bases, controller-gen with
generateEmbeddedObjectMeta): quantities and int-or-string fields, which the models wrap in
generated one-of classes, become `x-kubernetes-int-or-string`; embedded ObjectMeta keeps
every ObjectMeta field (controller-gen keeps labels, annotations, name, namespace and
finalizers); the models carry no defaults, enums, bounds or CEL rules (JobSet's webhook
stand-in, jobset_webhook.py, does its defaulting and validation); descriptions are dropped.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

from gspo_operator.crd import structural

GROUP, VERSION, PLURAL, KIND = "jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"
# The models' one-of wrappers for these: the wire form is an int or a string.
_INT_OR_STRING = (
    "IoK8sApimachineryPkgApiResourceQuantity",
    "IoK8sApimachineryPkgUtilIntstrIntOrString",
)


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


@cache
def _schema() -> dict[str, Any]:
    raw = JobsetV1alpha2JobSet.model_json_schema(by_alias=True)
    defs = raw.get("$defs", {})
    for name in _INT_OR_STRING:
        defs[name] = {"x-kubernetes-int-or-string": True}
    root = _without_descriptions(structural(raw, defs))
    # A CRD's root metadata is the API server's (ObjectMeta); the schema may not describe it.
    root["properties"]["metadata"] = {"type": "object"}
    return root


def render_jobset_crd() -> dict[str, Any]:
    """The JobSet CRD, as a plain dict (a fresh copy: the API stand-in stores what it gets)."""
    names = {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "jobset"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {**names, "shortNames": ["js"]},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": copy.deepcopy(_schema())},
                }
            ],
        },
    }
