"""Child object names and labels of a GSPOJob, defined once.

Names are deterministic functions of the job name, so a restarted operator finds what it
created before and creating again is a harmless "already exists". The pods themselves are
created by JobSet and the Job controller; their names and host names follow JobSet's rules
(`<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`, jobset.x-k8s.io/v1alpha2), which this
module states once so the learner's rendezvous address and the name checks agree with them.
"""

from __future__ import annotations

import re

from gspo_api.spec import API_GROUP

# JobSet's webhook refuses a JobSet whose generated pod names `<jobset>-<replicatedJob>-
# <jobIndex>-<podIndex>` exceed 63 characters less the 6 of the pods' random suffix ("-xxxxx").
MAX_GENERATED_POD_NAME = 57
DNS_LABEL_MAX = 63

MANAGED_BY = "gspo-operator"
APP_NAME = "gspo"
JOB_LABEL = f"{API_GROUP}/job-name"
ROLE_LABEL = f"{API_GROUP}/role"
SPEC_HASH_ANNOTATION = f"{API_GROUP}/spec-hash"
# On a child kept without an owner (a retained checkpoint claim): the uid of the job that made
# it, so that job knows it as its own and a later job of the same name does not.
JOB_UID_ANNOTATION = f"{API_GROUP}/job-uid"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue labels the Workload it makes for a job with that job's uid (here: the JobSet's).
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
KUEUE_API = "kueue.x-k8s.io/v1beta1"
# What JobSet and the Job controller put on the pods they create.
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

LEARNER = "learner"
ROLLOUT = "rollout"
SANDBOX = "sandbox"  # the code reward's sandbox pods (reward.sandbox.mode service)


def config_map(job: str) -> str:
    return f"{job}-config"


def token_secret(job: str) -> str:
    return f"{job}-job-token"


def token_secret_earlier(job: str) -> str:
    """What releases before named the job's Secret (reconcile copies its token over)."""
    return f"{job}-sync-token"


def jobset(job: str) -> str:
    return job


def subdomain(job: str) -> str:
    """The headless Service of the job's pods, JobSet's network.subdomain. The operator
    creates it (render.render_pod_dns_service), so a name taken by another object is refused
    rather than silently shared."""
    return jobset(job)


def child_job(job: str, replicated_job: str, index: int) -> str:
    """The Job JobSet creates for replica `index` of a replicated job."""
    return f"{jobset(job)}-{replicated_job}-{index}"


def learner_host(job: str, node_rank: int) -> str:
    """Host name of learner pod `node_rank`: the Job controller names Indexed pods' hosts
    `<job name>-<completion index>`, and the learner is one Indexed Job."""
    return f"{child_job(job, LEARNER, 0)}-{node_rank}"


def rollout_headless_service(job: str) -> str:
    return f"{job}-rollout"


def rollout_api_service(job: str) -> str:
    return f"{job}-rollout-api"


def sandbox_service(job: str) -> str:
    return f"{job}-sandbox"


def sandbox_network_policy(job: str) -> str:
    return f"{job}-sandbox"


def sandbox_dns(job: str, namespace: str) -> str:
    return f"{sandbox_service(job)}.{namespace}.svc"


def checkpoint_claim(job: str) -> str:
    return f"{job}-checkpoints"


def network_policy(job: str) -> str:
    return f"{job}-pods"


def pod_monitor(job: str) -> str:
    return job


def master_addr(job: str, namespace: str) -> str:
    """Stable DNS name of learner rank 0 (hostname + subdomain of the headless Service)."""
    return f"{learner_host(job, 0)}.{subdomain(job)}.{namespace}.svc"


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


def longest_pod_name(job: str, learner_replicas: int, rollout_replicas: int) -> str:
    """The longest `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>` JobSet will generate."""
    candidates = [f"{child_job(job, LEARNER, 0)}-{max(learner_replicas - 1, 0)}"]
    if rollout_replicas > 0:
        candidates.append(f"{child_job(job, ROLLOUT, rollout_replicas - 1)}-0")
    return max(candidates, key=len)


def max_job_name(learner_replicas: int, rollout_replicas: int) -> int:
    """The longest GSPOJob name whose generated pod names JobSet accepts."""
    return MAX_GENERATED_POD_NAME - (len(longest_pod_name("", learner_replicas, rollout_replicas)))


def check_job_name(job: str, learner_replicas: int = 1, rollout_replicas: int = 1) -> str | None:
    """Why `job` cannot name a GSPOJob's children, or None when it can."""
    if not DNS_LABEL.match(job):
        return (
            f"name {job!r} must be lower-case letters, digits and '-', start with a letter and "
            "end with a letter or digit (it names Services, which are DNS labels)"
        )
    longest = longest_pod_name(job, learner_replicas, rollout_replicas)
    if len(longest) > MAX_GENERATED_POD_NAME:
        limit = max_job_name(learner_replicas, rollout_replicas)
        return (
            f"name {job!r} has {len(job)} characters; with {learner_replicas} learner pods and "
            f"{rollout_replicas} rollout servers JobSet would name a pod {longest!r} "
            f"({len(longest)} characters, JobSet allows {MAX_GENERATED_POD_NAME}); shorten the "
            f"name to {limit} characters or fewer"
        )
    for child in (rollout_api_service(job), checkpoint_claim(job), token_secret(job)):
        if len(child) > DNS_LABEL_MAX:
            return f"name {job!r} makes the child name {child!r} longer than 63; shorten it"
    return None
