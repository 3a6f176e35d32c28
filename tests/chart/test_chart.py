"""The Helm chart through real Helm and promtool: lint, render, schemas, alert rules, dashboard.

Helm and promtool come from `make tools` (.tools/); the tests fail, not skip, without them,
so a CI run can never pass with the chart unchecked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
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
KUBE_VERSIONS = ("1.30.0", "1.32.0")  # the chart's floor (kubeVersion) and a later one
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
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert f"--namespace={NAMESPACE}" in container["args"]  # its own namespace only


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (deploy,) = by_kind(docs, "Deployment")
    return deploy["spec"]["template"]["spec"]["containers"][0]["args"]


CLUSTER_SCOPED_KINDS = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
LEADER_ELECTION = f"{RELEASE}-leader-election"


def job_rbac(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The Roles or RoleBindings of the job rules: all but the leader-election Lease's
    (templates/leader-election.yaml; test_two_replicas_elect_a_leader checks those)."""
    return [d for d in by_kind(docs, kind) if d["metadata"]["name"] != LEADER_ELECTION]


def test_rbac_is_namespaced_by_default() -> None:
    """The release namespace plus watchNamespaces, a Role and a RoleBinding in each, the same
    namespaces in --namespace args, and not one cluster-scoped object."""
    for args, watched in [
        ((), [NAMESPACE, "default"]),  # default: where kubectl puts the quick start's job
        (("--set", "watchNamespaces={team-a,team-b}"), [NAMESPACE, "team-a", "team-b"]),
        (("--set", f"watchNamespaces={{team-a,{NAMESPACE}}}"), [NAMESPACE, "team-a"]),
    ]:
        docs = template("--set", "crds.enabled=false", *args)  # the CRD: test_chart_crd.py
        assert not {d["kind"] for d in docs} & CLUSTER_SCOPED_KINDS, args
        for kind in ("Role", "RoleBinding"):
            objs = job_rbac(docs, kind)
            assert sorted(o["metadata"]["namespace"] for o in objs) == sorted(watched), kind
        for binding in job_rbac(docs, "RoleBinding"):
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{RELEASE}-jobs",
            }
            (subject,) = binding["subjects"]
            assert subject["name"] == RELEASE and subject["namespace"] == NAMESPACE
        namespaces = [
            a.removeprefix("--namespace=")
            for a in operator_args(docs)
            if a.startswith("--namespace=")
        ]
        assert namespaces == watched and "--all-namespaces" not in operator_args(docs)


def test_cluster_wide_only_when_asked() -> None:
    docs = template("--set", "clusterWide=true")
    assert "--all-namespaces" in operator_args(docs)
    assert not any(a.startswith("--namespace=") for a in operator_args(docs))
    assert not job_rbac(docs, "Role") and not job_rbac(docs, "RoleBinding")
    bound = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
    assert bound == {f"{RELEASE}-cluster", f"{RELEASE}-jobs"}
    both = subprocess.run(
        [
            str(HELM),
            "template",
            RELEASE,
            str(CHART),
            "--set",
            "clusterWide=true",
            "--set",
            "watchNamespaces={team-a}",
        ],
        capture_output=True,
        text=True,
    )
    assert both.returncode != 0 and "leave watchNamespaces empty" in both.stderr


def grants(rules: list[dict[str, list[str]]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# Cluster-scoped resources in rbac.RULES: kopf's scanning reads them, and only a cluster-wide
# operator scans (a namespaced one names its namespaces exactly; see run.serve).
SCANNING_RESOURCES = {"customresourcedefinitions", "namespaces"}


@pytest.mark.parametrize("cluster_wide", [False, True], ids=["namespaced", "cluster-wide"])
def test_chart_grants_exactly_what_the_operator_uses(cluster_wide: bool) -> None:
    """The operator tests check every API call against rbac.RULES; the chart must grant those
    and nothing more (a missing verb breaks a cluster, an extra one widens the blast radius).
    Namespaced, that is RULES less the scanning reads, in each Role; cluster-wide, all of it.
    """
    from gspo_operator.rbac import RULES

    docs = template("--set", f"clusterWide={str(cluster_wide).lower()}")
    roles = by_kind(docs, "ClusterRole") if cluster_wide else job_rbac(docs, "Role")
    assert roles
    needed = grants(RULES)
    if not cluster_wide:
        needed = {g for g in needed if g[1] not in SCANNING_RESOURCES}
    granted = set().union(*(grants(role["rules"]) for role in roles))
    if not cluster_wide:
        for role in roles:
            assert grants(role["rules"]) == needed, role["metadata"]["namespace"]
    assert not needed - granted, f"the chart lacks {sorted(needed - granted)}"
    assert not granted - needed, (
        f"the chart grants more than the operator uses: {sorted(granted - needed)}"
    )


def operator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deploy,) = by_kind(docs, "Deployment")
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


def policy_from(docs: list[dict[str, Any]]) -> Any:
    """The ClusterPolicy the operator builds from the rendered env (the downward API's
    namespace filled in as the kubelet would)."""
    from gspo_operator.manifest import ENV_OPERATOR_NAMESPACE, ClusterPolicy

    env = operator_env(docs)
    field = env[ENV_OPERATOR_NAMESPACE]["fieldRef"]["fieldPath"]
    assert field == "metadata.namespace"
    values = {k: v for k, v in env.items() if isinstance(v, str)}
    return ClusterPolicy.from_env({**values, ENV_OPERATOR_NAMESPACE: NAMESPACE})


def test_policy_values_reach_the_operator() -> None:
    from gspo_operator.manifest import DEFAULT_METRICS_FROM, ClusterPolicy

    defaults = policy_from(template())
    assert defaults.metrics_from == DEFAULT_METRICS_FROM  # the chart's default = the operator's
    assert defaults.allowed_images == () and defaults.allowed_priority_classes == ()
    (deploy,) = by_kind(template(), "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    peer = defaults.operator_peer()
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items(), "selects itself"
    values = CHART / "ci" / "cluster-wide-values.yaml"
    policy = policy_from(template("-f", str(values)))
    assert policy.allowed_images == ("ghcr.io/gspo-dev/*", "registry.corp.example/ml/")
    assert policy.allowed_priority_classes == ("training-low", "training-high")
    assert policy.metrics_from == tuple(
        yaml.safe_load(values.read_text())["networkPolicy"]["metricsFrom"]
    )
    nobody = policy_from(template("--set-json", "networkPolicy.metricsFrom=[]"))
    assert nobody.metrics_from == () and nobody != ClusterPolicy()


def test_job_pod_monitors_carry_the_labels_kube_prometheus_stack_selects() -> None:
    """kube-prometheus-stack's Prometheus selects monitors labelled `release: <its release>`
    and ignores the rest; by default the chart's monitors and every job's PodMonitor carry the
    label its default install asks for, and the values change it for all of them."""
    from gspo_operator.manifest import check_job
    from gspo_operator.render import render_job

    job = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())
    job["metadata"].update(name="exp", namespace="team-a", uid="u1")

    def pod_monitor_labels(*args: str) -> dict[str, str]:
        policy = policy_from(template(*args))
        (spec, problems) = check_job(job, policy)
        assert spec is not None, problems
        objs = render_job(job, spec, token="t", policy=policy)
        (monitor,) = by_kind(objs, "PodMonitor")
        return dict(monitor["metadata"]["labels"])

    assert pod_monitor_labels()["release"] == "kube-prometheus-stack"
    labels = pod_monitor_labels(
        "--set", "monitoring.labels.release=prom", "--set", "monitoring.podMonitorLabels.team=ml"
    )
    assert labels["release"] == "prom" and labels["team"] == "ml"
    assert labels["gspo.dev/job-name"] == "exp"  # the operator's own labels stay
    both = ("--set", "prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    for kind in ("PrometheusRule", "ServiceMonitor"):
        (obj,) = by_kind(template(*both, "--set", "monitoring.labels.release=prom"), kind)
        assert obj["metadata"]["labels"]["release"] == "prom", kind


def test_values_schema_checks_the_policy_values() -> None:
    bad = [
        ("--set", "networkPolicy.metricsFrom[0].ipBlock.cidr=10.0.0.0/8"),
        ("--set-json", "networkPolicy.metricsFrom=[{}]"),
        ("--set-json", 'networkPolicy.metricsFrom=[{"podSelector": {"matchLabel": {}}}]'),
        ("--set", "policy.allowedImages[0]="),
        ("--set", "policy.allowedPriorityClasses[0]=Not_A_Name"),
        ("--set", "clusterWide=yes"),
        ("--set", "networkPolicy.metricsFrom=null"),  # say [] to admit no scraper
    ]
    for args in bad:
        result = subprocess.run(
            [str(HELM), "template", RELEASE, str(CHART), *args], capture_output=True, text=True
        )
        assert result.returncode != 0, args
        assert "values don't meet the specifications of the schema" in result.stderr, args


def test_two_replicas_elect_a_leader() -> None:
    """By default two replicas run with --leader-elect on a Lease named after the release in
    its namespace, each pod named by the downward API, preferring different nodes, kept up
    by a PodDisruptionBudget; a Role grants exactly the Lease calls leader.LeaseLock makes."""
    docs = template()
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    args = operator_args(docs)
    for flag in (
        "--leader-elect",
        f"--leader-election-namespace={NAMESPACE}",
        f"--leader-election-id={RELEASE}",
    ):
        assert flag in args
    pod = deploy["spec"]["template"]
    assert operator_env(docs)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == LEADER_ELECTION]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert grants(role["rules"]) == {
        ("coordination.k8s.io", "leases", verb) for verb in ("get", "update", "create")
    }
    for rule in role["rules"]:  # create names no object, so resourceNames cannot limit it
        assert rule.get("resourceNames") == (None if rule["verbs"] == ["create"] else [RELEASE])
    bindings = by_kind(docs, "RoleBinding")
    (binding,) = [b for b in bindings if b["metadata"]["name"] == LEADER_ELECTION]
    assert binding["roleRef"]["name"] == LEADER_ELECTION
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}
    ]


def test_one_replica() -> None:
    """No PodDisruptionBudget (minAvailable 1 of 1 would block every drain) and no default
    anti-affinity; leader election stays on unless turned off, and then Recreate keeps two
    operators from overlapping in an upgrade."""
    docs = template("--set", "replicaCount=1")
    assert not by_kind(docs, "PodDisruptionBudget")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and "affinity" not in deploy["spec"]["template"]["spec"]
    assert "--leader-elect" in operator_args(docs)
    docs = template("--set", "replicaCount=1", "--set", "leaderElection.enabled=false")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    assert not any(a.startswith("--leader-elect") for a in operator_args(docs))
    assert not any(r["metadata"]["name"] == LEADER_ELECTION for r in by_kind(docs, "Role"))
    # Two replicas elect a leader whatever leaderElection.enabled says.
    docs = template("--set", "leaderElection.enabled=false")
    assert "--leader-elect" in operator_args(docs)


def test_own_affinity_replaces_the_default_and_schema_checks_ha_values() -> None:
    own = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    docs = template("--set-json", f"affinity={json.dumps(own)}")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["affinity"] == own
    pdb_kind = "PodDisruptionBudget"
    (pdb,) = by_kind(template("--set", "podDisruptionBudget.minAvailable=50%"), pdb_kind)
    assert pdb["spec"]["minAvailable"] == "50%"
    assert not by_kind(template("--set", "podDisruptionBudget.enabled=false"), pdb_kind)
    for args in [
        ("--set", "replicaCount=0"),
        ("--set", "leaderElection.enable=true"),
        ("--set", "podDisruptionBudget.minAvailable=half"),
    ]:
        result = subprocess.run(
            [str(HELM), "template", RELEASE, str(CHART), *args], capture_output=True, text=True
        )
        assert result.returncode != 0, args
        assert "values don't meet the specifications of the schema" in result.stderr, args


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
    from gspo_trainer.rollout.control import RolloutState

    registries = [
        LearnerMetrics().registry,
        OperatorMetrics().registry,
        RolloutState(version=None).registry,
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


def readable_metric_names() -> set[str]:
    """What the rules and the dashboard may read: what is exported, and what learner images of
    an earlier release export instead (those histograms' earlier names), while jobs started
    before an upgrade run on."""
    from gspo_trainer.metrics import EARLIER_NAMES

    earlier = {name + s for name in EARLIER_NAMES.values() for s in ("_bucket", "_sum", "_count")}
    return exported_metric_names() | earlier


def test_alert_rules_use_only_exported_metrics() -> None:
    exported = readable_metric_names()
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
    exported = readable_metric_names()
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


# vLLM's own series: the rollout server's /metrics appends vLLM's registry to its own, and
# the job's PodMonitor scrapes it (with gspojob). Built in a child process, as vLLM's
# PrometheusStatLogger registers on prometheus_client's global registry; a bare VllmConfig
# with the three model fields the logger reads stands in for a served model.
VLLM_SERIES_SCRIPT = """
import json
from types import SimpleNamespace

from prometheus_client import REGISTRY
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger

config = VllmConfig()
model = SimpleNamespace(served_model_name="policy", max_model_len=1024, is_diffusion=False)
object.__setattr__(config, "model_config", model)
PrometheusStatLogger(config, [0])
series = {
    s.name: sorted(set(s.labels) - {"le"})
    for family in REGISTRY.collect()
    for s in family.samples
    if s.name.startswith("vllm:")
}
print(json.dumps(series))
"""


def vllm_series() -> dict[str, list[str]]:
    """Every vllm: series name (prometheus_client's _total, _bucket/_sum/_count included)
    vLLM's PrometheusStatLogger exposes, with its labels."""
    result = subprocess.run(
        [sys.executable, "-c", VLLM_SERIES_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"vLLM's metrics did not build:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def vllm_names_in(text: str) -> set[str]:
    return set(re.findall(r"\bvllm:[a-z0-9_:]+", re.sub(r"\{[^}]*\}", "", text)))


def test_vllm_series_read_by_rules_dashboard_and_runbooks_exist_in_vllm() -> None:
    """The vllm: names the alert rules and dashboard query exist, as vLLM puts them on the
    wire; the runbooks may also name a histogram by its base name. Each carries only vLLM's
    model_name and engine labels, which every query sums away by the job's labels."""
    series = vllm_series()
    histograms = {n.removesuffix("_bucket") for n in series if n.endswith("_bucket")}
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [a["expr"] for a in alerts()]
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    read = set().union(*(vllm_names_in(e) for e in exprs))
    assert {"vllm:request_queue_time_seconds_bucket", "vllm:num_preemptions_total"} <= read
    assert not read - series.keys(), f"queries read vLLM series vLLM lacks: {read - series.keys()}"
    for name in read:
        assert series[name] == ["engine", "model_name"], (name, series[name])
    named = vllm_names_in(RUNBOOKS.read_text())
    unknown = named - series.keys() - histograms
    assert not unknown, f"docs/runbooks.md names vLLM series vLLM lacks: {unknown}"
