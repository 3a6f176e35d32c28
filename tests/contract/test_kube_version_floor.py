"""The Kubernetes version the chart states as its floor is the one the CRD's validation rules
need: each CEL feature the CRD uses is mapped to the first release that runs it as written,
read from Kubernetes' sources, and the chart's kubeVersion must be the highest of them.

- apiextensions-apiserver pkg/apis/apiextensions/v1/types_jsonschema.go (ValidationRule at
  each release tag): messageExpression from 1.27, reason and fieldPath from 1.28,
  optionalOldSelf from 1.29;
- apiextensions-apiserver pkg/features/kube_features.go: optionalOldSelf only takes effect with
  CRDValidationRatcheting, alpha (off) in 1.28-1.29 and on by default from 1.30; with it off,
  pkg/apiserver/schema/cel/validation.go skips a rule using oldSelf on create, so the name
  rules would not run when a GSPOJob is created;
- apiserver pkg/cel/environment/base.go (IntroducedVersion of each library): optional types
  (oldSelf.hasValue()) and the quantity library 1.28, sets 1.29, ip/cidr 1.30, format 1.31.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from checkout import REPO

from gspo_operator.crd import render_crd

CHART = REPO / "charts" / "gspo-operator"
# What a validation rule may use -> the first minor release of Kubernetes that runs it.
RULE_FIELDS = {"messageExpression": 27, "reason": 28, "fieldPath": 28, "optionalOldSelf": 30}
RULE_FUNCTIONS = {
    r"\.(hasValue|orValue|optMap|optFlatMap)\(|\?\.": 28,  # optional types
    r"\bquantity\(|\bisQuantity\(": 28,
    r"\bsets\.": 29,
    r"\b(ip|cidr|isIP|isCIDR)\(": 30,
    r"\bformat\.": 31,
}


def rules(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield from node.get("x-kubernetes-validations") or []
        for value in node.values():
            yield from rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from rules(value)


def needed_minor(crd: dict[str, Any]) -> tuple[int, list[str]]:
    """The lowest 1.x that runs every rule of `crd` as written, and why."""
    why = ["x-kubernetes-validations: 1.25"]
    minor = 25
    for rule in rules(crd):
        for field, first in RULE_FIELDS.items():
            if field in rule and first > minor:
                minor, why = first, [*why, f"{field}: 1.{first}"]
        for pattern, first in RULE_FUNCTIONS.items():
            if re.search(pattern, rule["rule"]) and first > minor:
                minor, why = first, [*why, f"{rule['rule']!r}: 1.{first}"]
    return minor, why


def test_the_chart_states_the_kubernetes_version_its_crd_needs() -> None:
    minor, why = needed_minor(render_crd())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">=1.{minor}.0-0", why
    assert f"Kubernetes 1.{minor} or later" in (CHART / "README.md").read_text(), why
    assert f"Kubernetes 1.{minor}" in (REPO / "README.md").read_text(), why


def test_a_rule_is_dated_by_its_newest_feature() -> None:
    crd = {
        "x-kubernetes-validations": [{"rule": "self.x.size() > 0", "reason": "FieldValueInvalid"}]
    }
    assert needed_minor(crd)[0] == 28
    crd["x-kubernetes-validations"].append({"rule": "sets.contains(self.a, self.b)"})
    assert needed_minor(crd)[0] == 29
