"""The local cluster's Job and JobSet controllers and JobSet's webhook, driven by hand.

Pod status is patched by the tests (the kubelet's part) and the controllers are stepped with
`sync_all()`, so every transition is observed in order; one test runs the `run()` loops. The
expected names, labels, reasons and messages come from Kubernetes' and JobSet's sources (see
the controllers' module docstrings), so these tests check the stand-ins against them.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # kmock_apiserver

from apiserver import ClusterApiServer
from backoff import PodFailureRecord, next_record, pod_failure_delay_s
from job_controller import (
    BACKOFF_LIMIT_MESSAGE,
    JobController,
    admit_job,
    format_indexes,
    parse_indexes,
)
from jobset_controller import JobSetController
from jobset_webhook import (
    POD_NAME_TOO_LONG,
    RESTART_JOB_GATE_OFF,
    admit,
    default_jobset,
    make_admit,
    validate_jobset,
)

Obj = dict[str, Any]
NS = "default"
SUFFIX = "[bcdfghjklmnpqrstvwxz2456789]{5}"
INDEX = "batch.kubernetes.io/job-completion-index"


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def job_controller(api: ClusterApiServer, clock: FakeClock) -> JobController:
    """A Job controller on `clock` with the real (unscaled) pod-failure back-off."""
    return JobController(api, clock=clock, time_scale=1.0)


@pytest.fixture
async def api() -> AsyncIterator[ClusterApiServer]:
    async with ClusterApiServer(admission=[admit, admit_job]) as server:
        yield server


# --- helpers --------------------------------------------------------------------------------------


def pod_template(restart: str = "Never", **spec: Any) -> Obj:
    return {
        "spec": {
            "restartPolicy": restart,
            "containers": [{"name": "main", "image": "busybox", "command": ["true"]}],
            **spec,
        }
    }


def indexed_job(name: str, completions: int, **spec: Any) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "template": pod_template(),
            **spec,
        },
    }


def pods_of(api: ClusterApiServer, job: str) -> list[Obj]:
    pods = [
        p
        for p in api.list_kind("Pod", NS)
        if (p["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name") == job
    ]
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def pod_at(api: ClusterApiServer, job: str, index: int, *, live: bool = True) -> Obj:
    """The pod of that index (the live one: not finished, not being deleted, by default)."""
    found = [
        p
        for p in pods_of(api, job)
        if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(index)
        and (
            not live
            or (
                not p["metadata"].get("deletionTimestamp")
                and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
            )
        )
    ]
    assert len(found) == 1, found
    return found[0]


async def schedule(api: ClusterApiServer, pod: Obj) -> None:
    """What the kubelet does first: bind the pod (deletions become graceful)."""
    await api.patch("Pod", NS, pod["metadata"]["name"], {"spec": {"nodeName": "node-1"}})


async def run_pod(api: ClusterApiServer, pod: Obj, ready: bool = True) -> None:
    await schedule(api, pod)
    cond = "True" if ready else "False"
    await api.patch_status(
        "Pod",
        NS,
        pod["metadata"]["name"],
        {"phase": "Running", "conditions": [{"type": "Ready", "status": cond}]},
    )


async def finish_pod(
    api: ClusterApiServer, pod: Obj, exit_code: int, conditions: list[Obj] | None = None
) -> None:
    await api.patch_status(
        "Pod",
        NS,
        pod["metadata"]["name"],
        {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": conditions or [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {
                    "name": "main",
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": "Completed" if exit_code == 0 else "Error",
                        }
                    },
                }
            ],
        },
    )


def status(api: ClusterApiServer, kind: str, name: str) -> Obj:
    obj = api.get(kind, NS, name)
    assert obj is not None, f"{kind} {name} is gone"
    return obj.get("status") or {}


def condition(obj_status: Obj, type_: str) -> Obj | None:
    return next((c for c in obj_status.get("conditions") or [] if c["type"] == type_), None)


def condition_types(obj_status: Obj) -> list[str]:
    return [c["type"] for c in obj_status.get("conditions") or [] if c["status"] == "True"]


async def step(*controllers: JobController | JobSetController, times: int = 1) -> None:
    for _ in range(times):
        for c in controllers:
            await c.sync_all()
    for c in controllers:
        assert not c.errors, c.errors


# --- the Job controller ---------------------------------------------------------------------------


def test_completed_indexes_format() -> None:
    assert format_indexes({0, 1}) == "0,1"
    assert format_indexes({0, 1, 2, 4, 6, 7}) == "0-2,4,6,7"
    assert format_indexes(set()) == ""
    assert parse_indexes("0-2,4,6,7", 7) == {0, 1, 2, 4, 6}


async def test_indexed_job_pods_names_hostnames_labels_env(api: ClusterApiServer) -> None:
    jc = JobController(api)
    job = await api.create(indexed_job("train", 3, template=pod_template(subdomain="net")))
    uid = job["metadata"]["uid"]
    await step(jc)

    pods = pods_of(api, "train")
    assert len(pods) == 3
    for index in range(3):
        pod = pod_at(api, "train", index)
        meta, spec = pod["metadata"], pod["spec"]
        assert re.fullmatch(rf"train-{index}-{SUFFIX}", meta["name"])
        assert spec["hostname"] == f"train-{index}"
        assert spec["subdomain"] == "net"
        assert meta["labels"] == {
            "batch.kubernetes.io/job-name": "train",
            "batch.kubernetes.io/controller-uid": uid,
            "job-name": "train",
            "controller-uid": uid,
            "batch.kubernetes.io/job-completion-index": str(index),
        }
        assert meta["annotations"] == {"batch.kubernetes.io/job-completion-index": str(index)}
        assert spec["containers"][0]["env"] == [
            {
                "name": "JOB_COMPLETION_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
            }
        ]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": "train",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    st = status(api, "Job", "train")
    assert (st["active"], st["ready"], st["terminating"]) == (3, 0, 0)
    assert st["startTime"]
    assert "succeeded" not in st and "failed" not in st

    await run_pod(api, pod_at(api, "train", 0))
    await step(jc)
    assert status(api, "Job", "train")["ready"] == 1

    for index in (0, 2):
        await finish_pod(api, pod_at(api, "train", index), 0)
    await step(jc)
    st = status(api, "Job", "train")
    assert (st["succeeded"], st["completedIndexes"], st["active"]) == (2, "0,2", 1)
    assert condition_types(st) == []

    await finish_pod(api, pod_at(api, "train", 1), 0)
    await step(jc)
    st = status(api, "Job", "train")
    assert (st["succeeded"], st["completedIndexes"]) == (3, "0-2")
    assert "active" not in st
    assert condition_types(st) == ["SuccessCriteriaMet", "Complete"]
    complete = condition(st, "Complete")
    assert complete is not None
    assert (complete["reason"], complete["message"]) == (
        "CompletionsReached",
        "Reached expected number of succeeded pods",
    )
    assert st["completionTime"]
    await step(jc)
    assert len(pods_of(api, "train")) == 3  # a finished Job creates nothing more


async def test_backoff_limit_replaces_failed_pod_with_same_index_then_fails(
    api: ClusterApiServer,
) -> None:
    clock = FakeClock()
    jc = job_controller(api, clock)
    await api.create(indexed_job("bo", 2, backoffLimit=1))
    await step(jc)
    for index in (0, 1):
        await run_pod(api, pod_at(api, "bo", index))
    first = pod_at(api, "bo", 0)
    await finish_pod(api, first, 1)
    await step(jc)
    st = status(api, "Job", "bo")
    assert st["failed"] == 1
    assert condition_types(st) == []
    assert len(pods_of(api, "bo")) == 2  # the pod-failure back-off: 10 s before a new pod
    clock.advance(10)
    await step(jc)
    replacement = pod_at(api, "bo", 0)
    assert replacement["metadata"]["name"] != first["metadata"]["name"]
    assert replacement["spec"]["hostname"] == "bo-0"

    await finish_pod(api, replacement, 1)
    await step(jc)
    st = status(api, "Job", "bo")
    target = condition(st, "FailureTarget")
    assert target is not None
    assert (target["reason"], target["message"]) == ("BackoffLimitExceeded", BACKOFF_LIMIT_MESSAGE)
    assert condition(st, "Failed") is None  # index 1's pod is still terminating
    assert st["terminating"] == 1
    survivor = pod_at(api, "bo", 1, live=False)
    assert survivor["metadata"]["deletionTimestamp"]

    api.remove_pod(NS, survivor["metadata"]["name"])  # the kubelet finished terminating it
    await step(jc)
    st = status(api, "Job", "bo")
    failed = condition(st, "Failed")
    assert failed is not None
    assert (failed["reason"], failed["message"]) == ("BackoffLimitExceeded", BACKOFF_LIMIT_MESSAGE)
    assert st["failed"] == 3  # the pod deleted because the Job failed counts too
    assert (st["terminating"], st["ready"]) == (0, 0)
    assert "active" not in st


FAIL_ON_EXIT_2 = {
    "rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "main", "operator": "In", "values": [2]},
        },
    ]
}


async def test_pod_failure_policy_fail_job_on_exit_code_2(api: ClusterApiServer) -> None:
    jc = JobController(api)
    await api.create(indexed_job("pfp", 2, podFailurePolicy=FAIL_ON_EXIT_2))
    await step(jc)
    pod = pod_at(api, "pfp", 1)
    await run_pod(api, pod)
    await finish_pod(api, pod, 2)
    await step(jc)
    st = status(api, "Job", "pfp")
    message = (
        f"Container main for pod default/{pod['metadata']['name']} failed with exit code 2 "
        "matching FailJob rule at index 1"
    )
    assert condition_types(st) == ["FailureTarget", "Failed"]  # index 0 was never scheduled
    for type_ in ("FailureTarget", "Failed"):
        cond = condition(st, type_)
        assert cond is not None
        assert (cond["reason"], cond["message"]) == ("PodFailurePolicy", message)
    assert pods_of(api, "pfp") == [api.get("Pod", NS, pod["metadata"]["name"])]


async def test_pod_failure_policy_ignores_disruption_and_exit_1_counts(
    api: ClusterApiServer,
) -> None:
    clock = FakeClock()
    jc = job_controller(api, clock)
    await api.create(indexed_job("evict", 1, backoffLimit=0, podFailurePolicy=FAIL_ON_EXIT_2))
    await step(jc)
    evicted = pod_at(api, "evict", 0)
    await run_pod(api, evicted)
    await finish_pod(
        api,
        evicted,
        137,
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        ],
    )
    await step(jc)
    st = status(api, "Job", "evict")
    assert "failed" not in st  # Ignore: not counted towards backoffLimit 0
    assert condition_types(st) == []
    clock.advance(10)  # but counted by the pod-failure back-off
    await step(jc)
    again = pod_at(api, "evict", 0)
    assert again["metadata"]["name"] != evicted["metadata"]["name"]

    await run_pod(api, again)
    await finish_pod(api, again, 1)  # no rule matches exit code 1: counted
    await step(jc)
    st = status(api, "Job", "evict")
    assert st["failed"] == 1
    assert condition(st, "Failed") is not None
    assert condition(st, "Failed")["reason"] == "BackoffLimitExceeded"


async def test_pod_failure_policy_requires_restart_policy_never(api: ClusterApiServer) -> None:
    job = indexed_job("bad", 1, podFailurePolicy=FAIL_ON_EXIT_2)
    job["spec"]["template"] = pod_template(restart="OnFailure")
    with pytest.raises(kmock.KubernetesError) as refused:
        await api.create(job)
    assert refused.value.status == 422
    assert refused.value.message == (
        'Job.batch "bad" is invalid: spec.template.spec.restartPolicy: Invalid value: '
        '"OnFailure": only "Never" is supported when podFailurePolicy is specified'
    )
    assert api.get("Job", NS, "bad") is None


async def test_deleted_pod_is_terminating_and_replacement_policy(api: ClusterApiServer) -> None:
    clock = FakeClock()
    jc = job_controller(api, clock)
    await api.create(indexed_job("tof", 1))  # podReplacementPolicy TerminatingOrFailed
    await api.create(indexed_job("fld", 1, podFailurePolicy=FAIL_ON_EXIT_2))  # Failed
    await step(jc)
    for name in ("tof", "fld"):
        pod = pod_at(api, name, 0)
        await run_pod(api, pod)
        await api.delete("Pod", NS, pod["metadata"]["name"])  # graceful: deletionTimestamp
    await step(jc)
    assert len(pods_of(api, "tof")) == 1  # counted as failed at once; 10 s of back-off
    clock.advance(10)
    await step(jc)

    tof, fld = status(api, "Job", "tof"), status(api, "Job", "fld")
    assert (tof["terminating"], tof["active"], tof["failed"]) == (1, 1, 1)
    assert len(pods_of(api, "tof")) == 2  # replaced at once, old pod still terminating
    assert (fld["terminating"], fld.get("active"), fld.get("failed")) == (1, None, None)
    assert len(pods_of(api, "fld")) == 1  # replaced only once the old pod is gone
    old = pods_of(api, "fld")[0]
    api.remove_pod(NS, old["metadata"]["name"])
    await step(jc)
    assert pods_of(api, "fld") == []  # gone: a failure now, and its back-off starts now
    clock.advance(10)
    await step(jc)
    fld = status(api, "Job", "fld")
    assert (fld["terminating"], fld["active"], fld["failed"]) == (0, 1, 1)
    assert pod_at(api, "fld", 0)["metadata"]["name"] != old["metadata"]["name"]


async def test_an_update_keeps_a_pod_in_its_grace_period_and_ends_a_finalized_delete(
    api: ClusterApiServer,
) -> None:
    """kube-apiserver's shouldDeleteDuringUpdate: a status write to a pod being deleted with
    a grace period leaves it (only the kubelet's DELETE with grace 0 removes it); an object
    whose deletion waited on finalizers goes with the update that clears them."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": NS},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x"}]},
    }
    await api.create(pod)
    await api.delete("Pod", NS, "p", grace_s=30)
    await api.patch_status("Pod", NS, "p", {"phase": "Running"})
    kept = api.get("Pod", NS, "p")
    assert kept is not None and kept["metadata"]["deletionGracePeriodSeconds"] == 30
    api.remove_pod(NS, "p")
    assert api.get("Pod", NS, "p") is None
    # Held by a finalizer, the kubelet's grace-0 DELETE lowers the grace period to 0, so the
    # update that clears the finalizer then deletes it.
    await api.create({**pod, "metadata": {**pod["metadata"], "finalizers": ["example.com/x"]}})
    await api.delete("Pod", NS, "p", grace_s=30)
    api.remove_pod(NS, "p")
    held = api.get("Pod", NS, "p")
    assert held is not None and held["metadata"]["deletionGracePeriodSeconds"] == 0
    await api.patch("Pod", NS, "p", {"metadata": {"finalizers": None}})
    assert api.get("Pod", NS, "p") is None

    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "held", "namespace": NS, "finalizers": ["example.com/hold"]},
    }
    await api.create(cm)
    await api.delete("ConfigMap", NS, "held")
    assert api.get("ConfigMap", NS, "held")["metadata"]["deletionTimestamp"]
    await api.patch("ConfigMap", NS, "held", {"metadata": {"finalizers": None}})
    assert api.get("ConfigMap", NS, "held") is None


async def test_suspend_and_resume_job(api: ClusterApiServer) -> None:
    jc = JobController(api)
    await api.create(indexed_job("sus", 2))
    await step(jc)
    first = [pod_at(api, "sus", i) for i in (0, 1)]
    for pod in first:
        await run_pod(api, pod)
    await api.patch("Job", NS, "sus", {"spec": {"suspend": True}})
    await step(jc)
    st = status(api, "Job", "sus")
    suspended = condition(st, "Suspended")
    assert suspended is not None
    assert (suspended["status"], suspended["reason"], suspended["message"]) == (
        "True",
        "JobSuspended",
        "Job suspended",
    )
    assert ("active" in st, st["terminating"], "failed" in st) == (False, 2, False)
    await step(jc)  # the pods are seen terminating: still no failure counted, none replaced
    st = status(api, "Job", "sus")
    assert ("active" in st, st["terminating"], "failed" in st) == (False, 2, False)
    for pod in first:
        api.remove_pod(NS, pod["metadata"]["name"])
    await step(jc)
    assert pods_of(api, "sus") == []
    assert status(api, "Job", "sus")["terminating"] == 0

    await api.patch("Job", NS, "sus", {"spec": {"suspend": False}})
    await step(jc)
    st = status(api, "Job", "sus")
    resumed = condition(st, "Suspended")
    assert resumed is not None
    assert (resumed["status"], resumed["reason"], resumed["message"]) == (
        "False",
        "JobResumed",
        "Job resumed",
    )
    assert st["active"] == 2
    assert "failed" not in st  # pods deleted for suspension are not failures
    assert {pod_at(api, "sus", i)["spec"]["hostname"] for i in (0, 1)} == {"sus-0", "sus-1"}


# --- JobSet ---------------------------------------------------------------------------------------


def replicated_job(name: str, replicas: int, completions: int, **job_spec: Any) -> Obj:
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "metadata": {"labels": {"team": "rl"}},
            "spec": {
                "completions": completions,
                "parallelism": completions,
                "template": pod_template(),
                **job_spec,
            },
        },
    }


def jobset(name: str, *rjobs: Obj, **spec: Any) -> Obj:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicatedJobs": list(rjobs), **spec},
    }


def jobs_of(api: ClusterApiServer, js: str) -> dict[str, Obj]:
    return {
        j["metadata"]["name"]: j
        for j in api.list_kind("Job", NS)
        if j["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == js
    }


async def test_jobset_creates_jobs_labels_subdomain_and_service(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    js = await api.create(
        jobset("gspo", replicated_job("learner", 1, 2), replicated_job("rollout", 2, 1))
    )
    uid = js["metadata"]["uid"]
    # The webhook's defaults landed on the stored object.
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert js["spec"]["successPolicy"] == {"operator": "All"}
    rjob_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert rjob_spec["completionMode"] == "Indexed"
    assert rjob_spec["template"]["spec"]["restartPolicy"] == "Never"  # kept when set
    await step(jsc, jc)

    jobs = jobs_of(api, "gspo")
    assert sorted(jobs) == ["gspo-learner-0", "gspo-rollout-0", "gspo-rollout-1"]
    job = jobs["gspo-rollout-1"]
    expected = {
        "jobset.sigs.k8s.io/jobset-name": "gspo",
        "jobset.sigs.k8s.io/jobset-uid": uid,
        "jobset.sigs.k8s.io/replicatedjob-name": "rollout",
        "jobset.sigs.k8s.io/replicatedjob-replicas": "2",
        "jobset.sigs.k8s.io/global-replicas": "3",
        "jobset.sigs.k8s.io/job-index": "1",
        "jobset.sigs.k8s.io/job-global-index": "2",
        "jobset.sigs.k8s.io/job-key": hashlib.sha1(b"default/gspo-rollout-1").hexdigest(),
        "jobset.sigs.k8s.io/group-name": "default",
        "jobset.sigs.k8s.io/group-replicas": "3",
        "jobset.sigs.k8s.io/job-group-index": "2",
        "jobset.sigs.k8s.io/restart-attempt": "0",
    }
    assert job["metadata"]["labels"] == {"team": "rl", **expected}
    assert job["metadata"]["annotations"] == expected
    template = job["spec"]["template"]
    assert template["metadata"]["labels"] == expected
    assert template["spec"]["subdomain"] == "gspo"
    assert job["spec"]["suspend"] is False
    assert job["metadata"]["ownerReferences"][0]["uid"] == uid

    service = api.get("Service", NS, "gspo")
    assert service is not None
    assert service["spec"] == {
        "clusterIP": "None",
        "selector": {"jobset.sigs.k8s.io/jobset-name": "gspo"},
        "publishNotReadyAddresses": True,
    }
    assert service["metadata"]["ownerReferences"][0]["uid"] == uid

    learner_pods = pods_of(api, "gspo-learner-0")
    assert sorted(p["spec"]["hostname"] for p in learner_pods) == [
        "gspo-learner-0-0",
        "gspo-learner-0-1",
    ]
    assert all(
        re.fullmatch(rf"gspo-learner-0-[01]-{SUFFIX}", p["metadata"]["name"]) for p in learner_pods
    )
    assert all(
        p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == "gspo" for p in learner_pods
    )

    for job_name in jobs:
        for pod in pods_of(api, job_name):
            await run_pod(api, pod)
    await step(jc, jsc)
    st = status(api, "JobSet", "gspo")
    assert st["restarts"] == 0
    assert st["replicatedJobsStatus"] == [
        {"name": "learner", "ready": 1, "succeeded": 0, "failed": 0, "active": 1, "suspended": 0},
        {"name": "rollout", "ready": 2, "succeeded": 0, "failed": 0, "active": 2, "suspended": 0},
    ]
    assert condition_types(st) == []

    await api.delete("JobSet", NS, "gspo")  # garbage collection takes Jobs, Service and pods
    assert jobs_of(api, "gspo") == {}
    assert api.get("Service", NS, "gspo") is None


EXIT_CODE_POLICY = {
    "rules": [{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}}]
}


def failing_jobset(name: str, failure_policy: Obj | None) -> Obj:
    spec: Obj = {} if failure_policy is None else {"failurePolicy": failure_policy}
    return jobset(
        name,
        replicated_job("leader", 1, 1, backoffLimit=0),
        replicated_job("workers", 2, 1, podFailurePolicy=EXIT_CODE_POLICY),
        **spec,
    )


async def fail_job(api: ClusterApiServer, jc: JobController, job: str, exit_code: int) -> None:
    """Run every pod of the Job and fail the first with `exit_code`."""
    pods = [p for p in pods_of(api, job) if p.get("status", {}).get("phase") != "Failed"]
    for pod in pods:
        await run_pod(api, pod)
    await finish_pod(api, pods[0], exit_code)
    await step(jc)


async def test_failure_policy_message_pattern_fails_jobset(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    policy = {
        "maxRestarts": 3,
        "rules": [
            {
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [r"failed with exit code 2 matching FailJob"],
                "targetReplicatedJobs": ["workers"],
            }
        ],
    }
    await api.create(failing_jobset("fj", policy))
    await step(jsc, jc)
    await fail_job(api, jc, "fj-workers-1", 2)
    await step(jsc)
    st = status(api, "JobSet", "fj")
    failed = condition(st, "Failed")
    assert failed is not None
    assert (failed["reason"], failed["message"]) == (
        "FailJobSetFailurePolicyAction",
        "applying FailJobSet failure policy action (first failed job: fj-workers-1)",
    )
    assert st["terminalState"] == "Failed"
    assert st["restarts"] == 0
    assert {r["name"]: r["failed"] for r in st["replicatedJobsStatus"]} == {
        "leader": 0,
        "workers": 1,
    }
    await step(jsc)
    assert sorted(jobs_of(api, "fj")) == ["fj-workers-1"]  # the active Jobs are deleted


async def test_default_restart_recreates_jobs_with_next_attempt(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    policy = {
        "maxRestarts": 1,
        "rules": [
            {
                "action": "FailJobSet",
                "onJobFailureMessagePatterns": ["exit code 2"],
            }
        ],
    }
    await api.create(failing_jobset("rs", policy))
    await step(jsc, jc)
    old_uids = {j["metadata"]["uid"] for j in jobs_of(api, "rs").values()}
    for pod in api.list_kind("Pod", NS):
        await run_pod(api, pod)
    await fail_job(api, jc, "rs-workers-0", 1)  # exit 1: no rule matches -> RestartJobSet
    await step(jsc)
    st = status(api, "JobSet", "rs")
    assert (st["restarts"], st["restartsCountTowardsMax"]) == (1, 1)
    restarting = condition(st, "RestartingJobSet")
    assert restarting is not None
    assert (restarting["status"], restarting["reason"], restarting["message"]) == (
        "True",
        "DefaultFailurePolicy",
        "applying RestartJobSet failure policy action (first failed job: rs-workers-0)",
    )

    await step(jsc)  # old Jobs deleted; their scheduled pods are still terminating
    assert jobs_of(api, "rs") == {}
    lingering = [p for p in api.list_kind("Pod", NS) if p["metadata"].get("deletionTimestamp")]
    assert lingering
    await step(jsc)
    assert jobs_of(api, "rs") == {}  # foreground deletion: names stay taken meanwhile
    api.remove_pod(NS, pods_of(api, "rs-leader-0")[0]["metadata"]["name"])
    await step(jsc)
    assert sorted(jobs_of(api, "rs")) == ["rs-leader-0"]  # Recreate: each once its pods are gone
    for pod in api.list_kind("Pod", NS):
        api.remove_pod(NS, pod["metadata"]["name"])
    await step(jsc, jc)
    jobs = jobs_of(api, "rs")
    assert sorted(jobs) == ["rs-leader-0", "rs-workers-0", "rs-workers-1"]
    assert not {j["metadata"]["uid"] for j in jobs.values()} & old_uids
    for job in jobs.values():
        assert job["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"
        template_labels = job["spec"]["template"]["metadata"]["labels"]
        assert template_labels["jobset.sigs.k8s.io/restart-attempt"] == "1"
    assert len(pods_of(api, "rs-workers-0")) == 1

    for job in jobs:
        for pod in pods_of(api, job):
            await run_pod(api, pod)
    await step(jc, jsc)
    restarting = condition(status(api, "JobSet", "rs"), "RestartingJobSet")
    assert restarting is not None
    assert (restarting["status"], restarting["reason"]) == ("False", "JobsReady")

    # A second failure is beyond maxRestarts 1.
    await fail_job(api, jc, "rs-leader-0", 1)
    await step(jsc)
    st = status(api, "JobSet", "rs")
    failed = condition(st, "Failed")
    assert failed is not None
    assert (failed["reason"], failed["message"]) == (
        "ReachedMaxRestarts",
        "jobset failed due to reaching max number of restarts (first failed job: rs-leader-0)",
    )
    assert (st["restarts"], st["terminalState"]) == (1, "Failed")


async def test_no_failure_policy_fails_at_first_failed_job(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    await api.create(failing_jobset("nofp", None))
    await step(jsc, jc)
    await fail_job(api, jc, "nofp-leader-0", 1)
    await step(jsc)
    failed = condition(status(api, "JobSet", "nofp"), "Failed")
    assert failed is not None
    assert (failed["reason"], failed["message"]) == (
        "FailedJobs",
        "jobset failed due to one or more job failures (first failed job: nofp-leader-0)",
    )


async def test_restart_ignoring_max_restarts_does_not_count(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    policy = {
        "maxRestarts": 0,
        "rules": [
            {
                "name": "preempted",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["BackoffLimitExceeded"],
            }
        ],
    }
    await api.create(failing_jobset("ign", policy))
    await step(jsc, jc)
    await fail_job(api, jc, "ign-leader-0", 1)  # backoffLimit 0 -> BackoffLimitExceeded
    await step(jsc)
    st = status(api, "JobSet", "ign")
    assert st["restarts"] == 1
    assert "restartsCountTowardsMax" not in st
    assert condition(st, "Failed") is None
    restarting = condition(st, "RestartingJobSet")
    assert restarting is not None
    assert restarting["reason"] == "FailurePolicy_preempted"
    assert restarting["message"] == (
        "applying RestartJobSetAndIgnoreMaxRestarts failure policy action "
        "(first failed job: ign-leader-0)"
    )


async def test_success_policy_on_one_replicated_job(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    await api.create(
        jobset(
            "sp",
            replicated_job("driver", 1, 1),
            replicated_job("servers", 2, 1),
            successPolicy={"operator": "All", "targetReplicatedJobs": ["driver"]},
        )
    )
    await step(jsc, jc)
    for job in jobs_of(api, "sp"):
        for pod in pods_of(api, job):
            await run_pod(api, pod)
    await finish_pod(api, pod_at(api, "sp-servers-0", 0), 0)  # not targeted: not enough
    await step(jc, jsc)
    assert condition_types(status(api, "JobSet", "sp")) == []
    assert status(api, "JobSet", "sp")["replicatedJobsStatus"][1]["succeeded"] == 1
    await finish_pod(api, pod_at(api, "sp-driver-0", 0), 0)
    await step(jc, jsc)
    st = status(api, "JobSet", "sp")
    completed = condition(st, "Completed")
    assert completed is not None
    assert (completed["reason"], completed["message"]) == (
        "AllJobsCompleted",
        "jobset completed successfully",
    )
    assert st["terminalState"] == "Completed"
    await step(jsc)
    assert sorted(jobs_of(api, "sp")) == ["sp-driver-0", "sp-servers-0"]  # active one deleted
    active_pods = pods_of(api, "sp-servers-1")  # garbage collection deletes them gracefully
    assert active_pods and all(p["metadata"].get("deletionTimestamp") for p in active_pods)


async def test_jobset_suspend_and_resume(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    await api.create(jobset("ss", replicated_job("w", 2, 1), suspend=True))
    await step(jsc, jc)
    jobs = jobs_of(api, "ss")
    assert all(j["spec"]["suspend"] is True for j in jobs.values())
    assert pods_of(api, "ss-w-0") == []
    await step(jsc)
    st = status(api, "JobSet", "ss")
    assert condition_types(st) == ["Suspended"]
    assert st["replicatedJobsStatus"][0]["suspended"] == 2

    await api.patch("JobSet", NS, "ss", {"spec": {"suspend": False}})
    await step(jsc, jc)
    assert all(j["spec"]["suspend"] is False for j in jobs_of(api, "ss").values())
    suspended = condition(status(api, "JobSet", "ss"), "Suspended")
    assert suspended is not None
    assert (suspended["status"], suspended["reason"], suspended["message"]) == (
        "False",
        "ResumeJobs",
        "jobset is resumed",
    )
    assert len(pods_of(api, "ss-w-1")) == 1

    await api.patch("JobSet", NS, "ss", {"spec": {"suspend": True}})
    await step(jsc, jc)
    assert all(j["spec"]["suspend"] is True for j in jobs_of(api, "ss").values())
    assert condition(status(api, "JobSet", "ss"), "Suspended")["status"] == "True"
    assert all(p["metadata"].get("deletionTimestamp") for p in pods_of(api, "ss-w-1")) or not (
        pods_of(api, "ss-w-1")
    )


async def test_controllers_run_loops_to_completion(api: ClusterApiServer) -> None:
    jsc, jc = JobSetController(api), JobController(api)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(c.run(stop)) for c in (jsc, jc)]
    try:
        await api.create(jobset("loop", replicated_job("w", 2, 2)))

        async def eventually(check: Callable[[], bool]) -> None:
            for _ in range(60):
                if check():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("condition not reached")

        await eventually(lambda: len(api.list_kind("Pod", NS)) == 4)
        for pod in api.list_kind("Pod", NS):
            await run_pod(api, pod)
            await finish_pod(api, pod, 0)
        await eventually(lambda: status(api, "JobSet", "loop").get("terminalState") == "Completed")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert not jsc.errors and not jc.errors
    assert [r["succeeded"] for r in status(api, "JobSet", "loop")["replicatedJobsStatus"]] == [2]


# --- the webhook ----------------------------------------------------------------------------------


async def test_webhook_refuses_restart_job_actions_without_gate(api: ClusterApiServer) -> None:
    policy = {"maxRestarts": 2, "rules": [{"action": "RestartJob"}]}
    with pytest.raises(kmock.KubernetesError) as refused:
        await api.create(jobset("rj", replicated_job("w", 1, 1), failurePolicy=policy))
    assert refused.value.status == 422
    assert refused.value.message == (
        f'JobSet.jobset.x-k8s.io "rj" is invalid: <nil>: Internal error: {RESTART_JOB_GATE_OFF}'
    )
    assert api.get("JobSet", NS, "rj") is None
    gated = default_jobset(jobset("rj", replicated_job("w", 1, 1), failurePolicy=policy))
    assert validate_jobset(gated, restart_job_gate=True) == []
    assert make_admit(restart_job_gate=True)(gated) is None
    assert gated["spec"]["failurePolicy"]["rules"][0]["name"] == "failurePolicyRule0"


async def test_webhook_refuses_pod_names_over_the_limit(api: ClusterApiServer) -> None:
    # Pod names are <js>-<rjob>-<jobIdx>-<podIdx>-<5 chars>: 57 characters before the suffix.
    fits = "a" * 51  # "a"*51 + "-w-0-0" = 57
    too_long = "b" * 52
    await api.create(jobset(fits, replicated_job("w", 1, 1)))
    with pytest.raises(kmock.KubernetesError) as refused:
        await api.create(jobset(too_long, replicated_job("w", 1, 1)))
    assert refused.value.message == (
        f'JobSet.jobset.x-k8s.io "{too_long}" is invalid: spec.replicatedJobs[0].name: '
        f'Invalid value: "{too_long}-w-0": {POD_NAME_TOO_LONG}'
    )
    # A bad subdomain and a job name over 63 characters are refused as well.
    errors = validate_jobset(
        default_jobset(jobset("x" * 60, replicated_job("w", 1, 1), network={"subdomain": "Bad_"}))
    )
    assert any(
        e.startswith('spec.network.subdomain: Invalid value: "Bad_": a lowercase RFC')
        for e in errors
    )
    assert any("job names generated for this JobSet will exceed 63 characters" in e for e in errors)
    assert admit({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}) is None


# --- the pod-failure back-off ---------------------------------------------------------------------


async def test_pod_failure_backoff_doubles_to_its_cap_and_a_success_resets_it(
    api: ClusterApiServer,
) -> None:
    """10 s, 20 s, ... 10 min between a failed pod and its replacement (backoff_utils.go)."""
    clock = FakeClock()
    jc = job_controller(api, clock)
    job = await api.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "flaky", "namespace": NS},
            "spec": {
                "completions": 2,
                "parallelism": 1,
                "backoffLimit": 50,
                "template": pod_template(),
            },
        }
    )

    def live() -> list[Obj]:
        done = ("Succeeded", "Failed")
        return [
            p for p in pods_of(api, "flaky") if (p.get("status") or {}).get("phase") not in done
        ]

    async def end_pod(exit_code: int) -> None:
        (pod,) = live()
        await run_pod(api, pod)
        await finish_pod(api, pod, exit_code)
        await step(jc)

    async def waited_s() -> float:
        """Seconds (of the fake clock) the next pod waits: none a second before, one then."""
        delay = jc.pod_failure_delay_s(job)
        if delay:
            clock.advance(delay - 1)
            await step(jc)
            assert not live(), f"a pod {delay - 1} s into a {delay} s back-off"
            clock.advance(1)
        await step(jc)
        assert live(), f"no pod after the {delay} s back-off"
        return delay

    await step(jc)
    delays = []
    for _ in range(8):
        await end_pod(1)
        delays.append(await waited_s())
    assert delays == [10, 20, 40, 80, 160, 320, 600, 600]
    assert jc.pod_failure_delay_s(job) == 0

    await end_pod(0)  # a success: the count starts again
    assert await waited_s() == 0
    await end_pod(1)
    assert await waited_s() == 10
    assert status(api, "Job", "flaky")["failed"] == 9


def test_pod_failure_record_follows_new_backoff_record() -> None:
    """newBackoffRecord: failures after the newest success count; a failure-free sync keeps."""
    record = next_record(PodFailureRecord(), [], [5.0, 3.0])
    assert record == PodFailureRecord(2, 5.0)
    assert next_record(record, [], []) == record
    assert next_record(record, [6.0], [4.0, 7.0, 8.0]) == PodFailureRecord(2, 8.0)
    assert next_record(record, [9.0], [8.0]) == PodFailureRecord(0, None)
    assert pod_failure_delay_s(PodFailureRecord(2, 8.0), now_s=15.0) == 13.0
    assert pod_failure_delay_s(PodFailureRecord(3, 8.0), now_s=48.0) == 0.0
    assert pod_failure_delay_s(PodFailureRecord(30, 0.0), now_s=0.0) == 600.0
