"""Rendering: spec -> Kubernetes objects, checked against the real schemas and the pod contract."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gspo_operator import names
from gspo_operator.manifest import check_job
from gspo_operator.render import render_job
from gspo_trainer import ports

REPO = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.32.0"  # the kubectl on these machines; the oldest we promise
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def job(**spec_overrides) -> dict:
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"].update(namespace="team-a", uid="0b5e8a76-4a7f-4f3e-9d77-2f1c7f1f8e11")
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return doc


def rendered(doc: dict, **kw) -> list[dict]:
    spec, problems = check_job(doc)
    assert spec is not None, problems
    return render_job(doc, spec, token="t0ken", **kw)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


CASES = {
    "example": job(),
    "cpu-existing-claim-no-monitor": job(
        learner__gpusPerReplica=0,
        learner__replicas=1,
        learner__resources={},
        rollout__gpusPerReplica=0,
        rollout__tensorParallelSize=1,
        rollout__resources={},
        checkpoint={"claimName": "shared-ckpt"},
        metrics={"podMonitor": False},
        algorithm__miniBatches=1,
    ),
    "filesystem-sync-scheduling": job(
        weightSync__method="filesystem",
        rollout__engineArgs={"enable_prefix_caching": True, "seed": 3},
        runPolicy__scheduling={
            "nodeSelector": {"pool": "h100"},
            "schedulerName": "volcano",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
        },
        model__revision="main",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_passes_strict_schema_validation(case: str) -> None:
    objs = rendered(CASES[case])
    checked = 0
    for obj in objs:
        if obj["kind"] == "PodMonitor":
            continue  # a CRD kind the offline schemas do not know; checked structurally below
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 8


def test_invalid_object_is_caught_by_the_schema_check() -> None:
    """The validation above can fail: a misspelt field is rejected in strict mode."""
    pod = one(rendered(job()), "Pod", "qwen3-30b-a3b-math-learner-0")
    pod["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_every_child_is_labelled_and_owned() -> None:
    doc = job()
    for obj in rendered(doc):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"][names.JOB_LABEL] == "qwen3-30b-a3b-math"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "gspo-operator"
        assert meta["labels"][names.ROLE_LABEL] == meta["labels"]["app.kubernetes.io/component"]
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == doc["metadata"]["uid"]
        assert owner["kind"] == "GSPOJob" and owner["controller"] is True


def test_learner_pods_carry_the_rendezvous_contract() -> None:
    objs = rendered(job())
    pods = by_kind(objs, "Pod")
    assert [p["metadata"]["name"] for p in pods] == [
        "qwen3-30b-a3b-math-learner-0",
        "qwen3-30b-a3b-math-learner-1",
    ]
    svc = one(objs, "Service", "qwen3-30b-a3b-math-learner")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    for rank, pod in enumerate(pods):
        spec = pod["spec"]
        (c,) = spec["containers"]
        env = env_of(c)
        assert spec["hostname"] == f"qwen3-30b-a3b-math-learner-{rank}"
        assert spec["subdomain"] == svc["metadata"]["name"]
        assert spec["restartPolicy"] == "Never"
        assert spec["terminationGracePeriodSeconds"] >= 600
        assert (
            env["MASTER_ADDR"]
            == "qwen3-30b-a3b-math-learner-0.qwen3-30b-a3b-math-learner.team-a.svc"
        )
        assert env["MASTER_PORT"] == str(ports.RENDEZVOUS_PORT)
        assert env[ports.ENV_NNODES] == "2"
        assert env[ports.ENV_NODE_RANK] == str(rank)
        assert env[ports.ENV_NPROC_PER_NODE] == "8"
        assert env[ports.ENV_POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert (
            env[ports.ENV_ROLLOUT_URLS] == "dns+http://qwen3-30b-a3b-math-rollout.team-a.svc:8000"
        )
        assert env[ports.ENV_CONFIG_PATH] == "/etc/gspo/gspojob.yaml"
        assert env[ports.ENV_CHECKPOINT_DIR] == ports.CHECKPOINT_DIR
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env[ports.ENV_SYNC_TOKEN]["secretKeyRef"]["name"] == "qwen3-30b-a3b-math-sync-token"
        assert c["command"] == ["gspo", "learner", "--config", "/etc/gspo/gspojob.yaml"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert c["readinessProbe"]["httpGet"]["path"] == "/progress"
        assert {p["containerPort"] for p in c["ports"]} == {29500, 29600, 9090}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts == {
            "/etc/gspo": "config",
            "/checkpoints": "checkpoints",
            "/dev/shm": "dshm",
            "/home/gspo": "home",
            "/tmp": "tmp",
        }
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
        assert (
            vols["checkpoints"]["persistentVolumeClaim"]["claimName"]
            == "qwen3-30b-a3b-math-checkpoints"
        )
        # Scheduling passthrough and the Kueue pod group
        assert spec["priorityClassName"] == "training-high"
        assert spec["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        assert pod["metadata"]["labels"][names.QUEUE_LABEL] == "gpu-team"
        assert pod["metadata"]["annotations"][names.POD_GROUP_COUNT_ANNOTATION] == "2"


def test_cpu_learner_has_no_gpus_and_uses_the_named_claim() -> None:
    objs = rendered(CASES["cpu-existing-claim-no-monitor"])
    (pod,) = by_kind(objs, "Pod")
    (c,) = pod["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert env_of(c)[ports.ENV_NPROC_PER_NODE] == "1"
    assert not by_kind(objs, "PersistentVolumeClaim")
    assert not by_kind(objs, "PodMonitor")
    claim = {v["name"]: v for v in pod["spec"]["volumes"]}["checkpoints"]
    assert claim["persistentVolumeClaim"]["claimName"] == "shared-ckpt"


def test_rollout_deployment_runs_the_server_with_the_spec_flags() -> None:
    objs = rendered(CASES["filesystem-sync-scheduling"])
    dep = one(objs, "Deployment", "qwen3-30b-a3b-math-rollout")
    assert dep["spec"]["replicas"] == 4
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"][names.ROLE_LABEL] == "rollout"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["gspo", "rollout-server"]
    assert "--tensor-parallel-size=2" in c["args"] and "--port=8000" in c["args"]
    assert "--engine-arg=enable_prefix_caching=true" in c["args"]
    # weightSync filesystem: the server loads versions from the learner's volume, read-only
    assert "--weights-dir=/checkpoints/weights" in c["args"]
    mount = {m["name"]: m for m in c["volumeMounts"]}["checkpoints"]
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}
    (plain,) = by_kind(rendered(CASES["example"]), "Deployment")  # the broadcast
    (server,) = plain["spec"]["template"]["spec"]["containers"]
    assert not any(a.startswith("--weights-dir") for a in server["args"])
    assert "--engine-arg=revision=main" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"/dev/shm", "/checkpoints", "/home/gspo", "/tmp"}
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["schedulerName"] == "volcano"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    # The server's flags parse with the server's own argument parser.
    from gspo_trainer.rollout.server import parse_args

    parsed = parse_args(c["args"])
    assert parsed.tensor_parallel_size == 2 and parsed.max_model_len == 10240
    headless = one(objs, "Service", "qwen3-30b-a3b-math-rollout")
    api = one(objs, "Service", "qwen3-30b-a3b-math-rollout-api")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert api["spec"]["type"] == "ClusterIP"


def test_config_map_holds_the_validated_manifest_the_learner_reads_back() -> None:
    doc = job()
    cm = one(rendered(doc), "ConfigMap", "qwen3-30b-a3b-math-config")
    manifest = yaml.safe_load(cm["data"][ports.CONFIG_FILE])
    assert manifest["metadata"] == {"name": "qwen3-30b-a3b-math", "namespace": "team-a"}
    spec, problems = check_job(manifest)
    assert spec is not None, problems
    assert spec == check_job(doc)[0]


def test_every_pod_runs_as_non_root_without_privilege_escalation() -> None:
    objs = rendered(job())
    pod_specs = [p["spec"] for p in by_kind(objs, "Pod")]
    pod_specs += [d["spec"]["template"]["spec"] for d in by_kind(objs, "Deployment")]
    assert len(pod_specs) == 3
    for spec in pod_specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_network_policy_admits_only_the_jobs_pods_except_metrics() -> None:
    (np,) = by_kind(rendered(job()), "NetworkPolicy")
    spec = np["spec"]
    assert spec["podSelector"]["matchLabels"] == {names.JOB_LABEL: "qwen3-30b-a3b-math"}
    open_rules = [r for r in spec["ingress"] if "ports" not in r]
    assert open_rules == [
        {"from": [{"podSelector": {"matchLabels": {names.JOB_LABEL: "qwen3-30b-a3b-math"}}}]}
    ]
    reachable = {p["port"] for r in spec["ingress"] if "ports" in r for p in r["ports"]}
    assert ports.RENDEZVOUS_PORT not in reachable and ports.WEIGHT_SYNC_PORT not in reachable
    metrics_rule = [
        r for r in spec["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": 9090}]
    ]
    assert metrics_rule[0]["from"] == [{"namespaceSelector": {}}]


def test_pod_monitor_is_structurally_sound() -> None:
    objs = rendered(job())
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) == {"selector", "podMetricsEndpoints"}
    port_names = {
        p["name"]
        for o in objs
        for spec in ([o["spec"]] if o["kind"] == "Pod" else
                     [o["spec"]["template"]["spec"]] if o["kind"] == "Deployment" else [])
        for c in spec["containers"]
        for p in c["ports"]
    }  # fmt: skip
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert set(ep) <= {"port", "path", "interval", "relabelings"}
        assert ep["port"] in port_names and ep["path"] == "/metrics" and ep["interval"] == "30s"
        (relabel,) = ep["relabelings"]
        assert relabel == {
            "sourceLabels": ["__meta_kubernetes_pod_label_gspo_dev_job_name"],
            "targetLabel": "gspojob",
        }


def test_names_are_deterministic_and_the_token_is_an_input() -> None:
    a, b = rendered(job()), rendered(job())
    assert a == b
    other = render_job(job(), check_job(job())[0], token="different")
    diff = [x["kind"] for x, y in zip(a, other, strict=True) if x != y]
    assert diff == ["Secret"]


def test_restart_generation_marks_learner_pods() -> None:
    pods = by_kind(rendered(job(), restart=3), "Pod")
    assert {p["metadata"]["annotations"][names.RESTART_ANNOTATION] for p in pods} == {"3"}


def test_render_cli_prints_valid_multi_document_yaml(gspo) -> None:
    out = gspo("render", "examples/gspojob.yaml")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Pod") == 2 and "Deployment" in kinds and "PodMonitor" in kinds
    assert all(d["metadata"]["namespace"] == "default" for d in docs)


def test_render_cli_redacts_secret_values_unless_asked(gspo) -> None:
    out = gspo("render", "examples/gspojob.yaml")
    assert out.returncode == 0, out.stderr
    (secret,) = [d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Secret"]
    assert secret["stringData"] == {"token": "<redacted>"}
    assert out.stdout.count("<redacted>") == 1  # only Secret values are touched
    shown = gspo("render", "--show-secrets", "examples/gspojob.yaml")
    assert shown.returncode == 0, shown.stderr
    (secret,) = [d for d in yaml.safe_load_all(shown.stdout) if d["kind"] == "Secret"]
    token = secret["stringData"]["token"]
    assert token != "<redacted>" and len(token) >= 32
    assert token not in out.stdout
