"""What the operator reads of the cluster for one job, as plain values: the pods, the JobSet,
Kueue's Workload, the checkpoint claim and the Events that say why a Job has no pods. Built
from the API objects by the `from_*` constructors (the reconcile's observe step) and read by
`status.compute`, so the status rules never touch a dict of the API's shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gspo_api.progress import LearnerProgress
from gspo_operator import names


@dataclass(frozen=True)
class PodView:
    """What the status needs from one pod of the job (created by JobSet's Jobs)."""

    name: str
    role: str = names.LEARNER
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    restart_attempt: int = 0  # JobSet's restart-attempt label: the group generation
    index: int = 0  # the Indexed Job's completion index (the learner pod's node rank)
    deleting: bool = False
    ip: str | None = None
    exit_code: int | None = None
    message: str = ""  # why it ended, or why it cannot start
    job: str = ""  # the Job that made it (its batch.kubernetes.io/job-name label)

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodView:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        exit_code, message = None, status.get("message") or ""
        for cs in status.get("containerStatuses") or []:
            state = cs.get("state") or {}
            if state.get("terminated"):
                term = state["terminated"]
                exit_code = term.get("exitCode")
                said = (term.get("message") or "").strip()
                message = message or (
                    f"{term.get('reason', 'Error')} (exit code {exit_code})"
                    + (f": {said[-MESSAGE_CHARS:]}" if said else "")
                )
            elif (state.get("waiting") or {}).get("message"):
                waiting = state["waiting"]
                message = message or f"{waiting.get('reason')}: {waiting['message']}"
        scheduled = conditions.get("PodScheduled") or {}
        if not message and scheduled.get("status") == "False":
            message = f"{scheduled.get('reason')}: {scheduled.get('message')}"
        return cls(
            name=meta.get("name", ""),
            role=labels.get(names.ROLE_LABEL, names.LEARNER),
            phase=status.get("phase") or "Pending",
            ready=(conditions.get("Ready") or {}).get("status") == "True",
            restart_attempt=int(labels.get(names.RESTART_ATTEMPT_LABEL, 0)),
            index=int(annotations.get(names.COMPLETION_INDEX_ANNOTATION, 0)),
            deleting=bool(meta.get("deletionTimestamp")),
            ip=status.get("podIP"),
            exit_code=exit_code,
            message=message,
            job=labels.get(JOB_NAME_LABEL, ""),
        )


# The Job controller labels each pod with its Job's name (kubernetes pkg/controller/job).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
MESSAGE_CHARS = 600  # of a pod's termination message, copied into the job's conditions


@dataclass(frozen=True)
class JobSetView:
    """What the status needs from the job's JobSet."""

    suspended: bool = False  # spec.suspend
    restarts: int = 0
    restarts_counted: int = 0  # status.restartsCountTowardsMax: those not after a disruption
    conditions: dict[str, tuple[bool, str, str]] = field(default_factory=dict)
    uid: str = ""  # Kueue labels the JobSet's Workload with it

    @classmethod
    def from_jobset(cls, jobset: Mapping[str, Any]) -> JobSetView:
        status = jobset.get("status") or {}
        return cls(
            uid=(jobset.get("metadata") or {}).get("uid", ""),
            suspended=bool((jobset.get("spec") or {}).get("suspend")),
            restarts=int(status.get("restarts") or 0),
            restarts_counted=int(status.get("restartsCountTowardsMax") or 0),
            conditions={
                c["type"]: (c.get("status") == "True", c.get("reason", ""), c.get("message", ""))
                for c in status.get("conditions") or []
            },
        )

    def true(self, type_: str) -> tuple[str, str] | None:
        """(reason, message) of a condition that is True, else None."""
        status, reason, message = self.conditions.get(type_, (False, "", ""))
        return (reason, message) if status else None


@dataclass(frozen=True)
class WorkloadView:
    """What the status needs from the Workload Kueue keeps for a queued JobSet
    (kueue.x-k8s.io/v1beta1): whether it is active and Kueue's own conditions."""

    name: str
    active: bool = True  # spec.active: false is how a queued job is suspended
    conditions: dict[str, tuple[bool, str, str]] = field(default_factory=dict)
    cluster_queue: str = ""  # status.admission.clusterQueue while quota is reserved

    @classmethod
    def from_workload(cls, wl: Mapping[str, Any]) -> WorkloadView:
        status = wl.get("status") or {}
        return cls(
            name=(wl.get("metadata") or {}).get("name", ""),
            active=(wl.get("spec") or {}).get("active") is not False,
            conditions={
                c["type"]: (c.get("status") == "True", c.get("reason", ""), c.get("message", ""))
                for c in status.get("conditions") or []
            },
            cluster_queue=(status.get("admission") or {}).get("clusterQueue", ""),
        )

    def admitted(self) -> bool:
        return self.conditions.get("Admitted", (False, "", ""))[0]

    def waiting(self) -> tuple[str, str]:
        """(reason, message) of why Kueue holds the JobSet, in Kueue's words: eviction first,
        then a requeue backoff, then why no quota is reserved."""
        held, reason, message = self.conditions.get("Evicted", (False, "", ""))
        if not self.active:
            return "Deactivated", "deactivated (spec.active: false)"
        if held:
            return reason, f"evicted: {message}"
        requeued, reason, message = self.conditions.get("Requeued", (True, "", ""))
        if not requeued:
            return reason, f"evicted ({reason}: {message}); requeued after Kueue's backoff"
        reserved, reason, message = self.conditions.get("QuotaReserved", (False, "", ""))
        if reserved and self.admitted():
            return "Admitted", f"admitted by ClusterQueue {self.cluster_queue}; Kueue starts it"
        if reserved:
            return "QuotaReserved", f"{message}; waiting for its admission checks"
        if reason:
            return reason, message
        return "Pending", "waiting for Kueue's scheduler to consider it"


@dataclass(frozen=True)
class ClaimView:
    """The checkpoint claim while it is not Bound, and why, in its provisioner's words.

    A claim keeps no condition that says why it waits: the PV controller and the external
    provisioner record it as Events on the claim (FailedBinding, "ProvisioningFailed: failed to
    provision volume with StorageClass ...: rpc error: ..."), so the newest Warning is the
    reason; a Normal one (WaitForFirstConsumer, ExternalProvisioning) is only progress."""

    name: str
    phase: str = "Pending"  # Pending | Bound | Lost
    warning: str = ""  # "<reason>: <message>" of the newest Warning Event

    @classmethod
    def from_claim(cls, claim: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> ClaimView:
        uid = (claim.get("metadata") or {}).get("uid")
        warnings = [
            e
            for e in events
            if e.get("type") == "Warning"
            and (not uid or (e.get("involvedObject") or {}).get("uid") in (None, uid))
        ]
        newest = max(warnings, key=_event_time, default=None)
        return cls(
            name=(claim.get("metadata") or {}).get("name", ""),
            phase=(claim.get("status") or {}).get("phase") or "Pending",
            warning=f"{newest.get('reason')}: {newest.get('message')}" if newest else "",
        )


def failed_create(job: str, events: Iterable[Mapping[str, Any]]) -> str:
    """Why the Job controller cannot create a Job's pods: its newest FailedCreate Warning
    ("Error creating: pods \"x-\" is forbidden: no PriorityClass with name p was found", an
    exceeded quota, a webhook's refusal), as "Job <job>: <message>", or "". A Job keeps no
    condition for it (kubernetes pkg/controller/controller_utils.go records only this Event),
    so a pod that cannot be created would otherwise read as a pod not yet running."""
    refusals = [
        e for e in events if (e.get("type"), e.get("reason")) == ("Warning", "FailedCreate")
    ]
    newest = max(refusals, key=_event_time, default=None)
    return f"Job {job}: {newest.get('message')}" if newest else ""


def failed_creates(jobs: Iterable[str], events: Iterable[Mapping[str, Any]]) -> str:
    """failed_create() of each of `jobs` that has one, "; "-joined, from Events of many Jobs
    (one list of the namespace's FailedCreate Events serves every rollout Job)."""
    by_job: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        by_job.setdefault(str((e.get("involvedObject") or {}).get("name") or ""), []).append(e)
    found = (failed_create(job, by_job.get(job, [])) for job in jobs)
    return "; ".join(f for f in found if f)


def _event_time(event: Mapping[str, Any]) -> str:
    """RFC 3339 stamps of one format compare as strings; eventTime is the events.k8s.io field."""
    return str(event.get("lastTimestamp") or event.get("eventTime") or "")


@dataclass(frozen=True)
class Observed:
    jobset: JobSetView | None = None  # None: the JobSet does not exist (yet, or any more)
    pods: list[PodView] = field(default_factory=list)
    progress: LearnerProgress | None = None
    # Kueue: whether the cluster serves its Workload API (then Kueue, not the operator, owns a
    # queued JobSet's suspend), the JobSet's Workload, and why it could not be read.
    kueue: bool = False
    workload: WorkloadView | None = None
    workload_error: str = ""
    claim: ClaimView | None = None  # the checkpoint claim, read only while it may be why
    # failed_create() of the learner Job, read only while it has fewer pods than replicas
    failed_create: str = ""
    # failed_create() of the rollout Jobs, "; "-joined, read only while a server has no pod
    rollout_failed_create: str = ""

    def learners(self, attempt: int) -> list[PodView]:
        return [
            p
            for p in self.pods
            if p.role == names.LEARNER and p.restart_attempt == attempt and not p.deleting
        ]

    def rollout_ready(self) -> int:
        return sum(
            p.role == names.ROLLOUT and p.ready and p.phase == "Running" and not p.deleting
            for p in self.pods
        )
