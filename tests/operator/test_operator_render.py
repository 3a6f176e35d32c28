"""Rendering: spec -> a JobSet and its companions, checked as the API server and JobSet's
webhook would check them (rendered_checks.py), and against the pod contract."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from rendered_checks import check_rendered

from gspo_api import ports
from gspo_operator import names
from gspo_operator.manifest import PROMETHEUS_POD_LABELS, ClusterPolicy, check_job
from gspo_operator.render import render_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def job(**spec_overrides) -> dict:
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"].update(namespace="team-a", uid="0b5e8a76-4a7f-4f3e-9d77-2f1c7f1f8e11")
    if "metadata_name" in spec_overrides:
        doc["metadata"]["name"] = spec_overrides.pop("metadata_name")
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return doc


def rendered(doc: dict, restart_job_gate: bool = False) -> list[dict]:
    spec, problems = check_job(doc, ClusterPolicy(restart_job_gate=restart_job_gate))
    assert spec is not None, problems
    return render_job(doc, spec, token="t0ken")


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def env_of(container: dict) -> dict:
    """The environment as the container sees it: the last of duplicate names wins."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def jobset(objs: list[dict]) -> dict:
    (js,) = by_kind(objs, "JobSet")
    return js


def replicated(objs: list[dict], name: str) -> dict:
    (rjob,) = [r for r in jobset(objs)["spec"]["replicatedJobs"] if r["name"] == name]
    return rjob


def pod_template(objs: list[dict], role: str) -> dict:
    return replicated(objs, role)["template"]["spec"]["template"]


def container(objs: list[dict], role: str) -> dict:
    (c,) = pod_template(objs, role)["spec"]["containers"]
    return c


CASES = {
    "example": job(),
    "user-pod-settings": job(
        learner__env=[
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wb", "key": "k"}}},
            {"name": "NCCL_SOCKET_IFNAME", "value": "ib0"},
        ],
        learner__envFrom=[{"configMapRef": {"name": "team-env"}, "prefix": "TEAM_"}],
        learner__serviceAccountName="trainer",
        learner__imagePullSecrets=["registry"],
        learner__labels={"team": "math"},
        learner__annotations={"sidecar.istio.io/inject": "false"},
        learner__resources={"limits": {"rdma/hca": 1}, "requests": {"rdma/hca": 1}},
        rollout__volumes=[{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
        rollout__volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
        checkpoint={"storageClassName": "fast", "retainClaim": True},
        metadata_name="t",
    ),
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


JOB = "qwen3-30b-a3b-math"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rendered_object_passes_the_api_server_and_jobset_checks(case: str) -> None:
    objs = rendered(CASES[case])
    assert check_rendered(objs) == []
    assert {"ConfigMap", "Secret", "Service", "NetworkPolicy", "JobSet"} <= {
        o["kind"] for o in objs
    }


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda js: js["spec"].update(suspendd=True), "round-trip"),
        (
            lambda js: _learner_pod(js)["spec"].update(restartPolicyy="Never"),
            "Additional properties",
        ),
        (
            lambda js: _learner_container(js)["resources"].update(
                requests={"nvidia.com/gpu": "4"}, limits={"nvidia.com/gpu": "8"}
            ),
            "request 4 != limit 8",
        ),
        (
            lambda js: _learner_pod(js)["spec"].update(restartPolicy="OnFailure"),
            "restartPolicy Never",
        ),
        (lambda js: js["spec"]["failurePolicy"]["rules"][2].update(action="RestartJob"), "gate"),
        (lambda js: js["spec"]["failurePolicy"]["rules"][0].update(name="bad-name"), "rule name"),
        (lambda js: js["metadata"].update(name="x" * 50), "over 57 characters"),
        (
            lambda js: _learner_container(js)["volumeMounts"].append(
                {"name": "nope", "mountPath": "/nope"}
            ),
            "names no volume",
        ),
    ],
)
def test_the_checks_catch_what_a_cluster_would_refuse(breakage, expected: str) -> None:
    """The checks above can fail: each breakage is one a real cluster refuses."""
    objs = rendered(job())
    breakage(jobset(objs))
    problems = check_rendered(objs)
    assert any(expected in p for p in problems), problems


def _learner_pod(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _learner_container(js: dict) -> dict:
    return _learner_pod(js)["spec"]["containers"][0]


def test_every_child_is_labelled_and_owned() -> None:
    doc = job()
    for obj in rendered(doc):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"][names.JOB_LABEL] == JOB
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "gspo-operator"
        assert meta["labels"][names.ROLE_LABEL] == meta["labels"]["app.kubernetes.io/component"]
        if obj["kind"] == "PersistentVolumeClaim":
            # Kept when the job goes (ttlSecondsAfterFinished included): no owner to follow.
            assert "ownerReferences" not in meta
            assert meta["annotations"][names.JOB_UID_ANNOTATION] == doc["metadata"]["uid"]
            continue
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == doc["metadata"]["uid"]
        assert owner["kind"] == "GSPOJob" and owner["controller"] is True


def test_a_claim_goes_with_the_job_only_when_asked() -> None:
    doc = job(checkpoint={"retainClaim": False})
    (claim,) = by_kind(rendered(doc), "PersistentVolumeClaim")
    assert claim["metadata"]["ownerReferences"][0]["uid"] == doc["metadata"]["uid"]
    assert "annotations" not in claim["metadata"]


def test_volume_ownership_is_changed_only_on_a_root_mismatch() -> None:
    """fsGroup alone makes the kubelet chown every file of the checkpoint and model volumes at
    each pod start (hours on a multi-terabyte claim); OnRootMismatch only when needed."""
    for obj in by_kind(rendered(job()), "JobSet"):
        for rjob in obj["spec"]["replicatedJobs"]:
            pod = rjob["template"]["spec"]["template"]["spec"]
            assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_one_jobset_runs_the_learner_group_and_one_job_per_server() -> None:
    objs = rendered(job())
    assert not by_kind(objs, "Pod") and not by_kind(objs, "Deployment")
    js = jobset(objs)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["name"] == JOB
    assert js["metadata"]["labels"][names.QUEUE_LABEL] == "gpu-team"  # Kueue admits it whole
    assert js["spec"]["suspend"] is False
    assert js["spec"]["network"] == {
        "enableDNSHostnames": True,
        "subdomain": JOB,
        "publishNotReadyAddresses": True,
    }
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["learner"]}
    learner = replicated(objs, "learner")
    assert learner["replicas"] == 1
    spec = learner["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 2
    assert spec["backoffLimit"] == 0
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In",
                                              "values": [2]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In",
                                              "values": [143]}},
    ]  # fmt: skip
    rollout = replicated(objs, "rollout")
    assert rollout["replicas"] == 4
    rspec = rollout["template"]["spec"]
    assert rspec["parallelism"] == 1 and rspec["backoffLimit"] == 20
    assert rspec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]


def test_failure_policy_fails_on_exit_2_and_restarts_otherwise() -> None:
    policy = jobset(rendered(job()))["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 3
    rules = {r["name"]: r for r in policy["rules"]}
    assert [r["name"] for r in policy["rules"]] == [
        "LearnerInvalidConfig", "LearnerDisrupted", "LearnerFailed", "RolloutOutOfRetries"
    ]  # fmt: skip
    # The Job controller's message for a FailJob rule on exit code 2, as it writes it:
    exit_2 = (
        "Container learner for pod team-a/x-learner-0-1-abcde failed with exit code 2 "
        "matching FailJob rule at index 0"
    )
    disrupted = (
        "Pod team-a/x-learner-0-0-abcde has condition DisruptionTarget matching FailJob rule "
        "at index 1"
    )
    import re

    (p,) = rules["LearnerInvalidConfig"]["onJobFailureMessagePatterns"]
    assert re.search(p, exit_2) and not re.search(p, disrupted)
    # A learner stopped by SIGTERM (evicted, drained) exits 143 after its final checkpoint.
    stopped = exit_2.replace("exit code 2 ", "exit code 143 ").replace("index 0", "index 2")
    patterns = rules["LearnerDisrupted"]["onJobFailureMessagePatterns"]
    assert any(re.search(p, disrupted) for p in patterns)
    assert any(re.search(p, stopped) for p in patterns)
    assert not any(re.search(p, exit_2) for p in patterns)
    crash = exit_2.replace("exit code 2 ", "exit code 1 ")
    assert not any(re.search(p, crash) for p in patterns)
    (p,) = rules["LearnerInvalidConfig"]["onJobFailureMessagePatterns"]
    assert not re.search(p, stopped)
    assert rules["LearnerInvalidConfig"]["action"] == "FailJobSet"
    assert rules["LearnerDisrupted"]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert rules["LearnerFailed"]["action"] == "RestartJobSet"
    assert rules["RolloutOutOfRetries"] == {
        "name": "RolloutOutOfRetries", "action": "FailJobSet", "targetReplicatedJobs": ["rollout"]
    }  # fmt: skip
    gated = rendered(job(runPolicy__restartScope="learner"), restart_job_gate=True)
    (rule,) = [
        r for r in jobset(gated)["spec"]["failurePolicy"]["rules"] if r["name"] == "LearnerFailed"
    ]
    assert rule["action"] == "RestartJob"


def test_learner_pods_carry_the_rendezvous_contract() -> None:
    objs = rendered(job())
    pod = pod_template(objs, "learner")
    spec = pod["spec"]
    c = container(objs, "learner")
    env = env_of(c)
    assert "hostname" not in spec and "subdomain" not in spec  # JobSet and the Job set them
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] >= 600
    # Job "<jobset>-learner-0", Indexed pod 0's host name "<job>-0", JobSet's subdomain
    assert env["MASTER_ADDR"] == f"{JOB}-learner-0-0.{JOB}.team-a.svc"
    assert env["MASTER_PORT"] == str(ports.RENDEZVOUS_PORT)
    assert env[ports.ENV_NNODES] == "2"
    assert env[ports.ENV_NODE_RANK] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env[ports.ENV_NPROC_PER_NODE] == "8"
    assert env[ports.ENV_POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[ports.ENV_ROLLOUT_URLS] == f"dns+http://{JOB}-rollout.team-a.svc:8000"
    assert env[ports.ENV_CONFIG_PATH] == "/etc/gspo/gspojob.yaml"
    assert env[ports.ENV_CHECKPOINT_DIR] == ports.CHECKPOINT_DIR
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    for name in (ports.ENV_JOB_TOKEN, ports.ENV_JOB_TOKEN_EARLIER):  # images of a release before
        assert env[name]["secretKeyRef"] == {"name": f"{JOB}-job-token", "key": "token"}
    assert c["command"] == ["gspo", "learner", "--config", "/etc/gspo/gspojob.yaml"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    # Every learner pod can become Ready: each serves /healthz on the metrics port.
    assert c["readinessProbe"]["httpGet"] == {"path": ports.HEALTH_PATH, "port": "metrics"}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {p["containerPort"] for p in c["ports"]} == {29500, 29600, 9090}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {
        "/etc/gspo": "config",
        "/checkpoints": "checkpoints",
        "/dev/shm": "dshm",
        "/home/gspo": "home",
        "/tmp": "tmp",
        "/models": "model-cache",
        "/data/math": "math-data",
    }
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == f"{JOB}-checkpoints"
    assert spec["priorityClassName"] == "training-high"
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert spec["automountServiceAccountToken"] is False


def test_the_example_finds_its_data_and_model_on_the_pods() -> None:
    """The data set lies under a mounted claim; the model comes from the Hub with a token."""
    doc = job()
    objs = rendered(doc)
    c = container(objs, "learner")
    source = doc["spec"]["data"]["source"]
    (mount,) = [m for m in c["volumeMounts"] if source.startswith(m["mountPath"] + "/")]
    vols = {v["name"]: v for v in pod_template(objs, "learner")["spec"]["volumes"]}
    assert vols[mount["name"]]["persistentVolumeClaim"]["claimName"] == "math-data"
    for role in ("learner", "rollout"):
        env = env_of(container(objs, role))
        assert "HF_HUB_OFFLINE" not in env  # a Hub name downloads on a cluster
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert env["HF_HOME"] == "/models"
    offline = env_of(container(rendered(job(model__offline=True)), "rollout"))
    assert offline["HF_HUB_OFFLINE"] == "1"
    builtin = job(model={"name": "builtin:tiny-qwen3", "maxModelLen": 16384})
    assert env_of(container(rendered(builtin), "learner"))["HF_HUB_OFFLINE"] == "1"


def test_user_pod_settings_reach_the_pods_and_secrets_stay_references() -> None:
    doc = CASES["user-pod-settings"]
    objs = rendered(doc)
    pod = pod_template(objs, "learner")
    c = container(objs, "learner")
    env = env_of(c)
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wb", "key": "k"}}
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["MASTER_PORT"] == str(ports.RENDEZVOUS_PORT)  # the contract cannot be overridden
    assert c["envFrom"] == [{"configMapRef": {"name": "team-env"}, "prefix": "TEAM_"}]
    assert c["resources"]["limits"]["rdma/hca"] == "1"
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert "automountServiceAccountToken" not in pod["spec"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["metadata"]["labels"]["team"] == "math"
    assert pod["metadata"]["labels"][names.ROLE_LABEL] == "learner"
    assert pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    r = container(objs, "rollout")
    assert {"name": "scratch", "mountPath": "/scratch"} in r["volumeMounts"]
    (claim,) = by_kind(objs, "PersistentVolumeClaim")
    assert "ownerReferences" not in claim["metadata"]  # retainClaim: survives the job
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # two learner pods share it
    cm = one(objs, "ConfigMap", "t-config")
    assert "valueFrom" in cm["data"][ports.CONFIG_FILE]  # a reference, never a value


def test_cpu_learner_has_no_gpus_and_uses_the_named_claim() -> None:
    objs = rendered(CASES["cpu-existing-claim-no-monitor"])
    c = container(objs, "learner")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert env_of(c)[ports.ENV_NPROC_PER_NODE] == "1"
    assert not by_kind(objs, "PersistentVolumeClaim")
    assert not by_kind(objs, "PodMonitor")
    vols = {v["name"]: v for v in pod_template(objs, "learner")["spec"]["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared-ckpt"


def test_a_single_learner_pod_asks_for_a_read_write_once_claim() -> None:
    # Offloaded: the example's model fits one pod's 8 GPUs only so (the memory plan).
    one_pod = job(
        learner__replicas=1,
        learner__gpusPerReplica=8,
        algorithm__miniBatches=4,
        learner__offloadOptimizer=True,
    )
    (claim,) = by_kind(rendered(one_pod), "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    shared = job(
        learner__replicas=1, learner__offloadOptimizer=True, weightSync__method="filesystem"
    )
    (claim,) = by_kind(rendered(shared), "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # the servers read it too


def test_rollout_jobs_run_the_server_with_the_spec_flags() -> None:
    objs = rendered(CASES["filesystem-sync-scheduling"])
    pod = pod_template(objs, "rollout")
    assert pod["metadata"]["labels"][names.ROLE_LABEL] == "rollout"
    c = container(objs, "rollout")
    assert c["command"] == ["gspo", "rollout-server"]
    assert "--tensor-parallel-size=2" in c["args"] and "--port=8000" in c["args"]
    assert "--engine-arg=enable_prefix_caching=true" in c["args"]
    # weightSync filesystem: the server loads versions from the learner's volume, read-only
    assert "--weights-dir=/checkpoints/weights" in c["args"]
    mount = {m["name"]: m for m in c["volumeMounts"]}["checkpoints"]
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}
    server = container(rendered(CASES["example"]), "rollout")
    assert not any(a.startswith("--weights-dir") for a in server["args"])
    assert "--engine-arg=revision=main" in c["args"]
    # Ready once the engine serves, not once synced: Kueue's WaitForPodsReady times readiness.
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["schedulerName"] == "volcano"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    from gspo_trainer.rollout.launch import parse_args

    parsed = parse_args(c["args"])
    assert parsed.tensor_parallel_size == 2 and parsed.max_model_len == 10240
    # Generation and control need the job's token, which the pod has from the job's Secret
    for name in (ports.ENV_JOB_TOKEN, ports.ENV_JOB_TOKEN_EARLIER):
        assert env_of(c)[name]["secretKeyRef"] == {"name": f"{JOB}-job-token", "key": "token"}
    headless = one(objs, "Service", f"{JOB}-rollout")
    api = one(objs, "Service", f"{JOB}-rollout-api")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert api["spec"]["type"] == "ClusterIP"


def test_config_map_holds_the_validated_manifest_the_learner_reads_back() -> None:
    doc = job()
    cm = one(rendered(doc), "ConfigMap", f"{JOB}-config")
    manifest = yaml.safe_load(cm["data"][ports.CONFIG_FILE])
    assert manifest["metadata"] == {"name": JOB, "namespace": "team-a"}
    spec, problems = check_job(manifest)
    assert spec is not None, problems
    assert spec == check_job(doc)[0]


def test_every_pod_runs_as_non_root_without_privilege_escalation() -> None:
    objs = rendered(job())
    for role in ("learner", "rollout"):
        spec = pod_template(objs, role)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def network_policy(policy: ClusterPolicy | None = None) -> dict:
    spec, problems = check_job(job())
    assert spec is not None, problems
    objs = render_job(job(), spec, token="t", policy=policy)
    assert check_rendered(objs) == []  # as the API server would check the peers
    (np,) = by_kind(objs, "NetworkPolicy")
    return np["spec"]


def sources(np_spec: dict, port: int) -> list[dict] | None:
    """The peers of the rule opening `port`, None when no rule opens it."""
    rules = [r for r in np_spec["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": port}]]
    assert len(rules) <= 1
    return rules[0]["from"] if rules else None


def test_network_policy_admits_only_the_jobs_pods_except_metrics() -> None:
    spec = network_policy()
    assert spec["podSelector"]["matchLabels"] == {names.JOB_LABEL: JOB}
    open_rules = [r for r in spec["ingress"] if "ports" not in r]
    assert open_rules == [{"from": [{"podSelector": {"matchLabels": {names.JOB_LABEL: JOB}}}]}]
    reachable = {p["port"] for r in spec["ingress"] if "ports" in r for p in r["ports"]}
    assert ports.RENDEZVOUS_PORT not in reachable and ports.WEIGHT_SYNC_PORT not in reachable
    # Without the admin's policy: the chart's defaults, Prometheus and the operator's pods.
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": PROMETHEUS_POD_LABELS}}
    operator = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gspo-operator"}},
    }
    assert sources(spec, 9090) == [prometheus, operator]
    assert sources(spec, ports.ROLLOUT_HTTP_PORT) == [prometheus]
    assert {"namespaceSelector": {}} not in sources(spec, 9090), "open to every pod again"


def test_network_policy_metrics_sources_come_from_the_cluster_policy() -> None:
    scrapers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"podSelector": {"matchLabels": {"app": "vmagent"}}},
    ]
    policy = ClusterPolicy(
        metrics_from=tuple(scrapers),
        operator_namespace="gspo-system",
        operator_pod_labels={
            "app.kubernetes.io/name": "gspo-operator",
            "app.kubernetes.io/instance": "ops",
        },
    )
    spec = network_policy(policy)
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gspo-system"}},
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "gspo-operator",
                "app.kubernetes.io/instance": "ops",
            }
        },
    }
    assert sources(spec, 9090) == [*scrapers, operator]
    assert sources(spec, ports.ROLLOUT_HTTP_PORT) == scrapers  # the operator never calls it
    assert policy.metrics_from == tuple(scrapers)  # rendering copied, never aliased
    # No scrapers at all: the metrics port admits the operator alone, and the rollout port's
    # rule is left out (an empty `from` would admit every pod of the cluster).
    spec = network_policy(ClusterPolicy(metrics_from=(), operator_namespace="gspo-system"))
    assert sources(spec, 9090) == [
        {**operator, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gspo-operator"}}}
    ]
    assert sources(spec, ports.ROLLOUT_HTTP_PORT) is None
    assert all(rule["from"] for rule in spec["ingress"])


def test_pod_monitor_is_structurally_sound() -> None:
    objs = rendered(job())
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) == {"selector", "podMetricsEndpoints"}
    port_names = {
        p["name"] for role in ("learner", "rollout") for p in container(objs, role)["ports"]
    }
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


def test_suspend_renders_a_suspended_jobset() -> None:
    assert jobset(rendered(job(runPolicy__suspend=True)))["spec"]["suspend"] is True


def test_render_cli_prints_valid_multi_document_yaml(gspo) -> None:
    out = gspo("render", "examples/gspojob.yaml")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds.count("JobSet") == 1 and "PodMonitor" in kinds and "Pod" not in kinds
    assert all(d["metadata"]["namespace"] == "default" for d in docs)
    assert check_rendered(docs) == []


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
