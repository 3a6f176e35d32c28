"""GSPOJob -> the Kubernetes objects it becomes. Pure: no API server, no kopf, no clock.

`render_job` is what the operator creates and what `gspo render` prints. The pod contract
(ports, environment, mounts, commands) comes from gspo_trainer.ports, the one place the
learner and the rollout server read it from too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from gspo_operator import names
from gspo_trainer import ports
from gspo_trainer.config import API_GROUP, API_VERSION, KIND, EnvVar, GSPOJobSpec

Obj = dict[str, Any]

LEARNER_GRACE_SECONDS = ports.LEARNER_GRACE_SECONDS  # time for the final checkpoint
ROLLOUT_GRACE_SECONDS = 30
POD_UID = 10001  # the images' non-root user
# The root filesystem is read-only; what DeepSpeed, vLLM, torch and Hugging Face write (compiled
# ops, caches, downloads) goes to emptyDirs at the home directory and /tmp instead.
HOME_DIR = "/home/gspo"  # the images' user's home (docker/*.Dockerfile)
TMP_DIR = "/tmp"
SOCKET_IFNAME = "eth0"  # the pod network; never loopback
# vLLM loads the model before /health answers; allow it up to 30 minutes.
ROLLOUT_STARTUP_PERIOD_S, ROLLOUT_STARTUP_FAILURES = 10, 180
PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}  # prometheus-operator's label
JOB_LABEL_META = "__meta_kubernetes_pod_label_" + "".join(
    c if c.isalnum() else "_" for c in names.JOB_LABEL
)


def render_job(
    job: Mapping[str, Any], spec: GSPOJobSpec, *, token: str, restart: int = 0
) -> list[Obj]:
    """Every child object of `job` (a GSPOJob mapping with metadata name/namespace/uid).

    `token` fills the weight-sync Secret; the operator only ever creates that Secret, never
    replaces it, so re-rendering with another token rotates nothing. `restart` is the learner
    group's generation: each learner pod carries it, so pods of an older group are told apart.
    """
    meta = job["metadata"]
    ctx = _Ctx(
        job=meta["name"],
        namespace=meta.get("namespace") or "default",
        owner=_owner(meta),
        spec=spec,
    )
    out: list[Obj] = [
        render_config_map(ctx, job),
        render_secret(ctx, token),
        render_learner_service(ctx),
        *(render_learner_pod(ctx, rank, restart) for rank in range(spec.learner.replicas)),
        render_rollout_service(ctx, headless=True),
        render_rollout_service(ctx, headless=False),
        render_rollout_deployment(ctx),
        render_network_policy(ctx),
    ]
    if spec.checkpoint.claim_name is None:
        out.insert(2, render_checkpoint_claim(ctx))
    if spec.metrics.enabled and spec.metrics.pod_monitor:
        out.append(render_pod_monitor(ctx))
    return out


class _Ctx:
    def __init__(self, job: str, namespace: str, owner: Obj | None, spec: GSPOJobSpec) -> None:
        self.job, self.namespace, self.owner, self.spec = job, namespace, owner, spec

    def meta(self, name: str, component: str, **extra: Any) -> Obj:
        out: Obj = {
            "name": name,
            "namespace": self.namespace,
            "labels": names.labels(self.job, component),
        }
        if self.owner is not None:
            out["ownerReferences"] = [self.owner]
        out.update(extra)
        return out


def _owner(meta: Mapping[str, Any]) -> Obj | None:
    if not meta.get("uid"):
        return None  # `gspo render` of a file: no object exists yet to own anything
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_manifest(job: Mapping[str, Any], spec: GSPOJobSpec) -> Obj:
    """The GSPOJob as the pods read it: identity plus the validated spec, defaults filled in."""
    meta = job["metadata"]
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace") or "default"},
        "spec": spec.to_manifest_dict(),
    }


def spec_hash(spec: GSPOJobSpec) -> str:
    blob = json.dumps(spec.to_manifest_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def render_config_map(ctx: _Ctx, job: Mapping[str, Any]) -> Obj:
    manifest = job_manifest(job, ctx.spec)
    annotations = {names.SPEC_HASH_ANNOTATION: spec_hash(ctx.spec)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(names.config_map(ctx.job), "config", annotations=annotations),
        "data": {ports.CONFIG_FILE: yaml.safe_dump(manifest, sort_keys=False)},
    }


def render_secret(ctx: _Ctx, token: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": ctx.meta(names.sync_token_secret(ctx.job), "sync-token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def render_checkpoint_claim(ctx: _Ctx) -> Obj:
    ckpt = ctx.spec.checkpoint
    spec: Obj = {
        # Every learner pod writes its own shards, from whichever node it runs on.
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": str(ckpt.size)}},
    }
    if ckpt.storage_class_name:
        spec["storageClassName"] = ckpt.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": ctx.meta(names.checkpoint_claim(ctx.job), "checkpoints"),
        "spec": spec,
    }


def render_learner_service(ctx: _Ctx) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(names.learner_service(ctx.job), names.LEARNER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rank 0 must resolve before anyone is ready
            "selector": names.selector(ctx.job, names.LEARNER),
            "ports": [
                _service_port("rendezvous", ports.RENDEZVOUS_PORT),
                _service_port("weight-sync", ports.WEIGHT_SYNC_PORT),
                _service_port("metrics", ctx.spec.metrics.port),
            ],
        },
    }


def render_learner_pod(ctx: _Ctx, rank: int, restart: int = 0) -> Obj:
    spec, job, ns = ctx.spec, ctx.job, ctx.namespace
    learner = spec.learner
    config_path = f"{ports.CONFIG_DIR}/{ports.CONFIG_FILE}"
    env = [
        *_writable_env(),
        *_user_env(learner.env),
        _env(ports.ENV_CONFIG_PATH, config_path),
        _env(ports.ENV_JOB_NAME, job),
        _env("MASTER_ADDR", names.master_addr(job, ns)),
        _env("MASTER_PORT", str(ports.RENDEZVOUS_PORT)),
        _env(ports.ENV_NNODES, str(learner.replicas)),
        _env(ports.ENV_NODE_RANK, str(rank)),
        _env(ports.ENV_NPROC_PER_NODE, str(max(1, learner.gpus_per_replica))),
        {"name": ports.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _env(ports.ENV_CHECKPOINT_DIR, ports.CHECKPOINT_DIR),
        _env(
            ports.ENV_ROLLOUT_URLS,
            f"{ports.ROLLOUT_DNS_SCHEME}://{names.rollout_dns(job, ns)}:{ports.ROLLOUT_HTTP_PORT}",
        ),
        _token_env(job),
        _env("NCCL_SOCKET_IFNAME", SOCKET_IFNAME),
        _env("GLOO_SOCKET_IFNAME", SOCKET_IFNAME),
    ]
    container = {
        "name": names.LEARNER,
        "image": learner.image,
        "command": [*ports.LEARNER_COMMAND, "--config", config_path],
        "env": env,
        "ports": [
            _container_port("rendezvous", ports.RENDEZVOUS_PORT),
            _container_port("weight-sync", ports.WEIGHT_SYNC_PORT),
            _container_port("metrics", spec.metrics.port),
        ],
        "readinessProbe": {
            "httpGet": {"path": "/progress", "port": "metrics"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": _resources(learner.resources.model_dump(), learner.gpus_per_replica),
        "volumeMounts": [
            {"name": "config", "mountPath": ports.CONFIG_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": ports.CHECKPOINT_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *_writable_mounts(),
        ],
        "securityContext": _container_security(),
    }
    labels = {}
    annotations = {names.RESTART_ANNOTATION: str(restart)}
    queue = spec.run_policy.scheduling.queue
    if queue:
        # Kueue's plain-pod groups: the learner group is admitted as a whole or not at all.
        labels = {names.QUEUE_LABEL: queue, names.POD_GROUP_LABEL: names.learner_service(job)}
        annotations[names.POD_GROUP_COUNT_ANNOTATION] = str(learner.replicas)
    meta = ctx.meta(names.learner_pod(job, rank), names.LEARNER, annotations=annotations)
    meta["labels"].update(labels)
    pod_spec = {
        "hostname": names.learner_pod(job, rank),
        "subdomain": names.learner_service(job),
        # The operator restarts the whole group from the latest checkpoint, never one rank.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": LEARNER_GRACE_SECONDS,
        "enableServiceLinks": False,
        # The learner finds rollout servers by DNS and never calls the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": names.config_map(job)}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": _claim(ctx)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(learner.shm_size)}},
            *_writable_volumes(),
        ],
        **_scheduling(spec),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def rollout_args(spec: GSPOJobSpec) -> list[str]:
    """Flags of `gspo rollout-server` for this job (see rollout/server.py's parse_args)."""
    model, rollout = spec.model, spec.rollout
    args = [
        f"--model={model.name}",
        f"--port={ports.ROLLOUT_HTTP_PORT}",
        f"--dtype={model.dtype}",
        f"--max-model-len={model.max_model_len}",
        f"--max-num-seqs={rollout.max_num_seqs}",
        f"--gpu-memory-utilization={rollout.gpu_memory_utilization}",
        f"--tensor-parallel-size={rollout.tensor_parallel_size}",
    ]
    if spec.weight_sync.method == "filesystem":
        args.append(f"--weights-dir={ports.CHECKPOINT_DIR}/{ports.WEIGHTS_SUBDIR}")
    extra: dict[str, Any] = {}
    if model.revision:
        extra["revision"] = model.revision
    if model.tokenizer:
        extra["tokenizer"] = model.tokenizer
    if model.trust_remote_code:
        extra["trust_remote_code"] = True
    extra.update(rollout.engine_args)
    for key, value in extra.items():
        text = value if isinstance(value, str) else json.dumps(value)
        args.append(f"--engine-arg={key}={text}")
    return args


def render_rollout_deployment(ctx: _Ctx, replicas: int | None = None) -> Obj:
    spec, job = ctx.spec, ctx.job
    rollout = spec.rollout
    container: Obj = {
        "name": names.ROLLOUT,
        "image": rollout.image,
        "command": list(ports.ROLLOUT_COMMAND),
        "args": rollout_args(spec),
        "env": [
            *_writable_env(),
            *_user_env(rollout.env),
            _env(ports.ENV_JOB_NAME, job),
            _token_env(job),
        ],
        "ports": [_container_port("http", ports.ROLLOUT_HTTP_PORT)],
        # /ready turns true only once the server holds weights synced from the learner.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": ROLLOUT_STARTUP_PERIOD_S,
            "failureThreshold": ROLLOUT_STARTUP_FAILURES,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
        "resources": _resources(rollout.resources.model_dump(), rollout.gpus_per_replica),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *_writable_mounts()],
        "securityContext": _container_security(),
    }
    volumes: list[Obj] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *_writable_volumes()]
    if spec.weight_sync.method == "filesystem":
        container["volumeMounts"].append(
            {"name": "checkpoints", "mountPath": ports.CHECKPOINT_DIR, "readOnly": True}
        )
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": _claim(ctx)}})
    pod_labels = names.labels(job, names.ROLLOUT)
    meta = ctx.meta(names.rollout_deployment(job), names.ROLLOUT)
    queue = spec.run_policy.scheduling.queue
    if queue:
        meta["labels"][names.QUEUE_LABEL] = queue
        pod_labels = {**pod_labels, names.QUEUE_LABEL: queue}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": rollout.replicas if replicas is None else replicas,
            "selector": {"matchLabels": names.selector(job, names.ROLLOUT)},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "terminationGracePeriodSeconds": ROLLOUT_GRACE_SECONDS,
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": volumes,
                    **_scheduling(spec),
                },
            },
        },
    }


def render_rollout_service(ctx: _Ctx, *, headless: bool) -> Obj:
    """Headless: the learner resolves every server, synced or not. API: a ClusterIP for people."""
    if headless:
        name = names.rollout_headless_service(ctx.job)
        extra: Obj = {"clusterIP": "None", "publishNotReadyAddresses": True}
    else:
        name, extra = names.rollout_api_service(ctx.job), {"type": "ClusterIP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(name, names.ROLLOUT),
        "spec": {
            **extra,
            "selector": names.selector(ctx.job, names.ROLLOUT),
            "ports": [_service_port("http", ports.ROLLOUT_HTTP_PORT)],
        },
    }


def render_network_policy(ctx: _Ctx) -> Obj:
    """Only the job's own pods reach its pods; the learner metrics port is open to all."""
    own = {"podSelector": {"matchLabels": names.selector(ctx.job)}}
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": PROMETHEUS_POD_LABELS}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.meta(names.network_policy(ctx.job), "network"),
        "spec": {
            "podSelector": {"matchLabels": names.selector(ctx.job)},
            "policyTypes": ["Ingress"],
            "ingress": [
                # Rendezvous, weight sync and NCCL/gloo's own ephemeral ports: the job only.
                {"from": [own]},
                # Learner /metrics and /progress (the operator reads it): any namespace.
                {
                    "from": [{"namespaceSelector": {}}],
                    "ports": [{"protocol": "TCP", "port": ctx.spec.metrics.port}],
                },
                # The rollout port also serves /metrics: Prometheus may scrape it.
                {
                    "from": [prometheus],
                    "ports": [{"protocol": "TCP", "port": ports.ROLLOUT_HTTP_PORT}],
                },
            ],
        },
    }


def render_pod_monitor(ctx: _Ctx) -> Obj:
    relabel = [{"sourceLabels": [JOB_LABEL_META], "targetLabel": "gspojob"}]
    interval = ctx.spec.metrics.interval
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": ctx.meta(names.pod_monitor(ctx.job), "metrics"),
        "spec": {
            "selector": {"matchLabels": names.selector(ctx.job)},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": interval,
                    "relabelings": relabel,
                },
                {"port": "http", "path": "/metrics", "interval": interval, "relabelings": relabel},
            ],
        },
    }


# --- small builders ---------------------------------------------------------------------


def _env(name: str, value: str) -> Obj:
    return {"name": name, "value": value}


def _user_env(env: list[EnvVar]) -> list[Obj]:
    # Listed first: Kubernetes takes the last duplicate, so the pod contract always wins.
    return [_env(e.name, e.value) for e in env]


def _token_env(job: str) -> Obj:
    ref = {"name": names.sync_token_secret(job), "key": "token"}
    return {"name": ports.ENV_SYNC_TOKEN, "valueFrom": {"secretKeyRef": ref}}


def _container_port(name: str, port: int) -> Obj:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _service_port(name: str, port: int) -> Obj:
    return {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}


def _claim(ctx: _Ctx) -> str:
    return ctx.spec.checkpoint.claim_name or names.checkpoint_claim(ctx.job)


def _resources(resources: Mapping[str, Mapping[str, Any]], gpus: int) -> Obj:
    out: Obj = {}
    for section in ("requests", "limits"):
        values = {k: str(v) for k, v in resources.get(section, {}).items()}
        if gpus > 0 and section == "limits":
            values["nvidia.com/gpu"] = str(gpus)
        if values:
            out[section] = values
    return out


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": POD_UID,
        "runAsGroup": POD_UID,
        "fsGroup": POD_UID,  # the checkpoint volume is writable by the non-root user
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "privileged": False,
    }


def _writable_env() -> list[Obj]:
    # Listed before the user's env, so a user may point a cache elsewhere (e.g. a volume).
    return [
        _env("HOME", HOME_DIR),
        _env("XDG_CACHE_HOME", f"{HOME_DIR}/.cache"),
        _env("TMPDIR", TMP_DIR),
    ]


def _writable_mounts() -> list[Obj]:
    return [{"name": "home", "mountPath": HOME_DIR}, {"name": "tmp", "mountPath": TMP_DIR}]


def _writable_volumes() -> list[Obj]:
    return [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]


def _scheduling(spec: GSPOJobSpec) -> Obj:
    sched = spec.run_policy.scheduling
    out: Obj = {}
    if sched.node_selector:
        out["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations
        ]
    if sched.affinity:
        out["affinity"] = sched.affinity
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if sched.scheduler_name:
        out["schedulerName"] = sched.scheduler_name
    return out
