"""Observed JobSet, pods and learner progress -> the GSPOJob's status and what to do. Pure.

JobSet carries the failure policy (restarts, what fails the job) and the Job controller the
pods; `compute` reads what they report, adds the operator's own rules (suspend, deadline,
TTL) and returns the new status, the Events to post and the actions to take (see
docs/operator.md), so every transition is tested as a table without an API server or a clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, get_args

from gspo_operator import names
from gspo_trainer.config import GSPOJobSpec, Phase
from gspo_trainer.progress import LearnerProgress
from gspo_trainer.validation import Problem

TERMINAL = ("Succeeded", "Failed")
_PHASES: dict[str, Phase] = {phase: phase for phase in get_args(Phase)}


def phase_of(st: Mapping[str, Any]) -> Phase:
    """A status's phase as a Phase (the CRD's enum admits no other); Pending before the
    operator's first write."""
    return _PHASES.get(st.get("phase") or "Pending", "Pending")


# Fields that change in flight; any other spec change is refused while the job exists. The
# JobSet's own spec is immutable but for suspend, so these are the operator's to apply.
MUTABLE_FIELDS = (
    "runPolicy.suspend",
    "runPolicy.activeDeadlineSeconds",
    "runPolicy.ttlSecondsAfterFinished",
)


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


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    suspend_jobset: bool | None = None  # set the JobSet's spec.suspend to this
    activate_workload: bool | None = None  # set the Workload's spec.active to this (Kueue)
    delete_jobset: bool = False  # stop every pod now (deadline exceeded)
    delete_job: bool = False  # ttlSecondsAfterFinished has passed


def _code_sandbox(st: _Status, spec: GSPOJobSpec) -> None:
    """Code rewards run model-written programs in the learner pod: say whether isolated."""
    reward = spec.reward
    if reward.kind != "code" and not any(f.kind == "code" for f in reward.functions or []):
        return
    where = "the learner pod" if reward.sandbox.mode == "local" else "the sandbox pods"
    if reward.sandbox.isolation == "none":
        message = (
            f"reward.sandbox.isolation is none: model-written programs run in {where} "
            "with resource limits only (they can read the pod's files and reach the network "
            "it may reach); docs/rewards.md"
        )
        st.condition("CodeSandboxed", False, "IsolationNone", message)
    else:
        message = "each program runs in its own user, PID, network and mount namespaces"
        st.condition("CodeSandboxed", True, "Namespaces", message)


def compute(
    spec: GSPOJobSpec,
    observed: Observed,
    previous: Mapping[str, Any] | None,
    now: datetime,
    generation: int | None = None,
) -> Outcome:
    """The next status of a valid job and the actions that lead there."""
    prev = dict(previous or {})
    st = _Status(prev, now)
    st.set(observedGeneration=generation)
    policy, js = spec.run_policy, observed.jobset
    _record_progress(st, observed.progress)
    desired = spec.rollout.replicas
    ready_servers = observed.rollout_ready()
    st.set(rolloutReady=f"{ready_servers}/{desired}")
    _code_sandbox(st, spec)

    phase = prev.get("phase")
    if phase in TERMINAL:
        out = Outcome(st.done())
        done = prev.get("completionTime")
        ttl = policy.ttl_seconds_after_finished
        if ttl is not None and done and now >= _parse(done) + timedelta(seconds=ttl):
            out.delete_job = True
        return out
    if js is None:
        st.phase("Pending", "Normal", "Pending", "creating the JobSet")
        st.condition("Running", False, "JobSetMissing", "the job's JobSet does not exist yet")
        return Outcome(st.done(), st.events)

    resume = None
    if policy.scheduling.queue and observed.kueue:
        queued = _queued(st, spec, js, observed)
        if queued is not None:
            return queued
    elif policy.suspend:
        _suspended(st, "runPolicy.suspend is true")
        return Outcome(st.done(), st.events, suspend_jobset=True if not js.suspended else None)
    else:
        resume = False if js.suspended else None
        # By the condition, not the JobSet: the watch may show the JobSet's suspend only after
        # the resume, and the phase has moved on by then.
        if st.condition_of("Suspended"):
            st.condition("Suspended", False, "Resumed", "resuming from the latest checkpoint")
            st.set(startTime=st.now)  # the deadline counts running time since the resume

    start = _parse(st.get("startTime") or st.now)
    st.set(startTime=st.get("startTime") or st.now)
    deadline = policy.active_deadline_seconds
    if deadline is not None and now >= start + timedelta(seconds=deadline):
        out = _finish(
            st,
            "Failed",
            "DeadlineExceeded",
            f"ran longer than runPolicy.activeDeadlineSeconds={deadline}",
        )
        out.delete_jobset = True
        return out
    if (failed := js.true("Failed")) is not None:
        reason, message = _failure(spec, observed, js, *failed)
        return _finish(st, "Failed", reason, message)
    if js.true("Completed") is not None:
        # The learner Job completes only once the learner exited 0 at maxSteps (a stopped one
        # is deleted, not completed); its /progress is gone by now, so the last read may lag.
        st.set(step=spec.algorithm.max_steps)
        message = f"every learner pod exited 0 at step {st.get('step')}"
        return _finish(st, "Succeeded", "Completed", message)

    if (limited := _disruption_limit(st, policy.max_disruption_restarts, js)) is not None:
        return limited
    restarts = js.restarts
    if seen := _why_failed(observed, restarts):
        # Kept: JobSet deletes the failed group's pods once it restarts, often before the
        # operator sees the restart, and the restart's report would lose their words.
        st.set(learnerFailure={"restartAttempt": restarts, "message": seen})
    if restarts > int(prev.get("restarts") or 0):
        why = (
            _why_failed(observed, restarts - 1)
            or _remembered_failure(prev, restarts - 1)
            or "a learner pod failed"
        )
        message = (
            f"{why}; JobSet restarted the job's pods from the latest checkpoint "
            f"(restart {restarts}, runPolicy.backoffLimit={policy.backoff_limit})"
        )
        st.events.append(Event("Warning", "LearnerRestart", message))
        st.condition("Restarting", True, "LearnerPodFailed", message)
    st.set(restarts=restarts)

    replicas = spec.learner.replicas
    current = observed.learners(restarts)
    ready = sum(p.ready and p.phase == "Running" for p in current)
    running = len(current) == replicas and all(p.phase == "Running" for p in current)
    st.condition(
        "LearnerReady",
        ready == replicas,
        "PodsReady" if ready == replicas else "PodsNotReady",
        f"{ready}/{replicas} learner pods ready",
    )
    rollout_ok = desired > 0 and ready_servers >= desired
    if not rollout_ok and observed.rollout_failed_create:
        # A server's pod the API server refuses: the learner would wait on it forever.
        st.condition(
            "RolloutReady",
            False,
            "FailedCreate",
            f"{ready_servers}/{desired} rollout servers ready; {observed.rollout_failed_create}",
        )
    else:
        st.condition(
            "RolloutReady",
            rollout_ok,
            "ServersReady" if rollout_ok else "ServersNotReady",
            f"{ready_servers}/{desired} rollout servers ready (their engines serve; "
            "WeightsSynced says which hold the learner's weights)",
        )
    version = st.get("policyVersion") or 0
    held = list((st.get("serverVersions") or {}).values())
    holding = f"{sum(v == version for v in held)}/{len(held)} " if held else ""
    st.condition(
        "WeightsSynced",
        version > 0,
        "PolicyVersion" if version else "NotSynced",
        f"{holding}rollout servers hold policy version {version}"
        if version
        else "no weights synced to the rollout servers yet",
    )
    if running:
        st.phase("Running", "Normal", "Running", f"{replicas} learner pods running")
        st.condition("Running", True, "LearnerRunning", f"{replicas} learner pods running")
        if st.condition_of("Restarting"):
            st.condition("Restarting", False, "Recovered", f"learner group {restarts} running")
    elif st.condition_of("Restarting"):
        message = f"waiting for the learner group (restart {restarts}) to run again"
        st.phase("Restarting", "Warning", "Restarting", message, event=False)
        st.condition("Running", False, "Restarting", message)
    elif observed.failed_create and len(current) < replicas:
        # The pods do not exist: the API server refuses them, and the Job controller says why.
        message = f"{len(current)}/{replicas} learner pods created; {observed.failed_create}"
        st.phase("Pending", "Warning", "FailedCreate", message)
        st.condition("Running", False, "FailedCreate", message)
    elif (claim := observed.claim) is not None and claim.phase != "Bound" and claim.warning:
        # The pods cannot start before their claim binds; the provisioner says why it does not.
        message = f"checkpoint claim {claim.name} is {claim.phase}: {claim.warning}"
        st.phase("Pending", "Warning", "ClaimPending", message)
        st.condition("Running", False, "ClaimPending", message)
    else:
        waiting = next((p for p in current if p.phase == "Pending" and p.message), None)
        why = f"; {waiting.name}: {waiting.message}" if waiting else ""
        message = (
            f"{sum(p.phase == 'Running' for p in current)}/{replicas} learner pods running{why}"
        )
        st.phase("Pending", "Normal", "Pending", message)
        st.condition("Running", False, "PodsPending", message)
    return Outcome(st.done(), st.events, suspend_jobset=resume)


def _suspended(st: _Status, why: str) -> None:
    st.phase(
        "Suspended",
        "Normal",
        "Suspended",
        "JobSet suspended: learner pods stop after a final checkpoint, servers stop",
    )
    st.condition("Suspended", True, "Suspended", why)
    st.condition("Running", False, "Suspended", "the job is suspended")


def _queued(st: _Status, spec: GSPOJobSpec, js: JobSetView, observed: Observed) -> Outcome | None:
    """A queued job on a cluster with Kueue, which owns its JobSet's suspend: Kueue unsuspends
    an admitted JobSet and suspends one it evicts, so the operator never patches it (a
    suspended, admitted JobSet is unsuspended again at once, every pod deleted each round).
    Suspend deactivates the Workload (`spec.active: false`, Kueue's way to stop a job),
    resume activates it again. An Outcome while Kueue holds the JobSet; None once it runs."""
    queue, wl = spec.run_policy.scheduling.queue, observed.workload
    if spec.run_policy.suspend:
        where = f"; Workload {wl.name} deactivated (spec.active: false)" if wl else ""
        _suspended(st, f"runPolicy.suspend is true{where}")
        if wl is None:  # nothing to deactivate: with no Workload Kueue lets it be suspended
            return Outcome(st.done(), st.events, suspend_jobset=True if not js.suspended else None)
        return Outcome(st.done(), st.events, activate_workload=False if wl.active else None)
    activate = True if wl is not None and not wl.active else None
    if st.condition_of("Suspended"):
        st.condition("Suspended", False, "Resumed", "resuming from the latest checkpoint")
        st.data.pop("startTime", None)  # the deadline counts from the next start
    if wl is not None and wl.admitted() and not js.suspended:
        st.condition("Queued", False, "Admitted", f"admitted by ClusterQueue {wl.cluster_queue}")
        return None
    if not js.suspended:
        return None  # running; Kueue suspends it if its Workload is not admitted
    if wl is not None:
        reason, why = wl.waiting()
        why = f"Workload {wl.name}: {why}"
    elif observed.workload_error:
        reason, why = "WorkloadUnreadable", observed.workload_error
    else:
        reason = "WorkloadMissing"
        why = "Kueue has made no Workload for the JobSet yet (is its JobSet integration enabled?)"
    message = f"waiting for Kueue to admit the JobSet (LocalQueue {queue}); {why}"
    # Time in the queue is not running time: like a Job's, the deadline counts from the start.
    st.data.pop("startTime", None)
    st.phase("Pending", "Normal", "Queued", message)
    st.condition("Running", False, "Queued", message)
    st.condition("Queued", True, reason, why)
    return Outcome(st.done(), st.events, activate_workload=activate)


def _disruption_limit(st: _Status, limit: int, js: JobSetView) -> Outcome | None:
    """Fail the job once JobSet restarted it after more disruptions than the spec allows.

    The failure policy restarts a disrupted learner with RestartJobSetAndIgnoreMaxRestarts, so
    JobSet never stops on its own. A Job's podFailurePolicy can match the DisruptionTarget
    condition but not its reason, so a kubelet's node-pressure eviction (TerminationByKubelet)
    looks like a preemption there; the operator counts them all instead: JobSet's restarts
    less those that counted towards maxRestarts."""
    disruptions = js.restarts - js.restarts_counted
    if disruptions <= limit:
        return None
    out = _finish(
        st,
        "Failed",
        "DisruptionLimitExceeded",
        f"JobSet restarted the job's pods after {disruptions} disruptions (preemption, eviction, "
        f"node drain or shutdown), more than runPolicy.maxDisruptionRestarts={limit}. A learner "
        "evicted for node memory pressure is restarted without end: give the learner a memory "
        "limit (learner.resources.limits.memory), or raise maxDisruptionRestarts",
    )
    st.set(restarts=js.restarts)
    out.delete_jobset = True  # stop the pods JobSet would otherwise restart again
    return out


def _failure(
    spec: GSPOJobSpec, observed: Observed, js: JobSetView, reason: str, message: str
) -> tuple[str, str]:
    """Reason and message of a failed JobSet, with the pod's own words where there are any."""
    pods = [p for p in observed.pods if p.phase == "Failed" and p.message]
    invalid = next((p for p in pods if p.role == names.LEARNER and p.exit_code == 2), None)
    if invalid is not None:
        return "InvalidConfig", (
            f"learner pod {invalid.name} refused its configuration (exit code 2, not retried): "
            f"{invalid.message}"
        )
    refused = next((p for p in pods if p.role == names.SANDBOX and p.exit_code == 2), None)
    if refused is not None:
        return "SandboxRefused", (
            f"sandbox pod {refused.name} cannot run programs on its node (exit code 2, not "
            f"retried): {refused.message}"
        )
    why = _why_failed(observed, js.restarts)
    role = first_failed_role(message)
    if role is None:  # a message without the Job's name: the failed pods say which role
        roles = {p.role for p in pods}
        role = next((r for r in (names.ROLLOUT, names.SANDBOX) if r in roles), None)
    if js.restarts >= spec.run_policy.backoff_limit and "Restart" in reason + message:
        reason = "BackoffLimitExceeded"
    elif role == names.ROLLOUT and not why:
        reason = "RolloutFailed"
    elif role == names.SANDBOX and not why:
        reason = "SandboxFailed"
    text = f"JobSet: {message}" + (f"; {why}" if why else "")
    return reason or "JobSetFailed", text


def first_failed_role(message: str) -> str | None:
    """The replicated job (role) of the Job a JobSet failure message names, else None.

    JobSet appends " (first failed job: <jobset>-<replicatedJob>-<index>)" to the Failed
    condition's message (messageWithFirstFailedJob, pkg/controllers/failure_policy.go); the
    role names hold no '-', so the role is the part before the index."""
    match = re.search(r"\(first failed job: ([^)\s]+)\)", message)
    if match is None:
        return None
    head, _, index = match.group(1).rpartition("-")
    role = head.rpartition("-")[2]
    return (
        role if index.isdigit() and role in (names.LEARNER, names.ROLLOUT, names.SANDBOX) else None
    )


def _remembered_failure(prev: Mapping[str, Any], attempt: int) -> str:
    """The failed pods' words a previous status kept for group `attempt`, or ""."""
    kept = prev.get("learnerFailure") or {}
    return str(kept.get("message") or "") if kept.get("restartAttempt") == attempt else ""


def _why_failed(observed: Observed, attempt: int) -> str:
    failed = [
        p
        for p in observed.pods
        if p.role == names.LEARNER and p.restart_attempt == attempt and p.phase == "Failed"
    ]
    return "; ".join(
        f"pod {p.name} failed" + (f": {p.message}" if p.message else "") for p in failed
    )


def created(previous: Mapping[str, Any] | None, now: datetime, count: int) -> dict[str, Any]:
    """Status right after the children were created (the create/resume handler)."""
    st = _Status(dict(previous or {}), now)
    st.condition("Created", True, "ChildrenCreated", f"{count} child objects exist")
    if not st.get("phase"):
        st.phase("Pending", "Normal", "Pending", "children created")
    st.set(startTime=st.get("startTime") or st.now)
    return st.done()


def jobset_missing(previous: Mapping[str, Any], now: datetime, message: str) -> dict[str, Any]:
    """Pending, with the fix named, while the cluster serves no JobSet API."""
    st = _Status(dict(previous), now)
    st.phase("Pending", "Warning", "JobSetMissing", message, event=False)
    st.condition("Created", False, "JobSetMissing", message)
    st.condition("Running", False, "JobSetMissing", message)
    return st.done()


def invalid_spec(
    previous: Mapping[str, Any] | None, now: datetime, problems: Iterable[Problem]
) -> tuple[dict[str, Any], Event]:
    """Failed with an InvalidSpec condition naming every bad field; no child is created."""
    message = "; ".join(str(p) for p in problems)
    st = _Status(dict(previous or {}), now)
    st.phase("Failed", "Warning", "InvalidSpec", message, event=False)
    st.condition("InvalidSpec", True, "InvalidSpec", message)
    st.condition("Failed", True, "InvalidSpec", message)
    return st.done(), Event("Warning", "InvalidSpec", message)


def refused_change(
    previous: Mapping[str, Any] | None, now: datetime, fields: list[str]
) -> tuple[dict[str, Any], Event]:
    """A spec change that cannot apply in flight: say so, keep running the accepted spec."""
    allowed = ", ".join(f"spec.{f}" for f in MUTABLE_FIELDS)
    message = (
        f"cannot change {', '.join(f'spec.{f}' for f in fields)} of a running job; "
        f"the job keeps its previous spec. Only {allowed} change in flight; "
        "revert the edit, or delete and re-create the job"
    )
    st = _Status(dict(previous or {}), now)
    st.condition("InvalidSpec", True, "SpecChangeRefused", message)
    return st.done(), Event("Warning", "SpecChangeRefused", message)


def accepted_change(previous: Mapping[str, Any] | None, now: datetime) -> dict[str, Any]:
    st = _Status(dict(previous or {}), now)
    if st.condition_of("InvalidSpec"):
        st.condition("InvalidSpec", False, "SpecAccepted", "the current spec is in effect")
    return st.done()


def invalid_change(
    previous: Mapping[str, Any] | None, now: datetime, problems: Iterable[Problem]
) -> tuple[dict[str, Any], Event]:
    """A running job edited into an invalid spec: say why, keep running the accepted one."""
    message = "; ".join(str(p) for p in problems) + "; the job keeps its previous spec"
    st = _Status(dict(previous or {}), now)
    st.condition("InvalidSpec", True, "InvalidSpec", message)
    return st.done(), Event("Warning", "InvalidSpec", message)


def api_refused(
    previous: Mapping[str, Any] | None, now: datetime, verdict: str, reason: str, message: str
) -> tuple[dict[str, Any], Event]:
    """The API server refused a child: Blocked while an admin can clear it (RBAC, quota, a
    kind not installed, a name taken), Failed when the object itself is invalid."""
    st = _Status(dict(previous or {}), now)
    if verdict == "invalid":
        out = _finish(st, "Failed", reason, message)
        return out.status, Event("Warning", reason, message)
    st.phase("Blocked", "Warning", reason, message, event=False)
    st.condition("Blocked", True, reason, message)
    st.condition("Running", False, reason, message)
    return st.done(), Event("Warning", reason, message)


def unblocked(previous: Mapping[str, Any] | None, now: datetime) -> dict[str, Any]:
    """Every child was accepted again: the Blocked condition clears."""
    st = _Status(dict(previous or {}), now)
    if st.condition_of("Blocked"):
        st.condition("Blocked", False, "Cleared", "the API server accepted every child")
        if st.get("phase") == "Blocked":
            st.data["phase"] = "Pending"
    return st.done()


def refused_fields(accepted: GSPOJobSpec, new: GSPOJobSpec) -> list[str]:
    """Dotted camelCase paths that differ between the two specs and cannot change in flight."""
    before, after = _flatten(accepted.to_manifest_dict()), _flatten(new.to_manifest_dict())
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return [k for k in changed if not any(k == m or k.startswith(m + ".") for m in MUTABLE_FIELDS)]


# --- helpers ------------------------------------------------------------------------------


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: node}


def _finish(st: _Status, phase: str, reason: str, message: str) -> Outcome:
    st.phase(phase, "Normal" if phase == "Succeeded" else "Warning", reason, message)
    st.condition(phase, True, reason, message)
    st.condition("Running", False, reason, message)
    st.set(completionTime=st.now)
    return Outcome(st.done(), st.events)


def _record_progress(st: _Status, progress: LearnerProgress | None) -> None:
    if progress is None:
        return
    st.set(step=progress.step, policyVersion=progress.policy_version)
    if progress.server_versions:
        st.set(serverVersions=dict(progress.server_versions))
    if progress.reward is not None:
        st.set(reward=round(progress.reward, 4))
    if progress.last_checkpoint:
        st.set(lastCheckpoint=progress.last_checkpoint)


def parse_time(stamp: str) -> datetime:
    """A status timestamp (RFC 3339, 'Z') as an aware datetime."""
    return _parse(stamp)


def _parse(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


class _Status:
    """A status dict being edited: conditions keep their transition time unless they flip."""

    def __init__(self, prev: dict[str, Any], now: datetime) -> None:
        self.data = {k: v for k, v in prev.items() if v is not None}
        self.data["conditions"] = [dict(c) for c in prev.get("conditions") or []]
        self.data.setdefault("restarts", 0)
        self.now = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        self.events: list[Event] = []

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def set(self, **fields: Any) -> None:
        for key, value in fields.items():
            if value is not None:
                self.data[key] = value

    def condition_of(self, type_: str) -> bool:
        return any(c["type"] == type_ and c["status"] == "True" for c in self.data["conditions"])

    def phase(self, phase: str, kind: str, reason: str, message: str, event: bool = True) -> None:
        if self.data.get("phase") != phase and event:
            self.events.append(Event(kind, reason, message))
        self.data["phase"] = phase

    def condition(self, type_: str, status: bool, reason: str, message: str) -> None:
        value = "True" if status else "False"
        conditions = self.data["conditions"]
        for cond in conditions:
            if cond["type"] == type_:
                if cond["status"] != value:
                    cond["lastTransitionTime"] = self.now
                cond.update(status=value, reason=reason, message=message)
                return
        conditions.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": self.now,
            }
        )

    def done(self) -> dict[str, Any]:
        return self.data
