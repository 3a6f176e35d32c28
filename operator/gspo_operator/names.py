"""Child object names and labels of a GSPOJob, defined once.

Names are deterministic functions of the job name, so a restarted operator finds what it
created before and creating again is a harmless "already exists".
"""

from __future__ import annotations

import re

from gspo_trainer.config import API_GROUP

# The longest child name is "<job>-checkpoints" / "<job>-rollout-api" / "<job>-learner-NNN";
# Service names and pod hostnames are DNS labels of at most 63 characters.
MAX_JOB_NAME = 50

MANAGED_BY = "gspo-operator"
APP_NAME = "gspo"
JOB_LABEL = f"{API_GROUP}/job-name"
ROLE_LABEL = f"{API_GROUP}/role"
RESTART_ANNOTATION = f"{API_GROUP}/restart"  # learner group generation a pod belongs to
SPEC_HASH_ANNOTATION = f"{API_GROUP}/spec-hash"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
POD_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"

LEARNER = "learner"
ROLLOUT = "rollout"


def config_map(job: str) -> str:
    return f"{job}-config"


def sync_token_secret(job: str) -> str:
    return f"{job}-sync-token"


def learner_service(job: str) -> str:
    return f"{job}-learner"


def learner_pod(job: str, rank: int) -> str:
    return f"{job}-learner-{rank}"


def rollout_deployment(job: str) -> str:
    return f"{job}-rollout"


def rollout_headless_service(job: str) -> str:
    return f"{job}-rollout"


def rollout_api_service(job: str) -> str:
    return f"{job}-rollout-api"


def checkpoint_claim(job: str) -> str:
    return f"{job}-checkpoints"


def network_policy(job: str) -> str:
    return f"{job}-pods"


def pod_monitor(job: str) -> str:
    return job


def master_addr(job: str, namespace: str) -> str:
    """Stable DNS name of learner rank 0 (hostname + subdomain of the headless Service)."""
    return f"{learner_pod(job, 0)}.{learner_service(job)}.{namespace}.svc"


def rollout_dns(job: str, namespace: str) -> str:
    return f"{rollout_headless_service(job)}.{namespace}.svc"


def selector(job: str, role: str | None = None) -> dict[str, str]:
    """Labels that select a job's pods (of one role when given)."""
    out = {JOB_LABEL: job}
    if role is not None:
        out[ROLE_LABEL] = role
    return out


def label_selector(job: str, role: str | None = None) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(job, role).items())


def labels(job: str, component: str) -> dict[str, str]:
    """Every child's labels: the recommended app.kubernetes.io set plus the job and role."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job,
        ROLE_LABEL: component,
    }


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_job_name(job: str) -> str | None:
    """Why `job` cannot name a GSPOJob's children, or None when it can."""
    if not DNS_LABEL.match(job):
        return (
            f"name {job!r} must be lower-case letters, digits and '-', start with a letter and "
            "end with a letter or digit (it names Services, which are DNS labels)"
        )
    if len(job) > MAX_JOB_NAME:
        return (
            f"name {job!r} has {len(job)} characters; GSPOJob names are limited to "
            f"{MAX_JOB_NAME} so that child Service and pod host names fit in 63"
        )
    return None
