"""A stand-in for Kueue (kueue.x-k8s.io v1beta2 and v1beta1) in front of JobSets, for the local
cluster.

A queued GSPOJob's JobSet carries `kueue.x-k8s.io/queue-name`; on a real cluster Kueue then owns
its `spec.suspend`. This module does what Kueue v0.13 does to such a JobSet, so the operator
meets Kueue's behaviour rather than its own idea of it. Written from kubernetes-sigs/kueue
v0.13.10 (not from the gspo operator): pkg/controller/jobframework/reconciler.go
(ReconcileGenericJob, startJob, stopJob, handleJobWithNoWorkload, generatePodsReadyCondition),
pkg/controller/jobframework/defaults.go (ApplyDefaultForSuspend), workload_names.go
(GetWorkloadNameForOwnerWithGVK), interface.go (NewWorkload), pkg/controller/jobs/jobset/
jobset_controller.go (PodSets, PodsReady, IsActive, RunWithPodSetsInfo), pkg/controller/core/
workload_controller.go (Reconcile, reconcileNotReadyTimeout, triggerDeactivationOrBackoffRequeue,
admittedNotReadyWorkload), pkg/workload/workload.go and admissionchecks.go (SetQuotaReservation,
UnsetQuotaReservationWithCondition, SyncAdmittedCondition, SetRequeuedCondition, Evict,
UpdateRequeueState), pkg/scheduler/scheduler.go (nominate, admit, requeueAndUpdate),
pkg/scheduler/flavorassigner/flavorassigner.go (assignFlavors, findFlavorForPodSetResource,
fitsResourceQuota, Assignment.Message), pkg/queue/cluster_queue.go (backoffWaitingTimeExpired),
apis/config/v1beta1/defaults.go (WaitForPodsReady defaults) and
apis/kueue/v1beta1/workload_types.go (condition types and reasons).

Implemented (a level-triggered loop, each pass: JobSets, then Workloads, then the scheduler):
- `admit`, the JobSet webhook's Default: a JobSet with the queue-name label is created with
  `spec.suspend: true`.
- The JobSet reconciler, for a top-level JobSet with the queue-name label: a Workload
  `jobset-<name>-<sha1 hex[:5]>` (sha1 of "JobSet\\njobset.x-k8s.io\\n<name>\\n<uid>"), owned by
  the JobSet, label `kueue.x-k8s.io/job-uid`, spec.queueName, spec.active true, one pod set per
  replicated Job (count = replicas x min(parallelism, completions), the Job's pod template),
  created once the JobSet has no active Job; a finished JobSet finishes its Workload (Finished,
  Succeeded/Failed, the JobSet's message); with WaitForPodsReady the PodsReady condition
  (Started / WaitForStart / WaitForRecovery / Recovered with Kueue's messages; a JobSet is
  ready when the ready + succeeded Jobs of every replicated Job add up to its replicas); an
  Evicted Workload stops the JobSet (suspend, the pod templates restored) and, once no Job is
  active, loses its reservation (QuotaReserved=False reason Pending with the eviction's
  message, Admitted=False NoReservation, Requeued=False with the eviction's reason; True only
  for Preempted / NodeFailures); a suspended JobSet whose Workload is admitted is started
  (suspend false, the flavors' nodeLabels merged into the pod templates' nodeSelector, Event
  Started "Admitted by clusterQueue <cq>"); a running JobSet whose Workload is not admitted is
  suspended (Event Stopped "Not admitted by cluster queue"). This is the loop a controller
  that suspends an admitted JobSet itself runs into.
- The Workload controller: `spec.active: false` evicts the Workload (Evicted=True reason
  Deactivated, "The workload is deactivated", or DeactivatedDueTo<reason> "... due to <msg>"
  after a DeactivationTarget) and clears requeueState; reactivating sets Requeued=True
  (Reactivated, "The workload was reactivated"); a PodsReadyTimeout eviction waits for
  requeueState.requeueAt, then Requeued=True (BackoffFinished); a Workload whose LocalQueue
  or ClusterQueue is missing gets QuotaReserved=False reason Inadmissible ("LocalQueue <lq>
  doesn't exist", "ClusterQueue <cq> doesn't exist"). WaitForPodsReady: an admitted Workload
  whose PodsReady is not True (reason WaitForStart) `timeout` after it was Admitted is
  evicted (reason PodsReadyTimeout, "Exceeded the PodsReady timeout <ns>/<name>") with
  requeueState.count + 1 and requeueAt = now + base x 2^(count-1) capped at the maximum
  (jitter left out), or, past requeuingBackoffLimitCount, deactivated (DeactivationTarget
  RequeuingLimitExceeded, "exceeding the maximum number of re-queuing retries").
- The scheduler: Workloads that are active, unreserved, unfinished, not Requeued=False and
  past their requeueAt, by priority then creation time (BestEffortFIFO). A ClusterQueue is
  inactive while a flavor it names has no ResourceFlavor ("ClusterQueue <cq> is inactive");
  its namespaceSelector ({} every namespace, matchLabels; absent: none) must match ("Workload
  namespace doesn't match ClusterQueue selector"). Flavors per pod set and resource group, in
  the group's order: the flavor's nodeLabels against the pod set's nodeSelector on the group's
  label keys ("flavor <f> doesn't match node affinity"), then each covered resource against
  the flavor's nominalQuota minus what admitted Workloads use ("insufficient quota for <r> in
  flavor <f>, previously considered podsets requests (<a>) + current podset request (<b>) >
  maximum capacity (<c>)", or "insufficient unused quota for <r> in flavor <f>, <n> more
  needed"); a resource no group covers: "resource <r> unavailable in ClusterQueue". Requests
  are the pod's (limits where a request is missing; init containers by their maximum) x the
  pod set's count, cpu counted in millicores; `pods` when the queue covers it. Not fitting:
  QuotaReserved=False reason Pending, message "couldn't assign flavors to pod set <ps>:
  <reasons, sorted, joined by ', '>". Fitting: status.admission (clusterQueue,
  podSetAssignments with flavors, resourceUsage and count), QuotaReserved=True ("Quota reserved
  in ClusterQueue <cq>"), a previous Evicted condition set False ("Previously: ..."), and
  Admitted=True ("The workload is admitted").

Not modelled: cohorts, borrowing and lending limits, preemption, fair sharing, admission checks,
topology-aware scheduling, partial admission, workload slices, MultiKueue, priority classes
(every Workload has priority 0), StrictFIFO, WaitForPodsReady's blockAdmission and
recoveryTimeout, LocalQueue/ClusterQueue stop policies and status, manageJobsWithoutQueueName,
the Workload finalizer, Kueue's own child-Job handling (the JobSet's Jobs inherit its suspend),
the webhooks' validation, flavor taints and tolerations, resources that Kueue's resource
transformations or excluded prefixes would change, and iterating resources in Go's random map
order (sorted here, so messages are stable). Events are kept in `events` (not posted).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from job_controller import condition_true, find_condition
from kubernetes.utils import parse_quantity
from reconciler import Reconciler

if TYPE_CHECKING:
    from apiserver import ClusterApiServer

Obj = dict[str, Any]
log = logging.getLogger(__name__)

GROUP = "kueue.x-k8s.io"
# Kueue's versions (config/components/crd/bases at each tag): v0.13 and v0.14 serve v1beta1
# alone, v0.15 adds v1beta2, v0.16 to v0.19 store v1beta2 and still serve v1beta1 (deprecated,
# with a warning). The stand-in serves the queue kinds as v1beta2 (what examples/kueue.yaml
# writes) and Workloads as v1beta1 (what the operator reads, on every release from v0.13);
# it does not serve the other version of each, nor convert between them.
API_VERSION = f"{GROUP}/v1beta1"  # Workloads
QUEUES_API_VERSION = f"{GROUP}/v1beta2"  # LocalQueue, ClusterQueue, ResourceFlavor
QUEUE_LABEL = f"{GROUP}/queue-name"
JOB_UID_LABEL = f"{GROUP}/job-uid"
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
# (group, version, plural, kind, namespaced, status subresource, short names) as the API
# stand-in lists the kinds it serves (apiserver.CLUSTER_RESOURCES).
RESOURCES = [
    (GROUP, "v1beta1", "workloads", "Workload", True, True, ["wl"]),
    (GROUP, "v1beta2", "localqueues", "LocalQueue", True, True, ["queue", "queues", "lq"]),
    (GROUP, "v1beta2", "clusterqueues", "ClusterQueue", False, True, ["cq"]),
    (GROUP, "v1beta2", "resourceflavors", "ResourceFlavor", False, False, ["flavor", "rf"]),
]
NOT_READY = "Not all pods are ready or succeeded"
WAITING_FOR_RECOVERY = "At least one pod has failed, waiting for recovery"
READY = "All pods reached readiness and the workload is running"


@dataclass(frozen=True)
class WaitForPodsReady:
    """Kueue's `waitForPodsReady` configuration (off unless given; these are its defaults)."""

    timeout_s: float = 300.0
    backoff_base_s: int = 60
    backoff_max_s: int = 3600
    backoff_limit_count: int | None = None  # None: requeue without end


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class ManualClock:
    """A clock a test moves by hand (Kueue takes a clock.Clock for the same reason)."""

    now: dt.datetime = field(default_factory=_utc_now)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


# --- the webhook ------------------------------------------------------------------------------


def admit(obj: Obj) -> str | None:
    """ApplyDefaultForSuspend as an admission hook: a queued JobSet is created suspended."""
    if obj.get("kind") == "JobSet" and (obj["metadata"].get("labels") or {}).get(QUEUE_LABEL):
        obj.setdefault("spec", {})["suspend"] = True
    return None


# --- names, pod sets, quantities --------------------------------------------------------------


def workload_name(jobset: str, uid: str) -> str:
    """GetWorkloadNameForOwnerWithGVK for a JobSet."""
    digest = hashlib.sha1(f"JobSet\njobset.x-k8s.io\n{jobset}\n{uid}".encode()).hexdigest()
    return f"jobset-{jobset}"[:247] + "-" + digest[:5]


def pod_sets(js: Obj) -> list[Obj]:
    """JobSet.PodSets: one per replicated Job, count = replicas x pods per Job."""
    out = []
    for rjob in js["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        per_job = job_spec.get("parallelism", 1)
        if job_spec.get("completions") is not None:
            per_job = min(per_job, job_spec["completions"])
        out.append(
            {
                "name": rjob["name"],
                "count": rjob.get("replicas", 1) * per_job,
                "template": copy.deepcopy(job_spec["template"]),
            }
        )
    return out


def _amount(resource: str, value: Any) -> int:
    """resources.ResourceValue: cpu in millicores, everything else in units (rounded up)."""
    quantity = parse_quantity(value)
    return math.ceil(quantity * 1000) if resource == "cpu" else math.ceil(quantity)


def quantity_string(resource: str, value: int) -> str:
    """resources.ResourceQuantityString: how Kueue prints an amount in its messages."""
    if resource == "cpu":
        return str(value // 1000) if value % 1000 == 0 else f"{value}m"
    binary = resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-")
    base, suffixes = (1024, "KiMiGiTiPiEi") if binary else (1000, "kMGTPE")
    step = 2 if binary else 1
    suffix, unit = "", 1
    for i in range(len(suffixes) // step):
        if value and value % (unit * base) == 0:
            unit *= base
            suffix = suffixes[i * step : (i + 1) * step]
        else:
            break
    return f"{value // unit}{suffix}"


def pod_requests(template: Obj) -> dict[str, int]:
    """One pod's requests (PodRequests with limits as missing requests): the containers'
    sum, or an init container's if larger, plus the pod's overhead."""
    spec = template.get("spec") or {}

    def of(container: Obj) -> dict[str, int]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {name: _amount(name, v) for name, v in merged.items()}

    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, v in of(container).items():
            total[name] = total.get(name, 0) + v
    for container in spec.get("initContainers") or []:
        for name, v in of(container).items():
            total[name] = max(total.get(name, 0), v)
    for name, v in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + _amount(name, v)
    return {name: v for name, v in total.items() if v}


# --- conditions -------------------------------------------------------------------------------


def set_condition(
    status: Obj, type_: str, state: bool, reason: str, message: str, now: str, generation: int
) -> bool:
    """apimeta.SetStatusCondition: the transition time changes only when the status does."""
    conditions = status.setdefault("conditions", [])
    value = "True" if state else "False"
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now,
    }
    cond = find_condition(conditions, type_)
    if cond is None:
        conditions.append(new)
        return True
    before = dict(cond)
    if cond["status"] != value:
        cond.update(new)
    else:
        cond.update(reason=reason, message=message, observedGeneration=generation)
    return cond != before


def condition_of(obj: Obj, type_: str) -> Obj | None:
    return find_condition((obj.get("status") or {}).get("conditions") or [], type_)


def is_true(obj: Obj, type_: str) -> bool:
    return condition_true((obj.get("status") or {}).get("conditions") or [], type_)


def _false(obj: Obj, type_: str) -> bool:
    cond = condition_of(obj, type_)
    return cond is not None and cond.get("status") == "False"


def is_active(wl: Obj) -> bool:
    """workload.IsActive: spec.active, true when unset."""
    return (wl.get("spec") or {}).get("active", True) is not False


def _jobset_active(js: Obj) -> bool:
    """JobSet.IsActive: a replicated Job with an active Job."""
    return any(
        s.get("active", 0) > 0 for s in (js.get("status") or {}).get("replicatedJobsStatus") or []
    )


def _jobset_pods_ready(js: Obj) -> bool:
    """JobSet.PodsReady: ready + succeeded Jobs add up to every replicated Job's replicas."""
    replicas = sum(r.get("replicas", 1) for r in js["spec"]["replicatedJobs"])
    statuses = (js.get("status") or {}).get("replicatedJobsStatus") or []
    return replicas == sum(s.get("ready", 0) + s.get("succeeded", 0) for s in statuses)


def _jobset_finished(js: Obj) -> tuple[str, bool] | None:
    """JobSet.Finished: (message, success) once Completed or Failed is True."""
    for type_, success in (("Completed", True), ("Failed", False)):
        cond = condition_of(js, type_)
        if cond is not None and cond.get("status") == "True":
            return cond.get("message", ""), success
    return None


# --- the controller ---------------------------------------------------------------------------


@dataclass
class _Fit:
    flavors: dict[str, str]  # resource -> flavor
    usage: dict[str, int]


class KueueController(Reconciler):
    """Kueue's JobSet reconciler, Workload controller and scheduler (see the module doc)."""

    def __init__(
        self,
        api: ClusterApiServer,
        *,
        wait_for_pods_ready: WaitForPodsReady | None = None,
        clock: Callable[[], dt.datetime] = _utc_now,
        period_s: float = 0.1,
    ) -> None:
        super().__init__(api, period_s)
        self.wait_for_pods_ready = wait_for_pods_ready
        self.clock = clock
        self.events: list[tuple[str, str, str, str]] = []  # (kind, name, reason, message)
        self.passes = 0  # completed passes, for tests that wait for a number of them

    def event(self, obj: Obj, reason: str, message: str) -> None:
        self.events.append((obj["kind"], obj["metadata"]["name"], reason, message))

    def _now(self) -> str:
        return stamp(self.clock())

    async def sync_all(self) -> None:
        await self.sync_each("JobSet", self.sync_jobset)
        await self.sync_each("Workload", self.sync_workload)
        await self.schedule()
        self.passes += 1

    # --- the JobSet reconciler (jobframework.ReconcileGenericJob) -----------------------------

    def workload_of(self, js: Obj) -> Obj | None:
        uid = js["metadata"]["uid"]
        return next(
            (
                w
                for w in self.api.list_kind("Workload", js["metadata"]["namespace"])
                if (w["metadata"].get("labels") or {}).get(JOB_UID_LABEL) == uid
            ),
            None,
        )

    async def sync_jobset(self, js: Obj) -> None:
        meta = js["metadata"]
        if meta.get("deletionTimestamp") or not (meta.get("labels") or {}).get(QUEUE_LABEL):
            return
        wl = self.workload_of(js)
        if wl is not None and is_true(wl, "Finished"):
            return
        finished = _jobset_finished(js)
        if finished is not None:
            if wl is not None:
                message, success = finished
                reason = "Succeeded" if success else "Failed"
                await self._set(wl, "Finished", True, reason, message)
            return
        if wl is None:
            if not _jobset_active(js):
                await self._create_workload(js)
            return
        if self.wait_for_pods_ready is not None:
            state, reason, message = self._pods_ready_condition(js, wl)
            have = condition_of(wl, "PodsReady")
            if have is None or (have["status"], have["reason"]) != (state, reason):
                await self._set(wl, "PodsReady", state == "True", reason, message)
                return
        evicted = condition_of(wl, "Evicted")
        if evicted is not None and evicted["status"] == "True":
            await self._stop(js, wl, evicted["message"])
            if is_true(wl, "QuotaReserved") and not _jobset_active(js):
                requeued = evicted["reason"] in ("Preempted", "NodeFailures")
                await self._unreserve(
                    wl,
                    "Pending",
                    evicted["message"],
                    (requeued, evicted["reason"], evicted["message"]),
                )
            return
        if js["spec"].get("suspend"):
            if is_true(wl, "Admitted"):
                await self._start(js, wl)
            return
        if not is_true(wl, "Admitted"):
            await self._stop(js, wl, "Not admitted by cluster queue")

    def _pods_ready_condition(self, js: Obj, wl: Obj) -> tuple[str, str, str]:
        """generatePodsReadyCondition: (status, reason, message)."""
        if not is_true(wl, "Admitted"):
            return "False", "WaitForStart", NOT_READY
        have = condition_of(wl, "PodsReady")
        if _jobset_pods_ready(js):
            recovering = have is not None and have["reason"] in ("WaitForRecovery", "Recovered")
            return "True", "Recovered" if recovering else "Started", READY
        if have is not None and (have["status"] == "True" or have["reason"] == "WaitForRecovery"):
            return "False", "WaitForRecovery", WAITING_FOR_RECOVERY
        return "False", "WaitForStart", NOT_READY

    async def _create_workload(self, js: Obj) -> None:
        meta = js["metadata"]
        wl = {
            "apiVersion": API_VERSION,
            "kind": "Workload",
            "metadata": {
                "name": workload_name(meta["name"], meta["uid"]),
                "namespace": meta["namespace"],
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": JOBSET_API_VERSION,
                        "kind": "JobSet",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "queueName": meta["labels"][QUEUE_LABEL],
                "podSets": pod_sets(js),
                "active": True,
                "priority": 0,
            },
        }
        created = await self.api.create(wl)
        self.event(
            js,
            "CreatedWorkload",
            f"Created Workload: {meta['namespace']}/{created['metadata']['name']}",
        )

    async def _start(self, js: Obj, wl: Obj) -> None:
        """startJob: unsuspend, with each assigned flavor's nodeLabels in the pod templates."""
        assignments = {a["name"]: a for a in wl["status"]["admission"]["podSetAssignments"]}
        jobs = copy.deepcopy(js["spec"]["replicatedJobs"])
        for rjob in jobs:
            labels: dict[str, str] = {}
            for flavor in sorted(
                set((assignments.get(rjob["name"]) or {}).get("flavors", {}).values())
            ):
                rf = self.api.get("ResourceFlavor", "", flavor) or {}
                labels.update((rf.get("spec") or {}).get("nodeLabels") or {})
            if labels:
                pod = rjob["template"]["spec"]["template"].setdefault("spec", {})
                pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **labels}
        meta = js["metadata"]
        await self.api.patch(
            "JobSet",
            meta["namespace"],
            meta["name"],
            {"spec": {"suspend": False, "replicatedJobs": jobs}},
        )
        cq = wl["status"]["admission"]["clusterQueue"]
        self.event(js, "Started", f"Admitted by clusterQueue {cq}")

    async def _stop(self, js: Obj, wl: Obj, message: str) -> None:
        """stopJob: suspend, the pod templates restored from the Workload's pod sets."""
        if js["spec"].get("suspend"):
            return
        original = {ps["name"]: ps["template"] for ps in wl["spec"]["podSets"]}
        jobs = copy.deepcopy(js["spec"]["replicatedJobs"])
        for rjob in jobs:
            if rjob["name"] in original:
                pod = rjob["template"]["spec"]["template"].setdefault("spec", {})
                selector = (original[rjob["name"]].get("spec") or {}).get("nodeSelector")
                pod.pop("nodeSelector", None)
                if selector:
                    pod["nodeSelector"] = selector
        meta = js["metadata"]
        await self.api.patch(
            "JobSet",
            meta["namespace"],
            meta["name"],
            {"spec": {"suspend": True, "replicatedJobs": jobs}},
        )
        self.event(js, "Stopped", message)

    # --- the Workload controller --------------------------------------------------------------

    async def sync_workload(self, wl: Obj) -> None:
        if is_true(wl, "Finished"):
            return
        now = self.clock()
        if is_active(wl):
            if is_true(wl, "DeactivationTarget"):
                meta = wl["metadata"]
                await self.api.patch(
                    "Workload", meta["namespace"], meta["name"], {"spec": {"active": False}}
                )
                return
            requeued = condition_of(wl, "Requeued")
            if requeued is not None and requeued["status"] == "False":
                if requeued["reason"] == "Deactivated":
                    await self._set(
                        wl, "Requeued", True, "Reactivated", "The workload was reactivated"
                    )
                    return
                if requeued["reason"] in ("PodsReadyTimeout", "AdmissionCheck"):
                    state = (wl.get("status") or {}).get("requeueState") or {}
                    at = state.get("requeueAt")
                    if at and _parse(at) > now:
                        return
                    status = copy.deepcopy(wl["status"])
                    status["requeueState"] = {k: v for k, v in state.items() if k != "requeueAt"}
                    set_condition(
                        status,
                        "Requeued",
                        True,
                        "BackoffFinished",
                        "The workload backoff was finished",
                        self._now(),
                        _gen(wl),
                    )
                    await self._write(wl, status)
                    return
        else:
            status = copy.deepcopy(wl.get("status") or {})
            changed = False
            if not is_true(wl, "Evicted"):
                reason, message = "Deactivated", "The workload is deactivated"
                target = condition_of(wl, "DeactivationTarget")
                if target is not None:
                    reason += f"DueTo{target['reason']}"
                    message += f" due to {target['message']}"
                set_condition(status, "Evicted", True, reason, message, self._now(), _gen(wl))
                self.event(wl, f"EvictedDueTo{reason}", message)
                changed = True
            conditions = status.get("conditions") or []
            if find_condition(conditions, "DeactivationTarget") is not None:
                status["conditions"] = [c for c in conditions if c["type"] != "DeactivationTarget"]
                changed = True
            if status.get("requeueState") is not None:
                status["requeueState"] = None
                changed = True
            if changed:
                await self._write(wl, status)
            return
        if not is_true(wl, "QuotaReserved"):
            await self._inadmissible(wl)
            return
        await self._pods_ready_timeout(wl, now)

    async def _inadmissible(self, wl: Obj) -> None:
        meta = wl["metadata"]
        lq_name = wl["spec"]["queueName"]
        lq = self.api.get("LocalQueue", meta["namespace"], lq_name)
        if lq is None:
            message = f"LocalQueue {lq_name} doesn't exist"
        elif self.api.get("ClusterQueue", "", cq := lq["spec"]["clusterQueue"]) is None:
            message = f"ClusterQueue {cq} doesn't exist"
        else:
            return
        await self._unreserve(wl, "Inadmissible", message)

    async def _pods_ready_timeout(self, wl: Obj, now: dt.datetime) -> None:
        """reconcileNotReadyTimeout: evict (and requeue with backoff) an admitted Workload
        whose pods were not all ready within the timeout."""
        config = self.wait_for_pods_ready
        if config is None or is_true(wl, "Evicted") or not is_true(wl, "Admitted"):
            return
        ready = condition_of(wl, "PodsReady")
        if ready is not None and (
            ready["status"] == "True" or ready["reason"] not in ("WaitForStart", "PodsReady")
        ):
            return  # ready, or waiting for recovery (recoveryTimeout is not modelled)
        admitted = _parse(condition_of(wl, "Admitted")["lastTransitionTime"])  # type: ignore[index]
        if (now - admitted).total_seconds() < config.timeout_s:
            return
        status = copy.deepcopy(wl["status"])
        state = dict(status.get("requeueState") or {})
        count = state.get("count", 0) + 1
        if config.backoff_limit_count is not None and count > config.backoff_limit_count:
            status["conditions"].append(
                {
                    "type": "DeactivationTarget",
                    "status": "True",
                    "reason": "RequeuingLimitExceeded",
                    "message": "exceeding the maximum number of re-queuing retries",
                    "observedGeneration": _gen(wl),
                    "lastTransitionTime": self._now(),
                }
            )
            await self._write(wl, status)
            return
        wait_s = min(config.backoff_base_s * 2 ** (count - 1), config.backoff_max_s)
        status["requeueState"] = {
            "count": count,
            "requeueAt": stamp(now + dt.timedelta(seconds=wait_s)),
        }
        meta = wl["metadata"]
        message = f"Exceeded the PodsReady timeout {meta['namespace']}/{meta['name']}"
        set_condition(status, "Evicted", True, "PodsReadyTimeout", message, self._now(), _gen(wl))
        self.event(wl, "EvictedDueToPodsReadyTimeout", message)
        await self._write(wl, status)

    # --- the scheduler ------------------------------------------------------------------------

    def _pending(self) -> list[Obj]:
        now = self.clock()
        out = []
        for wl in self.api.list_kind("Workload"):
            if not is_active(wl) or is_true(wl, "QuotaReserved") or is_true(wl, "Finished"):
                continue
            if _false(wl, "Requeued"):
                continue
            at = ((wl.get("status") or {}).get("requeueState") or {}).get("requeueAt")
            if at and _parse(at) > now:
                continue
            out.append(wl)
        return sorted(
            out,
            key=lambda w: (-(w["spec"].get("priority") or 0), w["metadata"]["creationTimestamp"]),
        )

    def _usage(self, cq: str) -> dict[tuple[str, str], int]:
        """(flavor, resource) -> amount reserved by the Workloads admitted to `cq`."""
        used: dict[tuple[str, str], int] = {}
        for wl in self.api.list_kind("Workload"):
            admission = (wl.get("status") or {}).get("admission")
            if not is_true(wl, "QuotaReserved") or not admission or admission["clusterQueue"] != cq:
                continue
            for psa in admission["podSetAssignments"]:
                for res, flavor in psa["flavors"].items():
                    amount = _amount(res, psa["resourceUsage"][res])
                    used[(flavor, res)] = used.get((flavor, res), 0) + amount
        return used

    async def schedule(self) -> None:
        for wl in self._pending():
            meta = wl["metadata"]
            lq = self.api.get("LocalQueue", meta["namespace"], wl["spec"]["queueName"])
            if lq is None:
                continue  # not in any queue: the Workload controller says so
            cq_name = lq["spec"]["clusterQueue"]
            cq = self.api.get("ClusterQueue", "", cq_name)
            if cq is None:
                continue
            message = self._nominate(wl, cq)
            if message is not None:
                await self._unreserve(wl, "Pending", message)
                self.event(wl, "Pending", message)
                continue
            assignments, failed = self.assign_flavors(wl, cq)
            if failed:
                await self._unreserve(wl, "Pending", failed)
                self.event(wl, "Pending", failed)
                continue
            await self._admit(wl, cq_name, assignments)

    def _nominate(self, wl: Obj, cq: Obj) -> str | None:
        """Why the ClusterQueue cannot consider the Workload at all, if it cannot."""
        flavors = {
            f["name"] for group in cq["spec"].get("resourceGroups") or [] for f in group["flavors"]
        }
        if any(self.api.get("ResourceFlavor", "", f) is None for f in flavors):
            return f"ClusterQueue {cq['metadata']['name']} is inactive"
        selector = cq["spec"].get("namespaceSelector")
        ns = self.api.get("Namespace", "", wl["metadata"]["namespace"]) or {}
        labels = ns.get("metadata", {}).get("labels") or {}
        wanted = (selector or {}).get("matchLabels") or {}
        if selector is None or any(labels.get(k) != v for k, v in wanted.items()):
            return "Workload namespace doesn't match ClusterQueue selector"
        return None

    def assign_flavors(self, wl: Obj, cq: Obj) -> tuple[list[Obj], str]:
        """FlavorAssigner.Assign without preemption or borrowing: the pod set assignments, or
        the message of the first pod set that does not fit."""
        groups = cq["spec"].get("resourceGroups") or []
        used = self._usage(cq["metadata"]["name"])
        taken: dict[tuple[str, str], int] = {}  # by this Workload's earlier pod sets
        out = []
        for ps in wl["spec"]["podSets"]:
            per_pod = pod_requests(ps["template"])
            requests = {r: v * ps["count"] for r, v in per_pod.items()}
            if any("pods" in g["coveredResources"] for g in groups):
                requests["pods"] = ps["count"]
            flavors: dict[str, str] = {}
            reasons: list[str] = []
            for res in sorted(requests):
                if res in flavors:
                    continue
                group = next((g for g in groups if res in g["coveredResources"]), None)
                if group is None:
                    reasons = [f"resource {res} unavailable in ClusterQueue"]
                    break
                fit = self._find_flavor(ps, group, requests, used, taken, reasons)
                if fit is None:
                    break
                flavors.update(fit.flavors)
            if len(flavors) < len(requests):
                message = ", ".join(sorted(reasons))
                return [], f"couldn't assign flavors to pod set {ps['name']}: {message}"
            for res, flavor in flavors.items():
                taken[(flavor, res)] = taken.get((flavor, res), 0) + requests[res]
            out.append(
                {
                    "name": ps["name"],
                    "flavors": flavors,
                    "count": ps["count"],
                    "resourceUsage": {r: quantity_string(r, v) for r, v in requests.items()},
                }
            )
        return out, ""

    def _find_flavor(
        self,
        ps: Obj,
        group: Obj,
        requests: dict[str, int],
        used: dict[tuple[str, str], int],
        taken: dict[tuple[str, str], int],
        reasons: list[str],
    ) -> _Fit | None:
        """findFlavorForPodSetResource: the first flavor of the group that fits every resource
        it covers; the reasons why the others do not."""
        covered = [r for r in sorted(requests) if r in group["coveredResources"]]
        label_keys = {
            k
            for f in group["flavors"]
            for k in (
                (self.api.get("ResourceFlavor", "", f["name"]) or {})
                .get("spec", {})
                .get("nodeLabels")
                or {}
            )
        }
        selector = (ps["template"].get("spec") or {}).get("nodeSelector") or {}
        for flavor in group["flavors"]:
            name = flavor["name"]
            labels = (self.api.get("ResourceFlavor", "", name) or {}).get("spec", {}).get(
                "nodeLabels"
            ) or {}
            if any(k in label_keys and labels.get(k) != v for k, v in selector.items()):
                reasons.append(f"flavor {name} doesn't match node affinity")
                continue
            quotas = {r["name"]: _amount(r["name"], r["nominalQuota"]) for r in flavor["resources"]}
            fits = True
            for res in covered:
                nominal = quotas.get(res, 0)
                before = taken.get((name, res), 0)
                want = before + requests[res]
                if want > nominal:
                    reasons.append(
                        f"insufficient quota for {res} in flavor {name}, previously considered "
                        f"podsets requests ({quantity_string(res, before)}) + current podset "
                        f"request ({quantity_string(res, requests[res])}) > maximum capacity "
                        f"({quantity_string(res, nominal)})"
                    )
                    fits = False
                    break
                available = nominal - used.get((name, res), 0)
                if want > available:
                    reasons.append(
                        f"insufficient unused quota for {res} in flavor {name}, "
                        f"{quantity_string(res, want - available)} more needed"
                    )
                    fits = False
            if fits:
                return _Fit({r: name for r in covered}, {r: requests[r] for r in covered})
        return None

    async def _admit(self, wl: Obj, cq: str, assignments: list[Obj]) -> None:
        """SetQuotaReservation and SyncAdmittedCondition (no admission checks)."""
        now, gen = self._now(), _gen(wl)
        status = copy.deepcopy(wl.get("status") or {})
        status["admission"] = {"clusterQueue": cq, "podSetAssignments": assignments}
        set_condition(
            status,
            "QuotaReserved",
            True,
            "QuotaReserved",
            f"Quota reserved in ClusterQueue {cq}",
            now,
            gen,
        )
        for type_ in ("Evicted", "Preempted"):
            cond = find_condition(status["conditions"], type_)
            if cond is not None:
                message = cond["message"]
                if not message.startswith("Previously: "):
                    message = "Previously: " + message
                cond.update(
                    status="False", reason="QuotaReserved", message=message, lastTransitionTime=now
                )
        set_condition(status, "Admitted", True, "Admitted", "The workload is admitted", now, gen)
        await self._write(wl, status)
        self.event(wl, "QuotaReserved", f"Quota reserved in ClusterQueue {cq}")
        self.event(wl, "Admitted", f"Admitted by ClusterQueue {cq}")

    async def _unreserve(
        self, wl: Obj, reason: str, message: str, requeued: tuple[bool, str, str] | None = None
    ) -> None:
        """UnsetQuotaReservationWithCondition (and SetRequeuedCondition when given)."""
        now, gen = self._now(), _gen(wl)
        status = copy.deepcopy(wl.get("status") or {})
        changed = set_condition(status, "QuotaReserved", False, reason, message, now, gen)
        if status.get("admission") is not None:
            status["admission"] = None
            changed = True
        if is_true(wl, "Admitted"):
            set_condition(
                status,
                "Admitted",
                False,
                "NoReservation",
                "The workload has no reservation",
                now,
                gen,
            )
            changed = True
        if requeued is not None:
            changed = set_condition(status, "Requeued", *requeued, now, gen) or changed
        if changed:
            await self._write(wl, status)

    async def _set(self, wl: Obj, type_: str, state: bool, reason: str, message: str) -> None:
        status = copy.deepcopy(wl.get("status") or {})
        if set_condition(status, type_, state, reason, message, self._now(), _gen(wl)):
            await self._write(wl, status)

    async def _write(self, wl: Obj, status: Obj) -> None:
        meta = wl["metadata"]
        # A merge patch: keys set to None are removed (admission, requeueState).
        await self.api.patch_status("Workload", meta["namespace"], meta["name"], status)


def _gen(obj: Obj) -> int:
    return int(obj["metadata"].get("generation") or 1)
