"""GSPOJob -> the Kubernetes objects it becomes. Pure: no API server, no kopf, no clock.

`render_job` is what the operator creates and what `gspo render` prints. The pods run under
one JobSet (jobset.x-k8s.io/v1alpha2), the way Kubeflow Trainer v2 runs TrainJobs: the
learner is one Indexed Job of `learner.replicas` pods, each rollout server a Job of its own,
and JobSet's failurePolicy and successPolicy carry the job's restart and completion rules on
a stock JobSet install (default feature gates). The pod contract (ports, environment, mounts,
commands) comes from gspo_api.ports, the one place the learner and the rollout server
read it from too.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from gspo_api import ports
from gspo_api.spec import API_GROUP, API_VERSION, KIND, GSPOJobSpec, PodSettings
from gspo_operator import names
from gspo_operator.gpu_requests import render_resources
from gspo_operator.manifest import ClusterPolicy

Obj = dict[str, Any]

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
LEARNER_GRACE_SECONDS = ports.LEARNER_GRACE_SECONDS  # time for the final checkpoint
ROLLOUT_GRACE_SECONDS = 30
SANDBOX_GRACE_SECONDS = 10  # a sandbox pod keeps nothing: its programs die with it
# Replacements of each sandbox pod (its Job's backoffLimit) before the job fails, as a rollout
# server's default: a pod lost to its node is replaced, one that cannot start fails the job.
SANDBOX_BACKOFF_LIMIT = 20
SANDBOX_TOKEN_VOLUME = "sandbox-token"
NO_MESH = {"sidecar.istio.io/inject": "false", "linkerd.io/inject": "disabled"}
SANDBOX_SERVER_MIB = 256  # the sandbox server's own memory, beside its programs
TOKEN_SHA256_KEY = "token-sha256"  # the Secret's key a sandbox pod checks requests against
# What of reward.sandbox a sandbox pod applies to each program (code/sandbox.py reads these).
SANDBOX_LIMITS = {
    "isolation",
    "concurrency",
    "timeout_seconds",
    "memory_mib",
    "processes",
    "output_bytes",
    "file_bytes",
}
POD_UID = 10001  # the images' non-root user
# The root filesystem is read-only; what DeepSpeed, vLLM, torch and Hugging Face write (compiled
# ops, caches, downloads) goes to emptyDirs at the home directory and /tmp instead.
HOME_DIR = "/home/gspo"  # the images' user's home (docker/*.Dockerfile)
TMP_DIR = "/tmp"
SOCKET_IFNAME = "eth0"  # the pod network; never loopback
# vLLM loads the model before /health answers; allow it up to 30 minutes.
ROLLOUT_STARTUP_PERIOD_S = 10
ROLLOUT_STARTUP_FAILURES = ports.ROLLOUT_STARTUP_SECONDS // ROLLOUT_STARTUP_PERIOD_S
MODEL_CACHE_VOLUME = "model-cache"
# The Job controller's failure messages for a podFailurePolicy FailJob rule (kubernetes
# pkg/controller/job/pod_failure_policy.go); JobSet's failurePolicy rules match them.
DISRUPTED = {"type": "DisruptionTarget", "status": "True"}  # preemption, eviction, drain
EXIT_2_MESSAGE = "failed with exit code 2 matching FailJob rule"
DISRUPTION_MESSAGE = "has condition DisruptionTarget matching FailJob rule"
# A learner stopped by SIGTERM (drain, eviction, node shutdown) exits 143 after a final
# checkpoint; it is a disruption too, whichever of its pods the Job controller sees first.
STOPPED_MESSAGE = f"failed with exit code {ports.LEARNER_STOPPED_EXIT_CODE} matching FailJob rule"
JOB_LABEL_META = "__meta_kubernetes_pod_label_" + "".join(
    c if c.isalnum() else "_" for c in names.JOB_LABEL
)


def render_job(
    job: Mapping[str, Any],
    spec: GSPOJobSpec,
    *,
    token: str,
    policy: ClusterPolicy | None = None,
) -> list[Obj]:
    """Every child object of `job` (a GSPOJob mapping with metadata name/namespace/uid).

    `token` fills the weight-sync Secret; the operator only ever creates that Secret, never
    replaces it, so re-rendering with another token rotates nothing. `policy` is the cluster
    admin's (who may reach the metrics ports, which pods are the operator's); without it, the
    chart's defaults: Prometheus pods, and pods labelled as the chart's operator, anywhere.
    """
    meta = job["metadata"]
    ctx = _Ctx(
        job=meta["name"],
        namespace=meta.get("namespace") or "default",
        owner=_owner(meta),
        spec=spec,
        policy=policy or ClusterPolicy(),
    )
    # With rollout.replicas 0 no rollout pod exists, so no Service for them either.
    services = [render_rollout_service(ctx, headless=headless) for headless in (True, False)]
    sandbox = [render_sandbox_service(ctx), render_sandbox_network_policy(ctx)]
    out: list[Obj] = [
        render_config_map(ctx, job),
        render_secret(ctx, token),
        render_pod_dns_service(ctx),
        *(services if spec.rollout.replicas > 0 else []),
        render_network_policy(ctx),
        *(sandbox if runs_sandbox_pods(spec) else []),
        render_jobset(ctx),
    ]
    if spec.checkpoint.claim_name is None:
        out.insert(2, render_checkpoint_claim(ctx))
    if spec.metrics.enabled and spec.metrics.pod_monitor:
        out.append(render_pod_monitor(ctx))
    return out


class _Ctx:
    def __init__(
        self,
        job: str,
        namespace: str,
        owner: Obj | None,
        spec: GSPOJobSpec,
        policy: ClusterPolicy | None = None,
    ) -> None:
        self.job, self.namespace, self.owner, self.spec = job, namespace, owner, spec
        self.policy = policy or ClusterPolicy()

    def meta(self, name: str, component: str, owned: bool = True, **extra: Any) -> Obj:
        out: Obj = {
            "name": name,
            "namespace": self.namespace,
            "labels": names.labels(self.job, component),
        }
        if self.owner is not None and owned:
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
    """The validated spec the pods read. Env values from Secrets stay references: a Secret's
    value never lands here."""
    manifest = job_manifest(job, ctx.spec)
    annotations = {names.SPEC_HASH_ANNOTATION: spec_hash(ctx.spec)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(names.config_map(ctx.job), "config", annotations=annotations),
        "data": {ports.CONFIG_FILE: yaml.safe_dump(manifest, sort_keys=False)},
    }


def render_secret(ctx: _Ctx, token: str) -> Obj:
    """The job's token; with sandbox pods also its SHA-256, all they get of it (a program
    that reads it there cannot use it on the job's other pods)."""
    data = {"token": token}
    if runs_sandbox_pods(ctx.spec):
        data[TOKEN_SHA256_KEY] = hashlib.sha256(token.encode()).hexdigest()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": ctx.meta(names.token_secret(ctx.job), "job-token"),
        "type": "Opaque",
        "stringData": data,
    }


def with_token(secret: Obj, token: str) -> Obj:
    """`secret` (render_secret's) holding `token` instead, its SHA-256 key too if it has one."""
    data = {**secret["stringData"], "token": token}
    if TOKEN_SHA256_KEY in data:
        data[TOKEN_SHA256_KEY] = hashlib.sha256(token.encode()).hexdigest()
    return {**secret, "stringData": data}


def runs_sandbox_pods(spec: GSPOJobSpec) -> bool:
    """Whether the job has sandbox pods of its own: a code reward, scored in mode service,
    with no serviceUrl naming the user's own sandbox service."""
    sandbox = spec.reward.sandbox
    return spec.reward.scores_code() and sandbox.mode == "service" and sandbox.service_url is None


def checkpoint_access_modes(spec: GSPOJobSpec) -> list[str]:
    """ReadWriteOnce when a single pod mounts the claim, which most default storage classes
    offer; ReadWriteMany when several learner pods (or the rollout servers) share it."""
    ckpt = spec.checkpoint
    if ckpt.access_modes:
        return list(ckpt.access_modes)
    shared = spec.learner.replicas > 1 or spec.weight_sync.method == "filesystem"
    return ["ReadWriteMany" if shared else "ReadWriteOnce"]


def render_checkpoint_claim(ctx: _Ctx) -> Obj:
    ckpt = ctx.spec.checkpoint
    spec: Obj = {
        "accessModes": checkpoint_access_modes(ctx.spec),
        "resources": {"requests": {"storage": str(ckpt.size)}},
    }
    if ckpt.storage_class_name:
        spec["storageClassName"] = ckpt.storage_class_name
    # A retained claim (the default) has no owner: deleting the job, by hand or through
    # ttlSecondsAfterFinished, leaves the checkpoints and the export. The job's uid marks it
    # as this job's child instead of an ownerReference.
    meta = ctx.meta(names.checkpoint_claim(ctx.job), "checkpoints", owned=not ckpt.retain_claim)
    if ckpt.retain_claim and ctx.owner is not None:
        meta["annotations"] = {names.JOB_UID_ANNOTATION: ctx.owner["uid"]}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def failure_rules(spec: GSPOJobSpec) -> list[Obj]:
    """JobSet failurePolicy rules, first match wins (see docs/operator.md).

    The learner Job has backoffLimit 0 and a podFailurePolicy that fails it on exit code 2,
    on disruption and on exit code 143 (stopped after its final checkpoint); JobSet tells the
    cases apart by the Job's failure reason and message.
    """
    learner, rollout = [names.LEARNER], [names.ROLLOUT]
    restart = "RestartJob" if spec.run_policy.restart_scope == "learner" else "RestartJobSet"
    rules = [
        {
            "name": "LearnerInvalidConfig",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
            "onJobFailureMessagePatterns": [EXIT_2_MESSAGE],
            "targetReplicatedJobs": learner,
        },
        {
            "name": "LearnerDisrupted",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
            "onJobFailureMessagePatterns": [DISRUPTION_MESSAGE, STOPPED_MESSAGE],
            "targetReplicatedJobs": learner,
        },
        {"name": "LearnerFailed", "action": restart, "targetReplicatedJobs": learner},
    ]
    if spec.rollout.replicas > 0:
        rules.append(
            {
                "name": "RolloutOutOfRetries",
                "action": "FailJobSet",
                "targetReplicatedJobs": rollout,
            }
        )
    if runs_sandbox_pods(spec):
        # A sandbox pod that failed SANDBOX_BACKOFF_LIMIT times (it cannot start: e.g. its
        # isolation is refused on these nodes) would make every test case a sandbox failure.
        rules.append(
            {
                "name": "SandboxOutOfRetries",
                "action": "FailJobSet",
                "targetReplicatedJobs": [names.SANDBOX],
            }
        )
    return rules


def render_jobset(ctx: _Ctx) -> Obj:
    spec, job = ctx.spec, ctx.job
    learner_job = _job_template(
        ctx,
        names.LEARNER,
        render_learner_pod_template(ctx),
        pods=spec.learner.replicas,
        backoff_limit=0,  # a failed learner pod fails the Job; JobSet restarts the group
        pod_failure_rules=[
            {
                "action": "FailJob",
                "onExitCodes": _exit_codes(2),
            },
            {"action": "FailJob", "onPodConditions": [DISRUPTED]},
            {"action": "FailJob", "onExitCodes": _exit_codes(ports.LEARNER_STOPPED_EXIT_CODE)},
        ],
    )
    replicated = [{"name": names.LEARNER, "replicas": 1, "template": learner_job}]
    if spec.rollout.replicas > 0:
        rollout_job = _job_template(
            ctx,
            names.ROLLOUT,
            render_rollout_pod_template(ctx),
            pods=1,
            backoff_limit=spec.rollout.backoff_limit,  # replaces a failed server alone
            pod_failure_rules=[{"action": "Ignore", "onPodConditions": [DISRUPTED]}],
        )
        replicated.append(
            {"name": names.ROLLOUT, "replicas": spec.rollout.replicas, "template": rollout_job}
        )
    if runs_sandbox_pods(spec):
        sandbox_job = _job_template(
            ctx,
            names.SANDBOX,
            render_sandbox_pod_template(ctx),
            pods=1,
            backoff_limit=SANDBOX_BACKOFF_LIMIT,  # replaces a failed sandbox pod alone
            pod_failure_rules=[
                # A pod whose isolation the node refuses exits 2: every pod would, so the
                # Job fails at once (and SandboxOutOfRetries the job), not after 20 tries.
                {
                    "action": "FailJob",
                    "onExitCodes": _exit_codes(ports.INVALID_CONFIG_EXIT_CODE, names.SANDBOX),
                },
                {"action": "Ignore", "onPodConditions": [DISRUPTED]},
            ],
        )
        pods = spec.reward.sandbox.replicas or 1
        replicated.append({"name": names.SANDBOX, "replicas": pods, "template": sandbox_job})
    meta = ctx.meta(names.jobset(job), "jobset")
    queue = spec.run_policy.scheduling.queue
    if queue:
        meta["labels"][names.QUEUE_LABEL] = queue  # Kueue admits the JobSet as one workload
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "suspend": spec.run_policy.suspend,
            "network": {
                "enableDNSHostnames": True,
                "subdomain": names.subdomain(job),
                "publishNotReadyAddresses": True,  # rank 0 must resolve before it is ready
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [names.LEARNER]},
            "failurePolicy": {
                "maxRestarts": spec.run_policy.backoff_limit,
                "rules": failure_rules(spec),
            },
            "replicatedJobs": replicated,
        },
    }


def _exit_codes(code: int, container: str = names.LEARNER) -> Obj:
    return {"containerName": container, "operator": "In", "values": [code]}


def _job_template(
    ctx: _Ctx,
    role: str,
    pod_template: Obj,
    *,
    pods: int,
    backoff_limit: int,
    pod_failure_rules: list[Obj],
) -> Obj:
    return {
        "metadata": {"labels": names.labels(ctx.job, role)},
        "spec": {
            "completionMode": "Indexed",
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": backoff_limit,
            "podFailurePolicy": {"rules": pod_failure_rules},
            "template": pod_template,
        },
    }


def _pod_template(ctx: _Ctx, role: str, pods: PodSettings, pod_spec: Obj) -> Obj:
    labels = {**pods.labels, **names.labels(ctx.job, role)}  # ours win: selectors use them
    meta: Obj = {"labels": labels}
    if pods.annotations:
        meta["annotations"] = dict(pods.annotations)
    if pods.service_account_name:
        pod_spec["serviceAccountName"] = pods.service_account_name
    else:
        # The pods find each other by DNS and never call the Kubernetes API.
        pod_spec["automountServiceAccountToken"] = False
    if pods.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pods.image_pull_secrets]
    pod_spec.update(_scheduling(ctx.spec))
    return {"metadata": meta, "spec": pod_spec}


def render_learner_pod_template(ctx: _Ctx) -> Obj:
    spec, job, ns = ctx.spec, ctx.job, ctx.namespace
    learner = spec.learner
    config_path = f"{ports.CONFIG_DIR}/{ports.CONFIG_FILE}"
    rank_ref = f"metadata.annotations['{names.COMPLETION_INDEX_ANNOTATION}']"
    env = [
        *_writable_env(),
        # Overridable by the user's env (listed after): which interface NCCL and gloo use.
        _env("NCCL_SOCKET_IFNAME", SOCKET_IFNAME),
        _env("GLOO_SOCKET_IFNAME", SOCKET_IFNAME),
        *_model_env(spec),
        *_user_env(learner),
        _env(ports.ENV_CONFIG_PATH, config_path),
        _env(ports.ENV_JOB_NAME, job),
        _env("MASTER_ADDR", names.master_addr(job, ns)),
        _env("MASTER_PORT", str(ports.RENDEZVOUS_PORT)),
        _env(ports.ENV_NNODES, str(learner.replicas)),
        # The Indexed Job's completion index is the pod's node rank.
        {"name": ports.ENV_NODE_RANK, "valueFrom": {"fieldRef": {"fieldPath": rank_ref}}},
        _env(ports.ENV_NPROC_PER_NODE, str(max(1, learner.gpus_per_replica))),
        {"name": ports.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _env(ports.ENV_CHECKPOINT_DIR, ports.CHECKPOINT_DIR),
        _env(
            ports.ENV_ROLLOUT_URLS,
            f"{ports.ROLLOUT_DNS_SCHEME}://{names.rollout_dns(job, ns)}:{ports.ROLLOUT_HTTP_PORT}",
        ),
        *_token_env(job),
    ]
    if runs_sandbox_pods(spec):
        url = f"http://{names.sandbox_dns(job, ns)}:{ports.SANDBOX_HTTP_PORT}"
        env.append(_env(ports.ENV_SANDBOX_URL, url))
    container: Obj = {
        "name": names.LEARNER,
        "image": learner.image,
        "command": [*ports.LEARNER_COMMAND, "--config", config_path],
        "env": env,
        "ports": [
            _container_port("rendezvous", ports.RENDEZVOUS_PORT),
            _container_port("weight-sync", ports.WEIGHT_SYNC_PORT),
            _container_port("metrics", spec.metrics.port),
        ],
        # Every learner pod serves /healthz (rank 0 also /metrics and /progress).
        "readinessProbe": {
            "httpGet": {"path": ports.HEALTH_PATH, "port": "metrics"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": render_resources(learner.resources.model_dump(), learner.gpus_per_replica),
        "volumeMounts": [
            {"name": "config", "mountPath": ports.CONFIG_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": ports.CHECKPOINT_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *_writable_mounts(),
            *_model_mounts(spec),
            *_user_mounts(learner),
        ],
        # The learner's last lines (e.g. which field of the spec is wrong) become the pod's
        # termination message, which the operator copies into the job's conditions.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if learner.env_from:
        container["envFrom"] = [dict(e) for e in learner.env_from]
    pod_spec: Obj = {
        "restartPolicy": "Never",  # a failed rank fails the Job; JobSet restarts the group
        "terminationGracePeriodSeconds": LEARNER_GRACE_SECONDS,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": names.config_map(job)}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": _claim(ctx)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(learner.shm_size)}},
            *_writable_volumes(),
            *_model_volumes(spec),
            *_user_volumes(learner),
        ],
    }
    return _pod_template(ctx, names.LEARNER, learner, pod_spec)


def rollout_args(spec: GSPOJobSpec) -> list[str]:
    """Flags of `gspo rollout-server` for this job (rollout/launch.py's parse_args; it starts
    vLLM's server with them). Every route but the probes and /metrics needs the job's token,
    which the pod has from the job's Secret ($GSPO_JOB_TOKEN)."""
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


def render_rollout_pod_template(ctx: _Ctx) -> Obj:
    spec, job = ctx.spec, ctx.job
    rollout = spec.rollout
    container: Obj = {
        "name": names.ROLLOUT,
        "image": rollout.image,
        "command": list(ports.ROLLOUT_COMMAND),
        "args": rollout_args(spec),
        "env": [
            *_writable_env(),
            *_model_env(spec),
            *_user_env(rollout),
            _env(ports.ENV_JOB_NAME, job),
            *_token_env(job),
        ],
        "ports": [_container_port("http", ports.ROLLOUT_HTTP_PORT)],
        # Ready = the engine is loaded and serves (/health). Not "holds synced weights"
        # (/ready): the first sync waits for the learner to load, and Kueue's
        # WaitForPodsReady evicts a job whose pods are not all ready within its timeout
        # (5 minutes by default). Synced is the job's WeightsSynced condition.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
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
        "resources": render_resources(rollout.resources.model_dump(), rollout.gpus_per_replica),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            *_writable_mounts(),
            *_model_mounts(spec),
            *_user_mounts(rollout),
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if rollout.env_from:
        container["envFrom"] = [dict(e) for e in rollout.env_from]
    volumes: list[Obj] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *_writable_volumes(),
        *_model_volumes(spec),
        *_user_volumes(rollout),
    ]
    if spec.weight_sync.method == "filesystem":
        container["volumeMounts"].append(
            {"name": "checkpoints", "mountPath": ports.CHECKPOINT_DIR, "readOnly": True}
        )
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": _claim(ctx)}})
    pod_spec: Obj = {
        # podFailurePolicy needs Never: a crashed server becomes a new pod of the same Job.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": ROLLOUT_GRACE_SECONDS,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": volumes,
    }
    return _pod_template(ctx, names.ROLLOUT, rollout, pod_spec)


def sandbox_args(spec: GSPOJobSpec) -> list[str]:
    """Flags of `gspo sandbox-server` (code/service.py): the isolation and limits of
    reward.sandbox, which it applies to every program as the learner would in mode local."""
    limits = spec.reward.sandbox.model_dump(mode="json", by_alias=True, include=SANDBOX_LIMITS)
    return [
        "--host=0.0.0.0",
        f"--port={ports.SANDBOX_HTTP_PORT}",
        f"--token-sha256-file={ports.SANDBOX_TOKEN_DIR}/{TOKEN_SHA256_KEY}",
        f"--sandbox={json.dumps(limits, sort_keys=True)}",
    ]


def sandbox_default_resources(concurrency: int, memory_mib: int) -> Obj:
    """A sandbox pod's requests and limits when reward.sandbox.resources is unset: a CPU and
    memoryMib per program it runs at once, and the server's own. Not BestEffort, so Kueue
    counts it against the queue's quota and the kubelet does not evict it first."""
    memory = f"{concurrency * memory_mib + SANDBOX_SERVER_MIB}Mi"
    return {
        "requests": {"cpu": str(concurrency), "memory": memory},
        "limits": {"memory": memory},
    }


def render_sandbox_pod_template(ctx: _Ctx) -> Obj:
    """A sandbox pod: the code reward's programs run here, away from the job. It holds the
    job token's SHA-256 (to check the learner's requests) and nothing else of the job: no
    checkpoint, model or cache volume, no service-account token, no user env or volumes. The
    image is the learner's (the same runner code as mode local); the RuntimeClass, resources
    and replicas are reward.sandbox's; its NetworkPolicy admits only the learner and lets
    nothing out (render_sandbox_network_policy)."""
    spec, job = ctx.spec, ctx.job
    sandbox = spec.reward.sandbox
    resources = (
        sandbox.resources.model_dump()
        if sandbox.resources is not None
        else sandbox_default_resources(sandbox.concurrency, sandbox.memory_mib)
    )
    container: Obj = {
        "name": names.SANDBOX,
        "image": spec.learner.image,
        "command": list(ports.SANDBOX_COMMAND),
        "args": sandbox_args(spec),
        "env": [*_writable_env(), _env(ports.ENV_JOB_NAME, job)],
        "ports": [_container_port("sandbox", ports.SANDBOX_HTTP_PORT)],
        # Ready once it has run a program under its isolation (it probes before serving).
        "readinessProbe": {
            "httpGet": {"path": ports.HEALTH_PATH, "port": "sandbox"},
            "periodSeconds": 5,
        },
        "resources": render_resources(resources, 0),
        "volumeMounts": [
            {"name": SANDBOX_TOKEN_VOLUME, "mountPath": ports.SANDBOX_TOKEN_DIR, "readOnly": True},
            *_writable_mounts(),
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    token = {
        "secretName": names.token_secret(job),
        "items": [{"key": TOKEN_SHA256_KEY, "path": TOKEN_SHA256_KEY}],
        "defaultMode": 0o440,  # the pod's user reads it through fsGroup; no one else
    }
    pod_spec: Obj = {
        "restartPolicy": "Never",  # a failed pod becomes a new pod of the same Job
        "terminationGracePeriodSeconds": SANDBOX_GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [{"name": SANDBOX_TOKEN_VOLUME, "secret": token}, *_writable_volumes()],
    }
    if sandbox.runtime_class_name:
        pod_spec["runtimeClassName"] = sandbox.runtime_class_name
    if spec.learner.image_pull_secrets:  # the learner's image
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.learner.image_pull_secrets]
    # The job's priority and scheduler; not its nodeSelector, affinity or tolerations, which
    # place the learner and the servers on accelerator nodes (tolerations usually of GPU
    # taints): model-written code stays off them. A RuntimeClass's own scheduling places
    # the sandbox pods on the nodes that run it, its tolerations included.
    sched = _scheduling(spec)
    pod_spec.update({k: v for k, v in sched.items() if k in ("priorityClassName", "schedulerName")})
    # No service-mesh proxy: under the sandbox's egress deny-all an injected one never
    # reaches its control plane, and the pod would never be Ready.
    meta: Obj = {"labels": names.labels(job, names.SANDBOX), "annotations": dict(NO_MESH)}
    return {"metadata": meta, "spec": pod_spec}


def render_sandbox_service(ctx: _Ctx) -> Obj:
    """The sandbox pods' ClusterIP Service: the learner's $GSPO_SANDBOX_URL."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(names.sandbox_service(ctx.job), names.SANDBOX),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector(ctx.job, names.SANDBOX),
            "ports": [_service_port("sandbox", ports.SANDBOX_HTTP_PORT)],
        },
    }


def render_sandbox_network_policy(ctx: _Ctx) -> Obj:
    """The sandbox pods admit the job's learner pods on the sandbox port, and nothing else;
    they reach nothing at all (Egress isolated with no egress rule: not even DNS). The
    job's own policy (render_network_policy) leaves them out, so its rules do not add to
    these. Traffic from the pod's own node (the kubelet's probes) passes, as NetworkPolicy
    defines it."""
    learners = {"podSelector": {"matchLabels": names.selector(ctx.job, names.LEARNER)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.meta(names.sandbox_network_policy(ctx.job), names.SANDBOX),
        "spec": {
            "podSelector": {"matchLabels": names.selector(ctx.job, names.SANDBOX)},
            # No `egress` key: an empty list is dropped by the API server on the way back
            # (omitempty), and with Egress in policyTypes no rule means nothing goes out.
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [learners],
                    "ports": [{"protocol": "TCP", "port": ports.SANDBOX_HTTP_PORT}],
                }
            ],
        },
    }


def render_pod_dns_service(ctx: _Ctx) -> Obj:
    """The headless Service that gives the job's pods their DNS names (`<host>.<subdomain>`;
    the learner's rendezvous address is rank 0's), as JobSet would create it.

    JobSet creates a Service named like its subdomain only when none exists and otherwise uses
    whatever holds that name, whoever owns it (createHeadlessSvcIfNecessary in
    pkg/controllers/jobset_controller.go): job `exp-rollout`'s JobSet would take job `exp`'s
    rollout Service. The operator creates it instead, owned by the job, before the JobSet, so
    a name another object holds is refused as every child's is (Blocked, Conflict)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(names.subdomain(ctx.job), "pod-dns"),
        "spec": {
            "clusterIP": "None",
            "selector": names.selector(ctx.job),
            "publishNotReadyAddresses": True,  # rank 0 must resolve before it is ready
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
    """Only the job's own pods reach its pods, except the two ports serving /metrics: those
    admit the admin's metrics scrapers (policy.metrics_from), and the learner's also the
    operator, which reads /progress there.

    A rule's empty `from` admits everyone, so with no scrapers configured the rollout port's
    rule is left out rather than rendered empty; the learner's always names the operator.
    """
    own = {"podSelector": _job_pods(ctx)}
    scrapers = [copy.deepcopy(peer) for peer in ctx.policy.metrics_from]
    ingress: list[Obj] = [
        # Rendezvous, weight sync and NCCL/gloo's own ephemeral ports: the job only.
        {"from": [own]},
        # Learner /metrics, and /progress, which the operator reads.
        {
            "from": [*scrapers, ctx.policy.operator_peer()],
            "ports": [{"protocol": "TCP", "port": ctx.spec.metrics.port}],
        },
    ]
    if scrapers:
        # The rollout port also serves /metrics (generation and control need the job's token).
        ingress.append(
            {
                "from": copy.deepcopy(scrapers),
                "ports": [{"protocol": "TCP", "port": ports.ROLLOUT_HTTP_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": ctx.meta(names.network_policy(ctx.job), "network"),
        "spec": {
            "podSelector": _job_pods(ctx),
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _job_pods(ctx: _Ctx) -> Obj:
    """The job's pods but its sandbox pods: policies add up, so a rule of the job's own
    policy that selected the sandbox pods would let the rollout servers reach them (and
    theirs would let them out); sandbox pods are never a peer of the job's pods either."""
    selector: Obj = {"matchLabels": names.selector(ctx.job)}
    if runs_sandbox_pods(ctx.spec):
        selector["matchExpressions"] = [
            {"key": names.ROLE_LABEL, "operator": "NotIn", "values": [names.SANDBOX]}
        ]
    return selector


def render_pod_monitor(ctx: _Ctx) -> Obj:
    """The learner's and servers' /metrics for the Prometheus Operator. It carries the admin's
    monitor labels (policy.pod_monitor_labels): a Prometheus selects monitors by label, and
    kube-prometheus-stack's ignores any without `release: <its Helm release>`."""
    relabel = [{"sourceLabels": [JOB_LABEL_META], "targetLabel": "gspojob"}]
    interval = ctx.spec.metrics.interval
    meta = ctx.meta(names.pod_monitor(ctx.job), "metrics")
    meta["labels"] = {**ctx.policy.pod_monitor_labels, **meta["labels"]}  # ours win
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
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


def _user_env(pods: PodSettings) -> list[Obj]:
    # Listed before the pod contract: Kubernetes takes the last duplicate, so it always wins.
    return [e.model_dump(by_alias=True, exclude_none=True) for e in pods.env]


def _user_mounts(pods: PodSettings) -> list[Obj]:
    return [m.model_dump(by_alias=True, exclude_defaults=True) for m in pods.volume_mounts]


def _user_volumes(pods: PodSettings) -> list[Obj]:
    return [v.model_dump(by_alias=True, exclude_none=True) for v in pods.volumes]


def _model_env(spec: GSPOJobSpec) -> list[Obj]:
    """Hugging Face Hub access: online unless asked (built-in models never download)."""
    model = spec.model
    out = []
    if spec.hub_offline:
        out.append(_env("HF_HUB_OFFLINE", "1"))
    if model.cache is not None:
        out.append(_env("HF_HOME", model.cache.mount_path))
    if model.hf_token_secret is not None:
        ref = {"name": model.hf_token_secret.name, "key": model.hf_token_secret.key}
        out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return out


def _model_mounts(spec: GSPOJobSpec) -> list[Obj]:
    cache = spec.model.cache
    if cache is None:
        return []
    mount: Obj = {"name": MODEL_CACHE_VOLUME, "mountPath": cache.mount_path}
    if cache.read_only:
        mount["readOnly"] = True
    return [mount]


def _model_volumes(spec: GSPOJobSpec) -> list[Obj]:
    cache = spec.model.cache
    if cache is None:
        return []
    claim: Obj = {"claimName": cache.claim_name}
    if cache.read_only:
        claim["readOnly"] = True
    return [{"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": claim}]


def _token_env(job: str) -> list[Obj]:
    """The job's token under its name and, for images of an earlier release (which read
    only that one), under its earlier name."""
    ref = {"name": names.token_secret(job), "key": "token"}
    return [
        {"name": name, "valueFrom": {"secretKeyRef": ref}}
        for name in (ports.ENV_JOB_TOKEN, ports.ENV_JOB_TOKEN_EARLIER)
    ]


def _container_port(name: str, port: int) -> Obj:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _service_port(name: str, port: int) -> Obj:
    return {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}


def checkpoint_claim_name(job: str, spec: GSPOJobSpec) -> str:
    """The claim the learner writes checkpoints to: the user's, or the one the operator makes."""
    return spec.checkpoint.claim_name or names.checkpoint_claim(job)


def _claim(ctx: _Ctx) -> str:
    return checkpoint_claim_name(ctx.job, ctx.spec)


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": POD_UID,
        "runAsGroup": POD_UID,
        "fsGroup": POD_UID,  # the checkpoint volume is writable by the non-root user
        # Change ownership only when the volume's root is not the fsGroup's yet: otherwise the
        # kubelet walks every file of the checkpoint and model volumes at each pod start.
        "fsGroupChangePolicy": "OnRootMismatch",
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
