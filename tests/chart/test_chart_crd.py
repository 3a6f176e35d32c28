"""The chart's GSPOJob CRD through real Helm: a template, so `helm upgrade` carries a fixed CRD
to an existing install (Helm installs crds/ once and never upgrades it); kept on uninstall."""

from __future__ import annotations

from test_chart import CHART, HELM, by_kind, run, template

from gspo_operator.crd import render_crd


def test_the_crd_is_a_template_that_upgrades_carry() -> None:
    (crd,) = by_kind(template(), "CustomResourceDefinition")
    generated = render_crd()
    assert crd["spec"] == generated["spec"]  # through Helm's fromYaml/toYaml unchanged
    assert crd["metadata"]["name"] == generated["metadata"]["name"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert "categories" not in crd["spec"]["names"]  # `kubectl delete all` spares jobs
    # Nothing in crds/: what Helm installs only once, it would never upgrade.
    assert run(HELM, "show", "crds", CHART).strip() == ""


def test_crds_values_switch_it_off_or_let_uninstall_delete_it() -> None:
    assert by_kind(template("--set", "crds.enabled=false"), "CustomResourceDefinition") == []
    (crd,) = by_kind(template("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]
