"""The Kueue stand-in (kueue.py) driven by hand: the flagship example's JobSet, as the operator
renders it, against examples/kueue.yaml's queues.

The controllers are stepped with `settle()` and Kueue's clock is a `ManualClock`, so
WaitForPodsReady's timeout and requeue backoff pass without waiting. Names, reasons and
messages are Kueue v0.13's (see the stand-in's docstring for the source files).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # kmock_apiserver

import kueue
from apiserver import ClusterApiServer
from job_controller import JobController, admit_job
from jobset_controller import JobSetController
from jobset_webhook import admit
from operator_harness import flagship_priority_class

from gspo_api.validation import parse_spec
from gspo_operator import render
from gspo_operator.manifest import ClusterPolicy

Obj = dict[str, Any]
NS = "default"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Cluster:
    """The API stand-in with JobSet, Job and Kueue controllers, stepped by hand."""

    def __init__(self, api: ClusterApiServer) -> None:
        self.api = api
        self.clock = kueue.ManualClock()
        self.kueue = kueue.KueueController(api, clock=self.clock)
        self.controllers = [JobSetController(api), JobController(api), self.kueue]

    async def settle(self, passes: int = 6) -> None:
        for _ in range(passes):
            for c in self.controllers:
                await c.sync_all()
        for c in self.controllers:
            assert not c.errors, c.errors

    def jobset(self) -> Obj:
        return self.api.list_kind("JobSet", NS)[0]

    def workload(self) -> Obj:
        (wl,) = self.api.list_kind("Workload", NS)
        return wl

    def condition(self, type_: str) -> tuple[str, str, str] | None:
        for c in (self.workload().get("status") or {}).get("conditions") or []:
            if c["type"] == type_:
                return c["status"], c["reason"], c["message"]
        return None

    async def pods_ready(self) -> None:
        """Every pod Running and Ready, as a kubelet would report it."""
        for pod in self.api.list_kind("Pod", NS):
            if not pod["metadata"].get("deletionTimestamp"):
                await self.api.patch_status(
                    "Pod",
                    NS,
                    pod["metadata"]["name"],
                    {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
                )


def queues(**edit: Any) -> list[Obj]:
    """examples/kueue.yaml's ResourceFlavor, ClusterQueue and LocalQueue; `edit` replaces the
    ClusterQueue's resourceGroups."""
    docs = list(yaml.safe_load_all((EXAMPLES / "kueue.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "ClusterQueue" and "resource_groups" in edit:
            doc["spec"]["resourceGroups"] = edit["resource_groups"]
    return docs


def flagship_jobset() -> Obj:
    """The JobSet the operator renders for examples/gspojob.yaml (2x8 + 4x2 GPUs)."""
    body = yaml.safe_load((EXAMPLES / "gspojob.yaml").read_text())
    body["metadata"].update(namespace=NS, uid="job-uid")
    objs = render.render_job(body, parse_spec(body["spec"]), token="t", policy=ClusterPolicy())
    js = copy.deepcopy(next(o for o in objs if o["kind"] == "JobSet"))
    del js["metadata"]["ownerReferences"]  # the GSPOJob is not in this store
    return js


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    server = ClusterApiServer(
        admission=[admit, admit_job, kueue.admit], extra_resources=kueue.RESOURCES
    )
    async with server:
        server.add(flagship_priority_class())
        yield Cluster(server)


async def start(cluster: Cluster, docs: list[Obj] | None = None) -> None:
    for doc in queues() if docs is None else docs:
        cluster.api.add(doc)
    await cluster.api.create(flagship_jobset())
    await cluster.settle()


def test_quantities_print_as_kueue_prints_them() -> None:
    assert [kueue.quantity_string("cpu", v) for v in (64000, 500, 192000)] == ["64", "500m", "192"]
    memory = [kueue.quantity_string("memory", v * 2**30) for v in (1000, 2800, 4096)]
    assert memory == ["1000Gi", "2800Gi", "4Ti"]
    assert kueue.quantity_string("nvidia.com/gpu", 16) == "16"


async def test_the_example_is_admitted_whole_and_started_on_its_flavor(cluster: Cluster) -> None:
    docs = queues()
    for doc in docs:
        cluster.api.add(doc)
    js = await cluster.api.create(flagship_jobset())
    assert js["spec"]["suspend"] is True  # the webhook: queued JobSets start suspended
    await cluster.settle()

    wl = cluster.workload()
    uid = cluster.jobset()["metadata"]["uid"]
    assert wl["metadata"]["name"] == kueue.workload_name(js["metadata"]["name"], uid)
    assert wl["metadata"]["labels"] == {kueue.JOB_UID_LABEL: uid}
    assert [(ps["name"], ps["count"]) for ps in wl["spec"]["podSets"]] == [
        ("learner", 2),
        ("rollout", 4),
    ]
    assert cluster.condition("QuotaReserved") == (
        "True",
        "QuotaReserved",
        "Quota reserved in ClusterQueue gpu-cluster-queue",
    )
    assert cluster.condition("Admitted") == ("True", "Admitted", "The workload is admitted")
    learner, rollout = wl["status"]["admission"]["podSetAssignments"]
    assert learner["flavors"] == {"cpu": "h100", "memory": "h100", "nvidia.com/gpu": "h100"}
    assert learner["resourceUsage"] == {"cpu": "128", "memory": "2000Gi", "nvidia.com/gpu": "16"}
    assert rollout["resourceUsage"]["nvidia.com/gpu"] == "8"

    started = cluster.jobset()
    assert started["spec"]["suspend"] is False
    pod = started["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert (
        "JobSet",
        js["metadata"]["name"],
        "Started",
        "Admitted by clusterQueue gpu-cluster-queue",
    ) in cluster.kueue.events
    assert len(cluster.api.list_kind("Pod", NS)) == 6


CPU_MEMORY = {"name": "cpu", "nominalQuota": 512}, {"name": "memory", "nominalQuota": "4Ti"}


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        (
            None,
            "couldn't assign flavors to pod set learner: resource nvidia.com/gpu unavailable "
            "in ClusterQueue",
        ),
        (
            8,
            "couldn't assign flavors to pod set learner: insufficient quota for nvidia.com/gpu "
            "in flavor h100, previously considered podsets requests (0) + current podset "
            "request (16) > maximum capacity (8)",
        ),
        (
            20,
            "couldn't assign flavors to pod set rollout: insufficient quota for nvidia.com/gpu "
            "in flavor h100, previously considered podsets requests (16) + current podset "
            "request (8) > maximum capacity (20)",
        ),
    ],
)
async def test_a_queue_short_of_gpus_leaves_the_job_pending_with_kueues_reason(
    cluster: Cluster, gpus: int | None, message: str
) -> None:
    covered, resources = ["cpu", "memory"], list(CPU_MEMORY)
    if gpus is not None:
        covered.append("nvidia.com/gpu")
        resources.append({"name": "nvidia.com/gpu", "nominalQuota": gpus})
    groups = [{"coveredResources": covered, "flavors": [{"name": "h100", "resources": resources}]}]
    await start(cluster, queues(resource_groups=groups))
    assert cluster.condition("QuotaReserved") == ("False", "Pending", message)
    assert cluster.condition("Admitted") is None
    assert cluster.jobset()["spec"]["suspend"] is True
    assert not cluster.api.list_kind("Pod", NS)


async def test_a_missing_local_queue_or_flavor_is_named(cluster: Cluster) -> None:
    docs = [d for d in queues() if d["kind"] != "LocalQueue"]
    await start(cluster, docs)
    assert cluster.condition("QuotaReserved") == (
        "False",
        "Inadmissible",
        "LocalQueue gpu-team doesn't exist",
    )
    cluster.api.add(next(d for d in queues() if d["kind"] == "LocalQueue"))
    cluster.api.add(
        {
            "apiVersion": kueue.QUEUES_API_VERSION,
            "kind": "ClusterQueue",
            "metadata": {"name": "other"},
            "spec": {},
        }
    )
    await cluster.settle()
    assert cluster.condition("Admitted") == ("True", "Admitted", "The workload is admitted")


async def test_kueue_unsuspends_an_admitted_jobset_that_someone_else_suspends(
    cluster: Cluster,
) -> None:
    """jobframework's step 7: a suspended job with an admitted Workload is started again."""
    await start(cluster)
    name = cluster.jobset()["metadata"]["name"]
    await cluster.api.patch("JobSet", NS, name, {"spec": {"suspend": True}})
    await cluster.settle(1)
    assert cluster.jobset()["spec"]["suspend"] is False
    started = [e for e in cluster.kueue.events if e[2] == "Started"]
    assert len(started) == 2


async def test_deactivating_the_workload_evicts_and_suspends_reactivating_requeues(
    cluster: Cluster,
) -> None:
    await start(cluster)
    wl = cluster.workload()["metadata"]["name"]
    await cluster.api.patch("Workload", NS, wl, {"spec": {"active": False}})
    await cluster.settle()
    assert cluster.condition("Evicted") == ("True", "Deactivated", "The workload is deactivated")
    assert cluster.jobset()["spec"]["suspend"] is True
    assert not [p for p in cluster.api.list_kind("Pod", NS)]
    assert cluster.condition("QuotaReserved") == ("False", "Pending", "The workload is deactivated")
    assert cluster.condition("Requeued") == ("False", "Deactivated", "The workload is deactivated")
    assert cluster.condition("Admitted") == (
        "False",
        "NoReservation",
        "The workload has no reservation",
    )
    pod = cluster.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod  # the flavor's labels are taken off again

    await cluster.api.patch("Workload", NS, wl, {"spec": {"active": True}})
    await cluster.settle()
    assert cluster.condition("Requeued") == ("True", "Reactivated", "The workload was reactivated")
    assert cluster.condition("Evicted") == (
        "False",
        "QuotaReserved",
        "Previously: The workload is deactivated",
    )
    assert cluster.condition("Admitted")[0] == "True"  # type: ignore[index]
    assert cluster.jobset()["spec"]["suspend"] is False


async def test_wait_for_pods_ready_evicts_after_the_timeout_and_requeues_after_backoff(
    cluster: Cluster,
) -> None:
    cluster.kueue.wait_for_pods_ready = kueue.WaitForPodsReady()  # Kueue's defaults: 5 min
    await start(cluster)
    wl = cluster.workload()["metadata"]["name"]
    assert cluster.condition("PodsReady") == ("False", "WaitForStart", kueue.NOT_READY)
    cluster.clock.advance(299)
    await cluster.settle()
    assert cluster.condition("Evicted") is None
    cluster.clock.advance(2)
    await cluster.settle()
    assert cluster.condition("Evicted") == (
        "True",
        "PodsReadyTimeout",
        f"Exceeded the PodsReady timeout {NS}/{wl}",
    )
    assert cluster.jobset()["spec"]["suspend"] is True
    assert cluster.condition("Requeued")[:2] == ("False", "PodsReadyTimeout")  # type: ignore[index]
    state = cluster.workload()["status"]["requeueState"]
    assert state["count"] == 1
    assert state["requeueAt"] == kueue.stamp(cluster.clock.now + timedelta(seconds=60))
    cluster.clock.advance(30)
    await cluster.settle()
    assert cluster.condition("QuotaReserved")[0] == "False"  # type: ignore[index]
    cluster.clock.advance(31)
    await cluster.settle()
    assert cluster.condition("Requeued") == (
        "True",
        "BackoffFinished",
        "The workload backoff was finished",
    )
    assert cluster.condition("Admitted")[0] == "True"  # type: ignore[index]
    assert cluster.jobset()["spec"]["suspend"] is False

    # Ready in time: PodsReady turns True and nothing is evicted.
    await cluster.pods_ready()
    await cluster.settle()
    assert cluster.condition("PodsReady") == ("True", "Started", kueue.READY)
    cluster.clock.advance(3600)
    await cluster.settle()
    assert cluster.condition("Evicted")[0] == "False"  # type: ignore[index]


async def test_past_the_requeue_limit_the_workload_is_deactivated(cluster: Cluster) -> None:
    cluster.kueue.wait_for_pods_ready = kueue.WaitForPodsReady(backoff_limit_count=0)
    await start(cluster)
    cluster.clock.advance(301)
    await cluster.settle()
    assert not kueue.is_active(cluster.workload())
    assert cluster.condition("Evicted") == (
        "True",
        "DeactivatedDueToRequeuingLimitExceeded",
        "The workload is deactivated due to exceeding the maximum number of re-queuing retries",
    )
    assert cluster.jobset()["spec"]["suspend"] is True
