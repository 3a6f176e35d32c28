"""Security properties of every rendered pod, and the NetworkPolicy around a job's ports.

Checked on the shipped example and on a minimal job (defaults everywhere): non-root, no
privilege escalation, no capabilities, a read-only root filesystem with writable emptyDirs
where caches go, no service account token, and rendezvous/sync ports open to the job only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_api import ports
from gspo_operator import names
from gspo_operator.manifest import check_job
from gspo_operator.render import HOME_DIR, TMP_DIR, render_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
MINIMAL = {
    "apiVersion": "gspo.dev/v1alpha1",
    "kind": "GSPOJob",
    "metadata": {"name": "mini", "namespace": "ns1"},
    "spec": {
        "model": {"name": "org/model"},
        "data": {"source": "builtin:addition"},
        "reward": {"kind": "arithmetic"},
    },
}
JOBS = {"example": EXAMPLE, "minimal": MINIMAL}


def _objects(doc: dict) -> list[dict]:
    spec, problems = check_job(doc)
    assert spec is not None, problems
    return render_job(doc, spec, token="s3cret-token")


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(what, pod spec) of every pod the job makes: the JobSet's learner and rollout templates."""
    out = []
    for obj in _objects(doc):
        if obj["kind"] == "JobSet":
            for rjob in obj["spec"]["replicatedJobs"]:
                out.append((rjob["name"], rjob["template"]["spec"]["template"]["spec"]))
    assert len(out) == 2
    return out


def containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("case", JOBS)
def test_pods_run_as_non_root_without_privileges(case: str) -> None:
    for what, pod in pod_specs(JOBS[case]):
        sec = pod["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0, what
        assert sec["seccompProfile"] == {"type": "RuntimeDefault"}, what
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in containers(pod):
            csec = c["securityContext"]
            assert csec["allowPrivilegeEscalation"] is False, what
            assert csec.get("privileged") is not True, what
            assert csec["capabilities"]["drop"] == ["ALL"], what
            assert not csec["capabilities"].get("add"), what
            assert csec.get("runAsUser", sec["runAsUser"]) != 0, what


@pytest.mark.parametrize("case", JOBS)
def test_root_filesystem_is_read_only_with_writable_caches(case: str) -> None:
    for what, pod in pod_specs(JOBS[case]):
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in containers(pod):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, what
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            # DeepSpeed (torch_extensions), vLLM, triton and HF write under $HOME/.cache and /tmp.
            for path in (HOME_DIR, TMP_DIR):
                assert mounts.get(path) in empty_dirs, f"{what}: {path} is not an emptyDir"
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HOME"] == HOME_DIR and env["TMPDIR"] == TMP_DIR, what
            assert env["XDG_CACHE_HOME"].startswith(HOME_DIR + "/"), what


def test_a_users_cache_env_overrides_the_default() -> None:
    doc = yaml.safe_load(yaml.safe_dump(MINIMAL))
    doc["spec"]["rollout"] = {"env": [{"name": "XDG_CACHE_HOME", "value": "/models/cache"}]}
    (rollout,) = [spec for what, spec in pod_specs(doc) if what == "rollout"]
    env = rollout["containers"][0]["env"]
    last = {e["name"]: e.get("value") for e in env}  # Kubernetes keeps the last duplicate
    assert last["XDG_CACHE_HOME"] == "/models/cache"


@pytest.mark.parametrize("case", JOBS)
def test_no_service_account_token_is_mounted(case: str) -> None:
    # The learner finds rollout servers by DNS (rollout/discovery.py); no pod calls the API.
    for what, pod in pod_specs(JOBS[case]):
        assert pod["automountServiceAccountToken"] is False, what
        assert "serviceAccountName" not in pod, what


def test_a_named_service_account_gets_its_token() -> None:
    """A user who names a service account (e.g. for workload identity) wants its token."""
    doc = yaml.safe_load(yaml.safe_dump(MINIMAL))
    doc["spec"]["learner"] = {"serviceAccountName": "trainer"}
    learner = dict(pod_specs(doc))["learner"]
    assert learner["serviceAccountName"] == "trainer"
    assert "automountServiceAccountToken" not in learner
    assert dict(pod_specs(doc))["rollout"]["automountServiceAccountToken"] is False


def test_the_trainer_never_talks_to_the_kubernetes_api() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "trainer").rglob("*.py")
        if "import kubernetes" in p.read_text() or "from kubernetes" in p.read_text()
    ]
    assert offenders == []


def _ports_of(rule: dict[str, Any]) -> set[int] | None:
    """The TCP ports a rule admits; None means every port."""
    if not rule.get("ports"):
        return None
    return {p["port"] for p in rule["ports"]}


@pytest.mark.parametrize("case", JOBS)
def test_network_policy_admits_only_the_jobs_pods_to_rendezvous_and_sync(case: str) -> None:
    doc = JOBS[case]
    job = doc["metadata"]["name"]
    objs = _objects(doc)
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    own = {"podSelector": {"matchLabels": names.selector(job)}}
    # The policy covers every pod of the job.
    for obj in objs:
        if obj["kind"] in ("Pod", "Deployment"):
            labels = obj["metadata"]["labels"]
            if obj["kind"] == "Deployment":
                labels = obj["spec"]["template"]["metadata"]["labels"]
            assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    private = {ports.RENDEZVOUS_PORT, ports.WEIGHT_SYNC_PORT}
    for rule in spec["ingress"]:
        admitted = _ports_of(rule)
        if rule["from"] == [own]:
            continue  # the job's own pods: every port (NCCL/gloo also open ephemeral ones)
        assert admitted is not None, f"a rule for {rule['from']} admits every port"
        assert not admitted & private, f"{rule['from']} reaches {admitted & private}"
    # What is open beyond the job: the learner's metrics port to any namespace (the operator
    # reads /progress there), the rollout port to Prometheus pods only.
    outside = {p for r in spec["ingress"] if r["from"] != [own] for p in _ports_of(r) or ()}
    metrics_port = (doc["spec"].get("metrics") or {}).get("port", 9090)
    assert outside == {metrics_port, ports.ROLLOUT_HTTP_PORT}
