"""The Helm chart through real Helm and promtool: lint, render, schemas, alert rules, dashboard.

Helm and promtool come from `make tools` (.tools/); the tests fail, not skip, without them,
so a CI run can never pass with the chart unchecked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from checkout import REPO

CHART = REPO / "charts" / "gspo-operator"
VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))
HELM = REPO / ".tools" / "helm" / "helm"
PROMTOOL = REPO / ".tools" / "prometheus" / "usr" / "bin" / "promtool"
RUNBOOKS = REPO / "docs" / "runbooks.md"
KUBE_VERSIONS = ("1.29.0", "1.32.0")
# Kinds of the Prometheus Operator: CRDs that kubernetes-validate has no schema for.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
RELEASE, NAMESPACE = "gspo-operator", "gspo-system"


def run(*cmd: str | Path, cwd: Path = REPO) -> str:
    result = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert result.returncode == 0, f"{cmd[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def template(*args: str) -> list[dict[str, Any]]:
    out = run(HELM, "template", RELEASE, CHART, "--namespace", NAMESPACE, *args)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def rendered_rules() -> dict[str, Any]:
    args = ("--set", "prometheusRule.enabled=true", "--show-only", "templates/prometheusrule.yaml")
    (rule,) = template(*args)
    return {"groups": rule["spec"]["groups"]}


def alerts() -> list[dict[str, Any]]:
    return [r for group in rendered_rules()["groups"] for r in group["rules"]]


def test_tools_are_installed() -> None:
    assert HELM.exists() and PROMTOOL.exists(), "run `make tools` (the test command does)"


@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda p: p.name)
def test_chart_lints(values: Path) -> None:
    out = run(HELM, "lint", "--strict", CHART, "-f", values)
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda p: p.name)
def test_every_rendered_object_is_valid_kubernetes(values: Path, kube_version: str) -> None:
    docs = template("-f", str(values), "--include-crds", "--kube-version", kube_version)
    assert docs
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["metadata"]["namespace"] and doc["spec"]
            continue
        kubernetes_validate.validate(doc, kube_version, strict=True)


def test_values_schema_rejects_unknown_and_wrong_keys() -> None:
    bad = [
        ("--set", "metrics.prot=8080"),
        ("--set", "prometheusRule.rewardCollapseRatio=2"),
        ("--set", "logLevel=loud"),
    ]
    for args in bad:
        result = subprocess.run(
            [str(HELM), "template", RELEASE, str(CHART), *args], capture_output=True, text=True
        )
        assert result.returncode != 0, args
        assert "values don't meet the specifications of the schema" in result.stderr, args


def test_operator_deployment_is_locked_down() -> None:
    (deploy,) = by_kind(template(), "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--all-namespaces" in container["args"]


def test_watch_namespaces_bind_rbac_only_there() -> None:
    docs = template("--set", "watchNamespaces={team-a,team-b}")
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (deploy,) = by_kind(docs, "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args
    cluster_bindings = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
    assert cluster_bindings == {f"{RELEASE}-cluster"}, "job rules must not be bound cluster-wide"


def grants(rules: list[dict[str, list[str]]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_chart_grants_exactly_what_the_operator_uses() -> None:
    """The operator tests check every API call against rbac.RULES; the chart must grant those
    and nothing more (a missing verb breaks a cluster, an extra one widens the blast radius)."""
    from gspo_operator.rbac import RULES

    roles = by_kind(template(), "ClusterRole")
    granted = grants([rule for role in roles for rule in role["rules"]])
    needed = grants(RULES)
    assert not needed - granted, f"the chart lacks {sorted(needed - granted)}"
    assert not granted - needed, (
        f"the chart grants more than the operator uses: {sorted(granted - needed)}"
    )


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rendered_rules()))
    out = run(PROMTOOL, "check", "rules", rules)
    assert f"SUCCESS: {len(alerts())} rules found" in out


def test_promtool_unit_tests_fire_and_hold_each_alert(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()))
    shutil.copy(REPO / "tests" / "chart" / "alerts_test.yaml", tmp_path)
    run(PROMTOOL, "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    tested = yaml.safe_load((tmp_path / "alerts_test.yaml").read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert fired == {a["alert"] for a in alerts()}, "every alert needs a test that fires it"


def test_alerts_follow_the_mixin_style_and_have_runbooks() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    }
    names = set()
    for alert in alerts():
        name = alert["alert"]
        names.add(name)
        assert re.fullmatch(r"GSPO[A-Z][A-Za-z]+", name)
        assert alert["labels"]["severity"] in {"warning", "critical"}
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"]
        url = annotations["runbook_url"]
        assert url.endswith(f"docs/runbooks.md#{name.lower()}"), url
        assert name.lower() in anchors, f"docs/runbooks.md has no section for {name}"
    assert {a for a in anchors} == {n.lower() for n in names}, "a runbook without an alert"


def exported_metric_names() -> set[str]:
    """Every series name the learner, the rollout server and the operator can expose."""
    from gspo_operator.metrics import OperatorMetrics
    from gspo_trainer.metrics import LearnerMetrics
    from gspo_trainer.rollout.server import ServerState

    registries = [
        LearnerMetrics().registry,
        OperatorMetrics().registry,
        ServerState(token=None, require_token_for_generate=False, version=None).registry,
    ]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = {"up"}
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def metric_names_in(expr: str) -> set[str]:
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    return set(re.findall(r"\b(?:gspo|controller_runtime)_[a-z0-9_]+\b", without_labels))


def test_alert_rules_use_only_exported_metrics() -> None:
    exported = exported_metric_names()
    for alert in alerts():
        unknown = metric_names_in(alert["expr"]) - exported
        assert not unknown, f"{alert['alert']} reads metrics nothing exports: {unknown}"


def test_dashboard_is_shipped_and_uses_only_exported_metrics() -> None:
    docs = template("--set", "grafanaDashboard.enabled=true")
    (config_map,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["gspo-jobs.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboard.json").read_text())
    exported = exported_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("reward", "clip", "tokens", "sync", "rollout servers", "checkpoint", "expert"):
        assert wanted in titles, f"the dashboard has no {wanted} panel"
    for expr in exprs:
        unknown = metric_names_in(expr) - exported
        assert not unknown, f"dashboard query reads metrics nothing exports: {unknown}: {expr}"


def test_helm_test_hook_probes_the_metrics_endpoint() -> None:
    hooks = [
        d for d in template() if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    (pod,) = hooks
    command = " ".join(pod["spec"]["containers"][0]["command"])
    assert f"{RELEASE}-metrics" in command and "controller_runtime_reconcile_total" in command


def test_runbooks_name_only_exported_metrics() -> None:
    histograms = {
        n.removesuffix("_bucket") for n in exported_metric_names() if n.endswith("_bucket")
    }
    unknown = metric_names_in(RUNBOOKS.read_text()) - exported_metric_names() - histograms
    assert not unknown, f"docs/runbooks.md names metrics nothing exports: {unknown}"
