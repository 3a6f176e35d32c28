"""What the API server and JobSet's webhook would check in the operator's rendered objects.

Three layers, each independent of the operator's code:
- JobSets against JobSet's published API models (PyPI `kubeflow-trainer-api`, generated
  from jobset.x-k8s.io/v1alpha2): the object must round-trip through them unchanged, so an
  unknown or misspelt field fails as well as a wrong type;
- every other object, and the Job and Pod templates inside a JobSet wrapped as a Job and a
  Pod, strictly against Kubernetes' OpenAPI schemas (`kubernetes-validate`);
- the semantic rules the API server and JobSet's webhook apply that no schema expresses:
  DNS-label lengths of generated Job and pod names, podFailurePolicy only with
  restartPolicy Never, extended resources (GPUs) requested equal to their limits, every
  mount naming a volume, unique volume names and mount paths, failure-policy rule names and
  actions valid on a stock JobSet, targets naming replicated jobs, Services selecting pods.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

KUBERNETES_VERSION = "1.32.0"  # the kubectl on these machines; the oldest we promise
CRD_KINDS = {"PodMonitor", "JobSet"}  # not in Kubernetes' own schemas
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # JobSet's API docs
STOCK_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
GATED_ACTIONS = {"RestartJob", "RestartJobAndIgnoreMaxRestarts"}  # alpha gate RestartJob
POD_NAME_LIMIT = 63 - 6  # JobSet's webhook: room for the Job controller's "-xxxxx"

Obj = dict[str, Any]


def check_rendered(objs: list[Obj], *, restart_job_gate: bool = False) -> list[str]:
    """Every problem found in a rendered job's objects (empty when all pass)."""
    problems: list[str] = []
    pods: list[tuple[str, Obj]] = []  # (where, pod template)
    for obj in objs:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] == "JobSet":
            problems += [f"{where}: {p}" for p in check_jobset(obj, restart_job_gate)]
            for rjob in obj["spec"]["replicatedJobs"]:
                pods.append((f"{where} {rjob['name']}", rjob["template"]["spec"]["template"]))
        elif obj["kind"] not in CRD_KINDS:
            problems += [f"{where}: {p}" for p in schema_problems(obj)]
    for where, template in pods:
        problems += [f"{where} pod: {p}" for p in check_pod_spec(template["spec"])]
    problems += check_selectors(objs)
    return problems


def schema_problems(obj: Obj) -> list[str]:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"schema: {exc.message} at {'.'.join(str(p) for p in exc.path)}"]
    return []


def check_jobset(js: Obj, restart_job_gate: bool) -> list[str]:
    out: list[str] = []
    model = JobsetV1alpha2JobSet.from_dict(js)
    back = model.to_dict() if model is not None else {}
    if _drop_none(back) != _drop_none(js):
        out.append("does not round-trip through JobSet's API models (unknown or mistyped field)")
    name = js["metadata"]["name"]
    if not DNS_1035.match(name) or len(name) > 63:
        out.append(f"name {name!r} is not a DNS-1035 label")
    spec = js["spec"]
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    for rname, rjob in rjobs.items():
        job_spec = rjob["template"]["spec"]
        pods = job_spec.get("parallelism", 1)
        longest = f"{name}-{rname}-{rjob['replicas'] - 1}-{max(pods - 1, 0)}"
        if len(longest) > POD_NAME_LIMIT:
            out.append(f"generated pod name {longest!r} is over {POD_NAME_LIMIT} characters")
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-{rname}-0", **rjob["template"].get("metadata", {})},
            "spec": job_spec,
        }
        out += [f"Job {rname}: {p}" for p in schema_problems(job)]
        policy = job_spec["template"]["spec"].get("restartPolicy")
        if job_spec.get("podFailurePolicy") and policy != "Never":
            out.append(f"Job {rname}: podFailurePolicy needs restartPolicy Never, not {policy}")
    failure = spec.get("failurePolicy") or {}
    for rule in failure.get("rules") or []:
        if not RULE_NAME.match(rule.get("name", "")):
            out.append(f"failure rule name {rule.get('name')!r} does not match {RULE_NAME.pattern}")
        action = rule.get("action")
        if action in GATED_ACTIONS and not restart_job_gate:
            out.append(f"failure rule {rule['name']}: {action} needs JobSet's RestartJob gate")
        elif action not in STOCK_ACTIONS | GATED_ACTIONS:
            out.append(f"failure rule {rule['name']}: unknown action {action!r}")
        for target in rule.get("targetReplicatedJobs") or []:
            if target not in rjobs:
                out.append(f"failure rule {rule['name']}: no replicated job {target!r}")
        for pattern in rule.get("onJobFailureMessagePatterns") or []:
            re.compile(pattern)
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
        if target not in rjobs:
            out.append(f"successPolicy: no replicated job {target!r}")
    return out


def check_pod_spec(pod: Obj) -> list[str]:
    out: list[str] = []
    volume_names = [v["name"] for v in pod.get("volumes") or []]
    if len(set(volume_names)) != len(volume_names):
        out.append(f"duplicate volume names {volume_names}")
    wrapped = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": pod}
    out += schema_problems(wrapped)
    for c in pod["containers"]:
        paths = [m["mountPath"] for m in c.get("volumeMounts") or []]
        if len(set(paths)) != len(paths):
            out.append(f"container {c['name']}: duplicate mount paths {paths}")
        for m in c.get("volumeMounts") or []:
            if m["name"] not in volume_names:
                out.append(f"container {c['name']}: mount {m['name']!r} names no volume")
        res = c.get("resources") or {}
        requests, limits = res.get("requests") or {}, res.get("limits") or {}
        for key in set(requests) | set(limits):
            if "/" in key and not key.startswith(("kubernetes.io/", "requests.")):
                if key not in limits:
                    out.append(f"container {c['name']}: {key} requested without a limit")
                elif key in requests and str(requests[key]) != str(limits[key]):
                    out.append(
                        f"container {c['name']}: {key} request {requests[key]} "
                        f"!= limit {limits[key]}"
                    )
        port_names = {p.get("name") for p in c.get("ports") or []}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            if isinstance(port, str) and port not in port_names:
                out.append(f"container {c['name']}: {probe} port {port!r} is not a named port")
    return out


def check_selectors(objs: list[Obj]) -> list[str]:
    """Every Service selects at least one of the job's pod templates."""
    templates = [
        rjob["template"]["spec"]["template"]["metadata"].get("labels") or {}
        for o in objs
        if o["kind"] == "JobSet"
        for rjob in o["spec"]["replicatedJobs"]
    ]
    out = []
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"].get("selector") or {}
        if not any(all(labels.get(k) == v for k, v in sel.items()) for labels in templates):
            out.append(f"Service {svc['metadata']['name']}: selector {sel} selects no pod")
    return out


def _drop_none(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_none(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [_drop_none(v) for v in node]
    return node
