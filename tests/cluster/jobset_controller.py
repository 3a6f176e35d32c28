"""A stand-in for JobSet's controller (jobset.x-k8s.io/v1alpha2) in the local cluster.

The operator renders one JobSet per training job; on a real cluster JobSet's controller turns it
into Jobs, a headless Service and status. This module does the same against the in-process API
server so that the operator's JobSets meet the behaviour they will meet in production. Written
from kubernetes-sigs/jobset (snapshot 08dfbdfd, Aug 2026), not from the gspo operator:
pkg/controllers/jobset_controller.go (reconcile, getChildJobs, calculateReplicatedJobStatuses,
constructJob, labelAndAnnotateObject, createHeadlessSvcIfNecessary, suspendJobs,
resumeJobsIfNecessary, updateCondition), pkg/controllers/failure_policy.go,
pkg/controllers/success_policy.go, pkg/controllers/depends_on.go,
pkg/controllers/startup_policy.go, pkg/controllers/ttl_after_finished.go, pkg/constants,
pkg/features/features.go and api/jobset/v1alpha2/jobset_types.go. Its webhook (defaulting and
validation) is jobset_webhook.py; without it nothing enables DNS hostnames.

Implemented (a level-triggered loop over all JobSets every ~0.1 s):
- One Job per (replicatedJob, jobIndex) named `<jobset>-<rjob>-<jobIdx>`, owned by the JobSet
  (controller ownerReference), spec copied from the replicated Job's template, spec.suspend
  from the JobSet. Labels and annotations on the Job and its pod template: jobset-name,
  jobset-uid, replicatedjob-name, replicatedjob-replicas, global-replicas, job-index,
  job-global-index, job-key (SHA-1 hex of "<namespace>/<job name>", as the code computes it;
  the API doc comment says SHA-256), group-name, group-replicas, job-group-index,
  restart-attempt (= status.restarts), coordinator `<js>-<rjob>-<jobIdx>-<podIdx>.<subdomain>`
  when spec.coordinator is set, and job-restart-attempt with the RestartJob gate.
- Network: with enableDNSHostnames (the webhook defaults it to true) the pod template's
  subdomain is network.subdomain or the JobSet's name, and a headless Service of that name
  (clusterIP None, selector jobset.sigs.k8s.io/jobset-name, publishNotReadyAddresses default
  true) owned by the JobSet is created if missing.
- status.replicatedJobsStatus (in spec order): ready (Jobs whose succeeded + ready pods reach
  min(parallelism, completions)), succeeded, failed, active (status.active > 0), suspended;
  with the RestartJob gate also jobRestarts and jobRestartsCountTowardsMax.
- Only Jobs whose restart-attempt label equals status.restarts (and, with the gate, whose
  job-restart-attempt equals jobRestarts[index]) belong to the current run; older ones are
  deleted. JobSet deletes them with foreground propagation, so a Job's name stays taken until
  its pods are gone; this stand-in's store deletes the Job at once, so the controller keeps the
  name blocked itself while pods owned by the deleted Job remain. Restart strategy Recreate
  recreates each Job once its predecessor is gone; BlockingRecreate waits for all of them.
- failurePolicy: no failurePolicy and a failed Job -> Failed (FailedJobs, "jobset failed due to
  one or more job failures (first failed job: <job>)"). Otherwise the rules in order, each
  matching the earliest failed Job (by its Failed condition's time) whose Failed condition
  reason is in onJobFailureReasons and whose message matches one of onJobFailureMessagePatterns
  (regex search, as Go's regexp.MatchString) and whose replicated Job is targeted (empty lists
  match everything); the first rule with a match wins; no match -> RestartJobSet. Actions:
  FailJobSet (FailJobSetFailurePolicyAction, "applying FailJobSet failure policy action (first
  failed job: <job>)"); RestartJobSet (restarts+1 and restartsCountTowardsMax+1, condition
  RestartingJobSet=True with reason FailurePolicy_<rule> or DefaultFailurePolicy; once
  restartsCountTowardsMax >= maxRestarts: Failed, ReachedMaxRestarts, "jobset failed due to
  reaching max number of restarts (first failed job: <job>)"); RestartJobSetAndIgnoreMaxRestarts
  (restarts+1 only); with `restart_job_gate=True` RestartJob / RestartJobAndIgnoreMaxRestarts
  (recreate only the failed Job, counting in jobRestarts[...]; without the gate JobSet's
  controller refuses to apply them and retries, as here).
- successPolicy (operator All / Any, targetReplicatedJobs): when enough Jobs succeeded the JobSet
  gets Completed (AllJobsCompleted, "jobset completed successfully"), terminalState Completed,
  and (on the next pass, as JobSet does) its still-active Jobs are deleted. A failed Job is
  handled before successes are looked at.
- suspend: every active Job gets spec.suspend true, condition Suspended=True (SuspendedJobs,
  "jobset is suspended"); resuming clears the Jobs' status.startTime, merges the replicated Job's
  pod template labels, annotations, nodeSelector, tolerations and schedulingGates into them,
  unsuspends them and sets Suspended=False (ResumeJobs, "jobset is resumed").
- RestartingJobSet=False (JobsReady, "all jobs are ready") once every Job is ready or succeeded;
  set False on completion, failure and suspension too, but only when it already exists.
- dependsOn (Ready / Complete of the previous replicated Job gates creating and resuming the
  next one), startupPolicy InOrder (each replicated Job created only once the previous ones all
  started, conditions StartupPolicyInProgress / StartupPolicyCompleted), managedBy (JobSets
  managed by another controller are skipped), ttlSecondsAfterFinished (the JobSet is deleted
  that long after its Completed/Failed condition), a JobCreationFailed warning Event when the
  API server refuses a Job (once per distinct message), status.terminalState, status.restarts.

Not implemented: exclusive placement (annotations, affinities, node selectors, the pod
webhook), the InPlaceRestart restart strategy, ElasticJobSet scaling, volumeClaimPolicies,
events other than JobCreationFailed, metrics, and lastTransitionTime finer than a second.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import hashlib
import logging
import re
import uuid
from typing import TYPE_CHECKING, Any

import kmock
from job_controller import condition_true, now_rfc3339, owned_by, parse_time
from jobset_webhook import JOBSET_API_VERSION, JOBSET_CONTROLLER_NAME, job_name
from reconciler import Reconciler

if TYPE_CHECKING:
    from apiserver import ClusterApiServer

Obj = dict[str, Any]
log = logging.getLogger(__name__)

PREFIX = "jobset.sigs.k8s.io/"
JOBSET_NAME_KEY = PREFIX + "jobset-name"
JOBSET_UID_KEY = PREFIX + "jobset-uid"
REPLICATED_JOB_NAME_KEY = PREFIX + "replicatedjob-name"
REPLICATED_JOB_REPLICAS_KEY = PREFIX + "replicatedjob-replicas"
GLOBAL_REPLICAS_KEY = PREFIX + "global-replicas"
JOB_INDEX_KEY = PREFIX + "job-index"
JOB_GLOBAL_INDEX_KEY = PREFIX + "job-global-index"
JOB_KEY = PREFIX + "job-key"
GROUP_NAME_KEY = PREFIX + "group-name"
GROUP_REPLICAS_KEY = PREFIX + "group-replicas"
JOB_GROUP_INDEX_KEY = PREFIX + "job-group-index"
COORDINATOR_KEY = PREFIX + "coordinator"
RESTARTS_KEY = PREFIX + "restart-attempt"
JOB_RESTART_ATTEMPT_KEY = PREFIX + "job-restart-attempt"

FAILED_JOBS = ("FailedJobs", "jobset failed due to one or more job failures")
REACHED_MAX_RESTARTS = (
    "ReachedMaxRestarts",
    "jobset failed due to reaching max number of restarts",
)
FAIL_JOBSET_ACTION = ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action")
RESTART_MESSAGE = "applying {} failure policy action"
ALL_JOBS_COMPLETED = ("AllJobsCompleted", "jobset completed successfully")
SUSPENDED = ("SuspendedJobs", "jobset is suspended")
RESUMED = ("ResumeJobs", "jobset is resumed")
JOBS_READY = ("JobsReady", "all jobs are ready")
IN_ORDER_IN_PROGRESS = ("InOrderStartupPolicyInProgress", "in order startup policy is in progress")
IN_ORDER_COMPLETED = ("InOrderStartupPolicyCompleted", "in order startup policy has completed")


def with_first_failed(message: str, job: str) -> str:
    """messageWithFirstFailedJob."""
    return f"{message} (first failed job: {job})"


def job_finished_type(job: Obj) -> str | None:
    """JobFinished: "Complete" or "Failed" when that condition is True, else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"]
    return None


def _failed_condition(job: Obj) -> Obj | None:
    """The Job's Failed=True condition: its reason and message drive the failure policy."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return cond
    return None


def _first_failed(jobs: list[Obj]) -> Obj:
    """findFirstFailedJob: the Job whose Failed condition is oldest."""
    return min(jobs, key=lambda j: (_failed_condition(j) or {}).get("lastTransitionTime", ""))


def _label(job: Obj, key: str) -> str | None:
    """A label of the Job (None when absent)."""
    return (job["metadata"].get("labels") or {}).get(key)


def _int_label(job: Obj, key: str) -> int | None:
    """An integer label of the Job (None when absent or malformed)."""
    value = _label(job, key)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def subdomain_of(js: Obj) -> str:
    """GetSubdomain: network.subdomain, else the JobSet's name."""
    return ((js.get("spec") or {}).get("network") or {}).get("subdomain") or js["metadata"]["name"]


def dns_hostnames_enabled(js: Obj) -> bool:
    """Only an explicit enableDNSHostnames: true counts (the webhook defaults it)."""
    return bool(((js.get("spec") or {}).get("network") or {}).get("enableDNSHostnames"))


def set_condition(status: Obj, type_: str, state: str, reason: str, message: str) -> bool:
    """updateCondition of JobSet's controller, on `status`; True if it changed something."""
    conditions = status.setdefault("conditions", [])
    now = now_rfc3339()
    found = changed = False
    exclusive = {"StartupPolicyInProgress", "StartupPolicyCompleted"}
    for cond in conditions:
        if cond.get("type") == type_:
            found = True
            if cond.get("status") != state:
                cond.update(status=state, reason=reason, message=message, lastTransitionTime=now)
                changed = True
            elif (cond.get("reason"), cond.get("message")) != (reason, message):
                cond.update(reason=reason, message=message)
                changed = True
        elif (
            {cond.get("type"), type_} == exclusive
            and cond.get("status") == "True"
            and state == "True"
        ):
            cond["status"] = "False"
            changed = True
    if not found and state == "True":
        conditions.append(
            {
                "type": type_,
                "status": state,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
            }
        )
        changed = True
    if not conditions:
        del status["conditions"]
    return changed


class JobSetController(Reconciler):
    """jobset.x-k8s.io/v1alpha2 JobSets: Jobs, headless Service, policies, status."""

    def __init__(
        self, api: ClusterApiServer, *, restart_job_gate: bool = False, period_s: float = 0.1
    ) -> None:
        super().__init__(api, period_s)
        self.restart_job_gate = restart_job_gate
        # (namespace, job name) -> uid of a deleted Job whose pods may still be terminating.
        self._draining: dict[tuple[str, str], str] = {}
        self._events: dict[tuple[str, str, str], str] = {}

    async def sync_all(self) -> None:
        """One pass over all JobSets."""
        await self.sync_each("JobSet", self.sync_jobset)

    # --- the reconcile ------------------------------------------------------------------------

    async def sync_jobset(self, js: Obj) -> None:
        """JobSet's reconcile for one JobSet; writes the status once at the end if it changed."""
        meta, spec = js["metadata"], js.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        if spec.get("managedBy") not in (None, JOBSET_CONTROLLER_NAME):
            return
        old_status = js.get("status") or {}
        status = copy.deepcopy(old_status)
        status.setdefault("restarts", 0)

        active, successful, failed, previous = self._child_jobs(js, status)
        rj_statuses = self._replicated_job_statuses(js, status, active, successful, failed)
        status["replicatedJobsStatus"] = rj_statuses

        if condition_true(status.get("conditions") or [], "Completed") or condition_true(
            status.get("conditions") or [], "Failed"
        ):
            await self._delete_jobs(active)
            await self._write_status(js, old_status, status)
            await self._ttl_after_finished(js, status)
            return

        await self._delete_jobs(previous)
        suspended = bool(spec.get("suspend"))
        if not suspended and self._all_jobs_ready(spec, rj_statuses):
            set_condition(status, "RestartingJobSet", "False", *JOBS_READY)

        if failed:
            self._execute_failure_policy(js, status, failed)
            await self._write_status(js, old_status, status)
            return
        if successful and self._success_policy_met(spec, successful):
            set_condition(status, "Completed", "True", *ALL_JOBS_COMPLETED)
            set_condition(
                status, "RestartingJobSet", "False", "JobSetCompleted", ALL_JOBS_COMPLETED[1]
            )
            status["terminalState"] = "Completed"
            await self._write_status(js, old_status, status)
            return

        if dns_hostnames_enabled(js):
            await self._ensure_headless_service(js)
        await self._create_jobs(js, status, rj_statuses, active + successful + failed, previous)
        if suspended:
            await self._suspend_jobs(status, active)
        else:
            await self._resume_jobs(js, status, rj_statuses, active)
        await self._write_status(js, old_status, status)

    async def _write_status(self, js: Obj, old: Obj, new: Obj) -> None:
        """One status write per reconcile, and none when nothing changed (as JobSet does)."""
        if new != old:
            meta = js["metadata"]
            await self.api.patch_status("JobSet", meta.get("namespace", ""), meta["name"], new)

    # --- child Jobs ---------------------------------------------------------------------------

    def _job_restarts(self, js: Obj, status: Obj, rjob_name: str) -> list[int]:
        """getJobRestarts: jobRestarts of that replicated Job, zeros when unset."""
        for rjs in status.get("replicatedJobsStatus") or []:
            if rjs.get("name") == rjob_name and rjs.get("jobRestarts"):
                return list(rjs["jobRestarts"])
        replicas = next(
            (
                int(r.get("replicas", 1))
                for r in (js.get("spec") or {}).get("replicatedJobs") or []
                if r.get("name") == rjob_name
            ),
            0,
        )
        return [0] * replicas

    def _child_jobs(
        self, js: Obj, status: Obj
    ) -> tuple[list[Obj], list[Obj], list[Obj], list[Obj]]:
        """getChildJobs: (active, successful, failed, previous) of the current run."""
        ns, uid = js["metadata"].get("namespace", ""), js["metadata"]["uid"]
        active: list[Obj] = []
        successful: list[Obj] = []
        failed: list[Obj] = []
        previous: list[Obj] = []
        restarts = int(status.get("restarts", 0))
        for job in self.api.owned(uid, "Job"):
            if job["metadata"].get("namespace", "") != ns:
                continue
            attempt = _int_label(job, RESTARTS_KEY)
            if attempt is None or attempt < restarts:
                previous.append(job)
                continue
            if self.restart_job_gate:
                individual = _int_label(job, JOB_RESTART_ATTEMPT_KEY)
                index = _int_label(job, JOB_INDEX_KEY)
                targets = self._job_restarts(js, status, _label(job, REPLICATED_JOB_NAME_KEY) or "")
                if (
                    individual is not None
                    and index is not None
                    and (index >= len(targets) or individual < targets[index])
                ):
                    previous.append(job)
                    continue
            finished = job_finished_type(job)
            if finished == "Failed":
                failed.append(job)
            elif finished == "Complete":
                successful.append(job)
            else:
                active.append(job)
        return active, successful, failed, previous

    def _replicated_job_statuses(
        self, js: Obj, status: Obj, active: list[Obj], successful: list[Obj], failed: list[Obj]
    ) -> list[Obj]:
        """calculateReplicatedJobStatuses, in spec order."""
        counts: dict[str, dict[str, int]] = {}
        for rjob in (js.get("spec") or {}).get("replicatedJobs") or []:
            counts[rjob["name"]] = dict.fromkeys(
                ("ready", "succeeded", "failed", "active", "suspended"), 0
            )
        for job in active:
            c = counts.get(_label(job, REPLICATED_JOB_NAME_KEY) or "")
            if c is None:
                continue
            jspec, jstatus = job.get("spec") or {}, job.get("status") or {}
            pods = 1 if jspec.get("parallelism") is None else int(jspec["parallelism"])
            if jspec.get("completions") is not None and int(jspec["completions"]) < pods:
                pods = int(jspec["completions"])
            if int(jstatus.get("succeeded") or 0) + int(jstatus.get("ready") or 0) >= pods:
                c["ready"] += 1
            if int(jstatus.get("active") or 0) > 0:
                c["active"] += 1
            if jspec.get("suspend"):
                c["suspended"] += 1
        for jobs, key in ((successful, "succeeded"), (failed, "failed")):
            for job in jobs:
                c = counts.get(_label(job, REPLICATED_JOB_NAME_KEY) or "")
                if c is not None:
                    c[key] += 1
        result = []
        for rjob_name, c in counts.items():
            entry: Obj = {"name": rjob_name, **c}
            if self.restart_job_gate:
                for old in status.get("replicatedJobsStatus") or []:
                    if old.get("name") == rjob_name:
                        for key in ("jobRestarts", "jobRestartsCountTowardsMax"):
                            if old.get(key):
                                entry[key] = list(old[key])
            result.append(entry)
        return result

    def _blocked_names(self, ns: str) -> set[str]:
        """Names of deleted Jobs whose pods still exist (foreground deletion not finished)."""
        pods = self.api.list_kind("Pod", ns)
        blocked = set()
        for (jns, jname), uid in list(self._draining.items()):
            if jns != ns:
                continue
            if any(owned_by(p, uid) for p in pods):
                blocked.add(jname)
            else:
                del self._draining[(jns, jname)]
        return blocked

    async def _delete_jobs(self, jobs: list[Obj]) -> None:
        """Delete Jobs, remembering their uids so their names stay taken while pods remain."""
        for job in jobs:
            meta = job["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            ns = meta.get("namespace", "")
            self._draining[(ns, meta["name"])] = meta["uid"]
            await self.api.delete("Job", ns, meta["name"])

    def _construct_job(self, js: Obj, status: Obj, rjob: Obj, index: int) -> Obj:
        """constructJob: the Job for one (replicated Job, index) of the current run."""
        jmeta, spec = js["metadata"], js.get("spec") or {}
        ns = jmeta.get("namespace", "")
        name = job_name(jmeta["name"], rjob["name"], index)
        template = rjob.get("template") or {}
        tmeta = template.get("metadata") or {}
        job_spec = copy.deepcopy(template.get("spec") or {})
        keys = self._jobset_keys(js, status, rjob, index)
        pod_template = job_spec.setdefault("template", {})
        pod_meta = pod_template.setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **keys}
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **keys}
        if dns_hostnames_enabled(js):
            pod_template.setdefault("spec", {})["subdomain"] = subdomain_of(js)
        job_spec["suspend"] = bool(spec.get("suspend"))
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {**(tmeta.get("labels") or {}), **keys},
                "annotations": {**(tmeta.get("annotations") or {}), **keys},
                "ownerReferences": [self._owner_ref(js)],
            },
            "spec": job_spec,
        }

    def _jobset_keys(self, js: Obj, status: Obj, rjob: Obj, index: int) -> dict[str, str]:
        """labelAndAnnotateObject: the labels (and identical annotations) JobSet adds."""
        jmeta, spec = js["metadata"], js.get("spec") or {}
        rjobs = spec.get("replicatedJobs") or []
        group = rjob.get("groupName", "default")
        name = job_name(jmeta["name"], rjob["name"], index)
        global_index = group_index = 0
        for other in rjobs:
            if other["name"] == rjob["name"]:
                break
            global_index += int(other.get("replicas", 1))
        for other in rjobs:
            if other.get("groupName", "default") != group:
                continue
            if other["name"] == rjob["name"]:
                break
            group_index += int(other.get("replicas", 1))
        keys = {
            JOBSET_NAME_KEY: jmeta["name"],
            JOBSET_UID_KEY: jmeta["uid"],
            REPLICATED_JOB_NAME_KEY: rjob["name"],
            RESTARTS_KEY: str(int(status.get("restarts", 0))),
            REPLICATED_JOB_REPLICAS_KEY: str(int(rjob.get("replicas", 1))),
            GLOBAL_REPLICAS_KEY: str(sum(int(r.get("replicas", 1)) for r in rjobs)),
            JOB_INDEX_KEY: str(index),
            JOB_KEY: hashlib.sha1(f"{jmeta.get('namespace', '')}/{name}".encode()).hexdigest(),
            JOB_GLOBAL_INDEX_KEY: str(global_index + index),
            GROUP_NAME_KEY: group,
            GROUP_REPLICAS_KEY: str(
                sum(
                    int(r.get("replicas", 1))
                    for r in rjobs
                    if r.get("groupName", "default") == group
                )
            ),
            JOB_GROUP_INDEX_KEY: str(group_index + index),
        }
        if self.restart_job_gate:
            keys[JOB_RESTART_ATTEMPT_KEY] = str(self._job_restarts(js, status, rjob["name"])[index])
        coordinator = spec.get("coordinator")
        if coordinator is not None:
            keys[COORDINATOR_KEY] = (
                f"{jmeta['name']}-{coordinator.get('replicatedJob')}-"
                f"{coordinator.get('jobIndex', 0)}-{coordinator.get('podIndex', 0)}."
                f"{subdomain_of(js)}"
            )
        return keys

    @staticmethod
    def _owner_ref(js: Obj) -> Obj:
        """The controller ownerReference JobSet puts on its Jobs and Service (GC, watches)."""
        return {
            "apiVersion": JOBSET_API_VERSION,
            "kind": "JobSet",
            "name": js["metadata"]["name"],
            "uid": js["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    async def _create_jobs(
        self,
        js: Obj,
        status: Obj,
        rj_statuses: list[Obj],
        current: list[Obj],
        previous: list[Obj],
    ) -> None:
        """reconcileReplicatedJobs: create missing Jobs (dependsOn, InOrder, BlockingRecreate)."""
        meta, spec = js["metadata"], js.get("spec") or {}
        ns = meta.get("namespace", "")
        suspended = bool(spec.get("suspend"))
        in_order = (spec.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
        blocked = self._blocked_names(ns)
        taken = {j["metadata"]["name"] for j in current + previous} | blocked
        strategy = (spec.get("failurePolicy") or {}).get("restartStrategy")
        blocking = strategy == "BlockingRecreate" and bool(previous or blocked)
        replicas_seen: dict[str, int] = {}
        for rjob in spec.get("replicatedJobs") or []:
            replicas = int(rjob.get("replicas", 1))
            replicas_seen[rjob["name"]] = replicas
            if not _dependency_reached(rjob, replicas_seen, rj_statuses):
                continue
            rjs = next((s for s in rj_statuses if s["name"] == rjob["name"]), None)
            if not suspended and in_order and rjs is not None and _all_started(replicas, rjs):
                continue
            if not blocking:
                for index in range(replicas):
                    if job_name(meta["name"], rjob["name"], index) in taken:
                        continue
                    await self._create_job(js, self._construct_job(js, status, rjob, index))
            if not suspended and in_order:
                set_condition(status, "StartupPolicyInProgress", "True", *IN_ORDER_IN_PROGRESS)
                return
        if not suspended and in_order:
            set_condition(status, "StartupPolicyCompleted", "True", *IN_ORDER_COMPLETED)

    async def _create_job(self, js: Obj, job: Obj) -> None:
        """Create a Job; a refusal becomes a JobCreationFailed event and is retried next pass."""
        try:
            await self.api.create(job)
        except kmock.KubernetesError as exc:
            message = f'job "{job["metadata"]["name"]}" creation failed with error: {exc.message}'
            log.warning("JobSet %s: %s", js["metadata"]["name"], message)
            await self._event(js, "Warning", "JobCreationFailed", message)

    async def _ensure_headless_service(self, js: Obj) -> None:
        """createHeadlessSvcIfNecessary: pods resolve each other as <hostname>.<subdomain>."""
        meta = js["metadata"]
        ns, name = meta.get("namespace", ""), subdomain_of(js)
        if self.api.get("Service", ns, name) is not None:
            return
        network = (js.get("spec") or {}).get("network") or {}
        publish = network.get("publishNotReadyAddresses")
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "ownerReferences": [self._owner_ref(js)]},
            "spec": {
                "clusterIP": "None",
                "selector": {JOBSET_NAME_KEY: meta["name"]},
                "publishNotReadyAddresses": True if publish is None else bool(publish),
            },
        }
        try:
            await self.api.create(service)
        except kmock.KubernetesError as exc:
            await self._event(js, "Warning", "HeadlessServiceCreationFailed", str(exc.message))

    async def _event(self, js: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about the JobSet, emitted once per distinct message."""
        meta = js["metadata"]
        key = (meta.get("namespace", ""), meta["name"], reason)
        if self._events.get(key) == message:
            return
        self._events[key] = message
        now = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta.get("namespace", ""),
            },
            "involvedObject": {
                "apiVersion": JOBSET_API_VERSION,
                "kind": "JobSet",
                "name": meta["name"],
                "namespace": meta.get("namespace", ""),
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": "jobset-controller"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(kmock.KubernetesError):
            await self.api.create(event)

    # --- suspend / resume ---------------------------------------------------------------------

    async def _suspend_jobs(self, status: Obj, active: list[Obj]) -> None:
        """suspendJobs: suspend every active Job (the Job controller then deletes its pods)."""
        for job in active:
            if not (job.get("spec") or {}).get("suspend"):
                meta = job["metadata"]
                await self.api.patch(
                    "Job", meta.get("namespace", ""), meta["name"], {"spec": {"suspend": True}}
                )
        set_condition(status, "Suspended", "True", *SUSPENDED)
        set_condition(status, "RestartingJobSet", "False", "JobSetSuspended", SUSPENDED[1])

    async def _resume_jobs(
        self, js: Obj, status: Obj, rj_statuses: list[Obj], active: list[Obj]
    ) -> None:
        """resumeJobsIfNecessary: unsuspend Jobs, honouring dependsOn and InOrder startup."""
        spec = js.get("spec") or {}
        in_order = (spec.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
        replicas_seen: dict[str, int] = {}
        for rjob in spec.get("replicatedJobs") or []:
            replicas = int(rjob.get("replicas", 1))
            replicas_seen[rjob["name"]] = replicas
            if not _dependency_reached(rjob, replicas_seen, rj_statuses):
                continue
            rjs = next((s for s in rj_statuses if s["name"] == rjob["name"]), None)
            if in_order and rjs is not None and _all_started(replicas, rjs):
                continue
            for job in active:
                if _label(job, REPLICATED_JOB_NAME_KEY) != rjob["name"]:
                    continue
                if (job.get("spec") or {}).get("suspend"):
                    await self._resume_job(job, rjob)
            if in_order:
                set_condition(status, "StartupPolicyInProgress", "True", *IN_ORDER_IN_PROGRESS)
                return
        set_condition(status, "Suspended", "False", *RESUMED)

    async def _resume_job(self, job: Obj, rjob: Obj) -> None:
        """resumeJob: clear startTime, merge Kueue-mutable template fields, unsuspend."""
        meta = job["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        if (job.get("status") or {}).get("startTime") is not None:
            await self.api.patch_status("Job", ns, name, {"startTime": None})
        want = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
        have = ((job.get("spec") or {}).get("template")) or {}
        tmeta: Obj = {}
        for key in ("labels", "annotations"):
            merged = {**((have.get("metadata") or {}).get(key) or {})}
            merged.update((want.get("metadata") or {}).get(key) or {})
            if merged != ((have.get("metadata") or {}).get(key) or {}):
                tmeta[key] = merged
        tspec: Obj = {}
        node_selector = {**((have.get("spec") or {}).get("nodeSelector") or {})}
        node_selector.update((want.get("spec") or {}).get("nodeSelector") or {})
        if node_selector != ((have.get("spec") or {}).get("nodeSelector") or {}):
            tspec["nodeSelector"] = node_selector
        for key in ("tolerations", "schedulingGates"):
            items = list((have.get("spec") or {}).get(key) or [])
            items += [i for i in (want.get("spec") or {}).get(key) or [] if i not in items]
            if items != list((have.get("spec") or {}).get(key) or []):
                tspec[key] = items
        patch: Obj = {"spec": {"suspend": False}}
        if tmeta or tspec:
            patch["spec"]["template"] = {
                k: v for k, v in (("metadata", tmeta), ("spec", tspec)) if v
            }
        await self.api.patch("Job", ns, name, patch)

    # --- policies -----------------------------------------------------------------------------

    @staticmethod
    def _all_jobs_ready(spec: Obj, rj_statuses: list[Obj]) -> bool:
        """allJobsReady: every Job of the JobSet is ready or succeeded."""
        total = sum(int(r.get("replicas", 1)) for r in spec.get("replicatedJobs") or [])
        return total == sum(s["ready"] + s["succeeded"] for s in rj_statuses)

    @staticmethod
    def _success_policy_met(spec: Obj, successful: list[Obj]) -> bool:
        """executeSuccessPolicy's test: enough targeted Jobs succeeded (Any: one)."""
        policy = spec.get("successPolicy") or {"operator": "All"}
        targets = policy.get("targetReplicatedJobs") or []
        matching = sum(
            1 for j in successful if not targets or _label(j, REPLICATED_JOB_NAME_KEY) in targets
        )
        if policy.get("operator") == "Any":
            expected = 1
        elif policy.get("operator") == "All":
            expected = sum(
                int(r.get("replicas", 1))
                for r in spec.get("replicatedJobs") or []
                if not targets or r["name"] in targets
            )
        else:
            expected = 0
        return matching >= expected

    def _set_failed(self, status: Obj, reason: str, message: str) -> None:
        """setJobSetFailedCondition: Failed=True, RestartingJobSet=False, terminalState."""
        set_condition(status, "Failed", "True", reason, message)
        set_condition(status, "RestartingJobSet", "False", "JobSetFailed", "jobset failed")
        status["terminalState"] = "Failed"

    def _total_towards_max(self, status: Obj) -> int:
        """totalRestartsCountTowardsMax: global plus individual (RestartJob) restarts."""
        total = int(status.get("restartsCountTowardsMax") or 0)
        for rjs in status.get("replicatedJobsStatus") or []:
            total += sum(rjs.get("jobRestartsCountTowardsMax") or [])
        return total

    def _execute_failure_policy(self, js: Obj, status: Obj, failed: list[Obj]) -> None:
        """executeFailurePolicy: the first matching rule's action, else RestartJobSet."""
        policy = (js.get("spec") or {}).get("failurePolicy")
        if policy is None:
            first = _first_failed(failed)["metadata"]["name"]
            self._set_failed(status, FAILED_JOBS[0], with_first_failed(FAILED_JOBS[1], first))
            return
        rule, job = None, None
        for candidate in policy.get("rules") or []:
            matches = [j for j in failed if _rule_applies(candidate, j)]
            if matches:
                rule, job = candidate, _first_failed(matches)
                break
        if job is None:
            job = _first_failed(failed)
        action = rule.get("action") if rule is not None else "RestartJobSet"
        first = job["metadata"]["name"]
        max_restarts = int(policy.get("maxRestarts") or 0)
        restart_reason = f"FailurePolicy_{rule['name']}" if rule else "DefaultFailurePolicy"

        if action == "FailJobSet":
            self._set_failed(
                status, FAIL_JOBSET_ACTION[0], with_first_failed(FAIL_JOBSET_ACTION[1], first)
            )
        elif action in ("RestartJobSet", "RestartJob"):
            if action == "RestartJob" and not self.restart_job_gate:
                log.error("RestartJob action cannot be used when the RestartJob gate is disabled")
                return
            used = (
                self._total_towards_max(status)
                if self.restart_job_gate
                else int(status.get("restartsCountTowardsMax") or 0)
            )
            if used >= max_restarts:
                self._set_failed(
                    status,
                    REACHED_MAX_RESTARTS[0],
                    with_first_failed(REACHED_MAX_RESTARTS[1], first),
                )
            elif action == "RestartJobSet":
                status["restarts"] = int(status.get("restarts", 0)) + 1
                status["restartsCountTowardsMax"] = (
                    int(status.get("restartsCountTowardsMax") or 0) + 1
                )
                message = with_first_failed(RESTART_MESSAGE.format(action), first)
                set_condition(status, "RestartingJobSet", "True", restart_reason, message)
            else:
                self._restart_job(js, status, job, count_towards_max=True)
        elif action == "RestartJobSetAndIgnoreMaxRestarts":
            status["restarts"] = int(status.get("restarts", 0)) + 1
            message = with_first_failed(RESTART_MESSAGE.format(action), first)
            set_condition(status, "RestartingJobSet", "True", restart_reason, message)
        elif action == "RestartJobAndIgnoreMaxRestarts":
            if not self.restart_job_gate:
                log.error("RestartJob action cannot be used when the RestartJob gate is disabled")
                return
            self._restart_job(js, status, job, count_towards_max=False)

    def _restart_job(self, js: Obj, status: Obj, job: Obj, *, count_towards_max: bool) -> None:
        """failurePolicyRecreateJob: bump the failed Job's individual restart counters."""
        rjob_name = _label(job, REPLICATED_JOB_NAME_KEY) or ""
        index = _int_label(job, JOB_INDEX_KEY)
        entry = next(
            (s for s in status.get("replicatedJobsStatus") or [] if s["name"] == rjob_name), None
        )
        restarts = self._job_restarts(js, status, rjob_name)
        if entry is None or index is None or index >= len(restarts):
            log.error("failed Job %s has no valid replicated Job / index", job["metadata"]["name"])
            return
        restarts[index] += 1
        entry["jobRestarts"] = restarts
        if count_towards_max:
            towards = list(entry.get("jobRestartsCountTowardsMax") or [0] * len(restarts))
            towards[index] += 1
            entry["jobRestartsCountTowardsMax"] = towards

    async def _ttl_after_finished(self, js: Obj, status: Obj) -> None:
        """executeTTLAfterFinishedPolicy: delete the JobSet ttl seconds after it finished."""
        ttl = (js.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        for cond in status.get("conditions") or []:
            if cond.get("type") in ("Completed", "Failed") and cond.get("status") == "True":
                finished = parse_time(cond["lastTransitionTime"])
                if dt.datetime.now(dt.UTC) >= finished + dt.timedelta(seconds=int(ttl)):
                    meta = js["metadata"]
                    await self.api.delete("JobSet", meta.get("namespace", ""), meta["name"])
                return


def _rule_applies(rule: Obj, job: Obj) -> bool:
    """ruleIsApplicable: reasons, message patterns (regex search) and target replicated Jobs."""
    cond = _failed_condition(job)
    if cond is None:
        return False
    reasons = rule.get("onJobFailureReasons") or []
    if reasons and cond.get("reason") not in reasons:
        return False
    patterns = rule.get("onJobFailureMessagePatterns") or []
    if patterns:
        matched = False
        for pattern in patterns:
            try:
                if re.search(pattern, cond.get("message") or ""):
                    matched = True
                    break
            except re.error:
                log.error("invalid regex for onJobFailureMessagePatterns: %s", pattern)
        if not matched:
            return False
    parent = _label(job, REPLICATED_JOB_NAME_KEY)
    if not parent:
        return False
    targets = rule.get("targetReplicatedJobs") or []
    return not targets or parent in targets


def _dependency_reached(rjob: Obj, replicas: dict[str, int], rj_statuses: list[Obj]) -> bool:
    """dependencyReachedStatus: every dependsOn entry reached Ready or Complete."""
    for dep in rjob.get("dependsOn") or []:
        status = next((s for s in rj_statuses if s["name"] == dep.get("name")), None)
        if status is None:
            return False
        want = replicas.get(dep.get("name"), 0)
        if dep.get("status") == "Complete" and want != status["succeeded"]:
            return False
        if dep.get("status") == "Ready" and want != (
            status["failed"] + status["ready"] + status["succeeded"]
        ):
            return False
    return True


def _all_started(replicas: int, rjs: Obj) -> bool:
    """allReplicasStarted (InOrder startup): every Job is ready, succeeded or failed."""
    return replicas == rjs["failed"] + rjs["ready"] + rjs["succeeded"]
