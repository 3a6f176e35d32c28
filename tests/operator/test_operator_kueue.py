"""The operator (real kopf tasks) on a cluster with Kueue (tests/cluster/kueue.py): a queued
job is admitted, suspended, resumed and evicted by WaitForPodsReady the way Kueue does it, with
no suspend tug-of-war, and its status says in Kueue's words why it waits. Pod status is set by
hand; Kueue's clock is a ManualClock, so its 5-minute timeout passes without waiting."""

from __future__ import annotations

from typing import Any

import kueue
from kmock_apiserver import Fault
from operator_harness import (
    NS,
    api_server,
    eventually,
    kueue_api_server,
    operator,
    pods_of,
    run_all,
    tiny_job,
)
from test_operator_kmock import JOB, cond, create, job_status, patch_spec

QUEUE = "team"


def queues(*resources: tuple[str, Any]) -> list[dict]:
    """A ResourceFlavor, a ClusterQueue with `resources` (name, nominal quota) and a LocalQueue."""
    flavor = "default-flavor"
    group = {
        "coveredResources": [name for name, _ in resources],
        "flavors": [
            {"name": flavor, "resources": [{"name": n, "nominalQuota": q} for n, q in resources]}
        ],
    }
    return [
        {
            "apiVersion": kueue.QUEUES_API_VERSION,
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor},
        },
        {
            "apiVersion": kueue.QUEUES_API_VERSION,
            "kind": "ClusterQueue",
            "metadata": {"name": "cq"},
            "spec": {"namespaceSelector": {}, "resourceGroups": [group]},
        },
        {
            "apiVersion": kueue.QUEUES_API_VERSION,
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NS},
            "spec": {"clusterQueue": "cq"},
        },
    ]


ROOMY = queues(("cpu", 64), ("memory", "256Gi"), ("nvidia.com/gpu", 8))


def queued_job(**sections: dict) -> dict:
    return tiny_job(runPolicy={"backoffLimit": 1, "scheduling": {"queue": QUEUE}}, **sections)


def workload(api) -> dict:
    (wl,) = api.list_kind("Workload", NS)
    return wl


def suspend_flips(api) -> list[bool]:
    """Every value the JobSet's spec.suspend took, in order, from the store's event history."""
    seen: list[bool] = []
    for _, _, type_, obj in api.history:
        if obj.get("kind") == "JobSet" and type_ in ("ADDED", "MODIFIED"):
            value = bool(obj["spec"].get("suspend"))
            if not seen or seen[-1] != value:
                seen.append(value)
    return seen


def pods_made(api, role: str) -> int:
    """How many pods of `role` were ever created (each suspend deletes them all)."""
    return len(
        {
            obj["metadata"]["uid"]
            for _, _, type_, obj in api.history
            if type_ == "ADDED"
            and obj.get("kind") == "Pod"
            and (obj["metadata"].get("labels") or {}).get("gspo.dev/role") == role
        }
    )


async def passes(controller: kueue.KueueController, count: int) -> None:
    """Let Kueue's controller run `count` more passes (each: JobSets, Workloads, scheduler)."""
    target = controller.passes + count
    await eventually(lambda: controller.passes >= target, what=f"{count} Kueue passes")


async def running(api) -> None:
    await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
    await eventually(lambda: len(pods_of(api, "rollout")) == 2, what="rollout pods")
    await run_all(api)
    await eventually(lambda: job_status(api).get("phase") == "Running", what="phase Running")


async def test_suspend_and_resume_of_a_queued_job_go_through_kueue_without_a_loop(
    progress,
) -> None:
    async with kueue_api_server() as (api, kq), operator(api):
        for doc in ROOMY:
            api.add(doc)
        await create(api, queued_job(metrics={"port": progress.port}))
        await running(api)

        await patch_spec(api, {"runPolicy": {"suspend": True}})
        await eventually(lambda: job_status(api).get("phase") == "Suspended", what="Suspended")
        await passes(kq, 10)  # a tug-of-war flips the JobSet's suspend every pass or two
        assert suspend_flips(api) == [True, False, True]  # created, admitted, suspended
        assert pods_made(api, "learner") == 2  # each round of a loop makes new ones
        await eventually(lambda: not api.list_kind("Pod", NS), what="every pod gone")
        assert api.get("JobSet", NS, JOB)["spec"]["suspend"] is True
        assert workload(api)["spec"]["active"] is False
        evicted = kueue.condition_of(workload(api), "Evicted")
        assert (evicted["status"], evicted["reason"]) == ("True", "Deactivated")
        assert "deactivated (spec.active: false)" in cond(api, "Suspended")["message"]

        await patch_spec(api, {"runPolicy": {"suspend": False}})
        await eventually(lambda: workload(api)["spec"]["active"] is True, what="activated")
        await running(api)
        assert cond(api, "Suspended")["status"] == "False"
        await passes(kq, 10)
        assert suspend_flips(api) == [True, False, True, False]
        assert pods_made(api, "learner") == 4  # two runs of two learner pods
        assert len([e for e in kq.events if e[2] == "Started"]) == 2
        admitted = cond(api, "Queued")
        assert (admitted["status"], admitted["reason"]) == ("False", "Admitted")


async def test_wait_for_pods_ready_evicts_requeues_and_the_status_says_so(progress) -> None:
    clock = kueue.ManualClock()
    config = kueue.WaitForPodsReady()  # Kueue's defaults: 5 minutes, then 60 s backoff
    async with (
        kueue_api_server(wait_for_pods_ready=config, clock=clock) as (api, _),
        operator(api),
    ):
        for doc in ROOMY:
            api.add(doc)
        await create(api, queued_job(metrics={"port": progress.port}))
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
        clock.advance(config.timeout_s + 1)  # the pods never turned ready
        waiting = await eventually(
            lambda: (
                "PodsReadyTimeout" in (cond(api, "Queued") or {}).get("reason", "")
                and cond(api, "Queued")
            ),
            what="the eviction in the job's status",
        )
        wl = workload(api)["metadata"]["name"]
        assert f"Exceeded the PodsReady timeout {NS}/{wl}" in cond(api, "Queued")["message"]
        assert job_status(api)["phase"] == "Pending"
        assert cond(api, "Running")["reason"] == "Queued" and waiting["status"] == "True"

        await eventually(lambda: not api.list_kind("Pod", NS), what="every pod gone")
        clock.advance(config.backoff_base_s + 1)
        await running(api)
        await eventually(
            lambda: kueue.is_true(workload(api), "PodsReady"), what="Kueue's PodsReady condition"
        )
        assert suspend_flips(api) == [True, False, True, False]


async def test_a_queue_without_gpus_says_so_in_the_job_status(progress) -> None:
    async with kueue_api_server() as (api, kq), operator(api):
        for doc in queues(("cpu", 64), ("memory", "256Gi")):
            api.add(doc)
        job = queued_job(metrics={"port": progress.port})
        job["spec"]["learner"]["gpusPerReplica"] = 1
        await create(api, job)
        queued = await eventually(
            lambda: (cond(api, "Queued") or {}).get("reason") == "Pending" and cond(api, "Queued"),
            what="Kueue's reason in the Queued condition",
        )
        assert queued["message"].endswith(
            "couldn't assign flavors to pod set learner: resource nvidia.com/gpu unavailable "
            "in ClusterQueue"
        )
        assert "LocalQueue team" in cond(api, "Running")["message"]
        await passes(kq, 5)
        assert not api.list_kind("Pod", NS)


async def test_without_kueue_a_queue_label_does_nothing_and_suspend_patches_the_jobset(
    progress,
) -> None:
    async with api_server() as api, operator(api):
        await create(api, queued_job(metrics={"port": progress.port}))
        await running(api)  # nothing held the JobSet for admission
        await patch_spec(api, {"runPolicy": {"suspend": True}})
        await eventually(lambda: not api.list_kind("Pod", NS), what="every pod gone")
        assert api.get("JobSet", NS, JOB)["spec"]["suspend"] is True
        asked = [r for r in api._requests if r.resource and r.resource.plural == "workloads"]
        assert len(asked) == 1  # the 404 is remembered until the next resync


async def test_a_refused_workload_patch_is_in_the_job_status(progress) -> None:
    async with kueue_api_server() as (api, _), operator(api):
        for doc in ROOMY:
            api.add(doc)
        await create(api, queued_job(metrics={"port": progress.port}))
        await running(api)
        message = (
            'workloads.kueue.x-k8s.io "x" is forbidden: User "system:serviceaccount:gspo:gspo" '
            'cannot patch resource "workloads" in API group "kueue.x-k8s.io"'
        )
        api.faults.append(Fault("PATCH", "workloads", 403, "Forbidden", message))
        await patch_spec(api, {"runPolicy": {"suspend": True}})
        blocked = await eventually(lambda: cond(api, "Blocked"), what="the refusal in the status")
        assert blocked["reason"] == "Forbidden" and job_status(api)["phase"] == "Blocked"
        wl = workload(api)["metadata"]["name"]
        assert f"refused to deactivate Kueue's Workload {wl}" in blocked["message"]
        assert "cannot patch resource" in blocked["message"]
        api.faults.clear()  # the admin grants it: the job suspends
        await eventually(lambda: job_status(api).get("phase") == "Suspended", what="Suspended")
        assert cond(api, "Blocked")["status"] == "False"
