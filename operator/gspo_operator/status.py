"""An Observation of one job -> the GSPOJob's status and what to do. Pure.

JobSet carries the failure policy (restarts, what fails the job) and the Job controller the
pods; `compute` reads what they report, with the spec's problems and what creating the
children met, adds the operator's own rules (suspend, deadline, TTL) and returns the new
status, the Events to post and the actions to take (see docs/operator.md). Every phase and
condition the operator writes is set here, through the `Phase` and `ConditionType` literals,
so every transition is tested as a table without an API server or a clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, get_args

from gspo_api.progress import LearnerProgress
from gspo_api.spec import GSPOJobSpec, Phase
from gspo_api.validation import Problem
from gspo_operator import names
from gspo_operator.views import JobSetView, Observed, PodView

TERMINAL: tuple[Phase, ...] = ("Succeeded", "Failed")
_PHASES: dict[str, Phase] = {phase: phase for phase in get_args(Phase)}
# Every condition type the operator writes (kubectl wait --for=condition=<type>).
ConditionType = Literal[
    "Created",
    "InvalidSpec",
    "Blocked",
    "Queued",
    "Suspended",
    "Running",
    "Restarting",
    "LearnerReady",
    "RolloutReady",
    "WeightsSynced",
    "CodeSandboxed",
    "Succeeded",
    "Failed",
]
EventType = Literal["Normal", "Warning"]
# What a refused request leaves: "invalid" fails the job (the object itself is wrong),
# "blocked" waits for an admin (RBAC, quota, a kind not installed, a name taken).
Verdict = Literal["invalid", "blocked"]


def phase_of(st: Mapping[str, Any]) -> Phase:
    """A status's phase as a Phase (the CRD's enum admits no other); Pending before the
    operator's first write."""
    return _PHASES.get(st.get("phase") or "Pending", "Pending")


JOBSET_MISSING = (
    "the cluster serves no jobset.x-k8s.io/v1alpha2 JobSet API, which runs this job's pods; "
    "install JobSet v0.10 or later (see the chart's README) and the job starts by itself"
)

# Fields that change in flight; any other spec change is refused while the job exists. The
# JobSet's own spec is immutable but for suspend, so these are the operator's to apply.
MUTABLE_FIELDS = (
    "runPolicy.suspend",
    "runPolicy.activeDeadlineSeconds",
    "runPolicy.ttlSecondsAfterFinished",
)


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Refusal:
    """A request the API server refused, in its words: (verdict, reason, message)."""

    verdict: Verdict
    reason: str
    message: str


@dataclass(frozen=True)
class ChildrenSeen:
    """What ensuring the job's children found: how many it wants, what it just created, and
    what stops them (a kind the cluster does not serve, a refused request)."""

    desired: int = 0
    made: int = 0
    jobset_unserved: bool = False
    refusal: Refusal | None = None


@dataclass(frozen=True)
class Observation:
    """Everything `compute` reads: the status as the job shows it, the spec and its
    problems, and what this reconcile saw of the children. A part left None was not looked
    at in this pass (e.g. nothing is observed while a child is refused), and the rules that
    read it are skipped."""

    previous: Mapping[str, Any]
    now: datetime
    spec: GSPOJobSpec | None = None  # the spec in effect; None: refused before any was
    problems: tuple[Problem, ...] = ()  # why the job's current spec is invalid
    refused_fields: tuple[str, ...] = ()  # changed, but not changeable in flight
    generation: int | None = None
    children: ChildrenSeen | None = None
    observed: Observed | None = None
    act_refusal: Refusal | None = None  # an action of the last compute the server refused


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    suspend_jobset: bool | None = None  # set the JobSet's spec.suspend to this
    activate_workload: bool | None = None  # set the Workload's spec.active to this (Kueue)
    delete_jobset: bool = False  # stop every pod now (deadline exceeded)
    delete_job: bool = False  # ttlSecondsAfterFinished has passed
    # Set when the job cannot go on: write the status now and stop ("invalid": until the
    # job is edited; "blocked": back off and try again).
    halt: Verdict | None = None

    @property
    def phase(self) -> Phase:
        return phase_of(self.status)


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


# --- the rules, in the order compute runs them -----------------------------------------------


def compute(obs: Observation) -> Outcome:
    """The job's next status, the Events to post and the actions to take: every phase and
    condition the operator writes comes from here. The rules run in order, each on the status
    the one before left; a rule that settles the job (a spec refused at creation, a refused
    request) ends the pass."""
    st = _Status(dict(obs.previous), obs.now)
    if obs.spec is None:
        return _spec_refused(obs, st)
    _spec_in_effect(obs, st)
    children = obs.children
    if children is not None:
        _children_created(children, st)
        if children.refusal is not None:
            return _request_refused(obs, st, children.refusal)
        _unblocked(st)
    if obs.observed is None:
        return Outcome(st.done(), st.events)
    out = _lifecycle(obs.spec, obs.observed, st.done(), obs.now, obs.generation)
    out.events[:0] = st.events
    if children is not None and children.jobset_unserved:
        _jobset_unserved(out, obs.now)
    if obs.act_refusal is not None:
        refused = _request_refused(obs, _Status(out.status, obs.now), obs.act_refusal)
        refused.events = st.events + refused.events + out.events[len(st.events) :]
        return refused
    return out


def _spec_refused(obs: Observation, st: _Status) -> Outcome:
    """1. No spec was ever accepted: Failed with InvalidSpec naming every bad field, and no
    child is created. Said once: an unchanged status posts no Event again."""
    message = "; ".join(str(p) for p in obs.problems)
    st.phase("Failed", "Warning", "InvalidSpec", message, event=False)
    st.condition("InvalidSpec", True, "InvalidSpec", message)
    st.condition("Failed", True, "InvalidSpec", message)
    changed = st.data != dict(obs.previous)
    events = [Event("Warning", "InvalidSpec", message)] if changed else []
    return Outcome(st.done(), events, halt="invalid")


def _spec_in_effect(obs: Observation, st: _Status) -> None:
    """2. InvalidSpec of an accepted job. An invalid edit, or one that changes what cannot
    change in flight, keeps the accepted spec and says so once; a spec fixed after the job
    failed for it at creation starts the job afresh; a reverted edit clears InvalidSpec."""
    if obs.problems:
        if not st.condition_of("InvalidSpec"):
            why = "; ".join(str(p) for p in obs.problems) + "; the job keeps its previous spec"
            st.condition("InvalidSpec", True, "InvalidSpec", why)
            st.events.append(Event("Warning", "InvalidSpec", why))
        return
    if rejected_at_creation(st.data):
        kept = [c for c in st.data["conditions"] if c["type"] == "InvalidSpec"]
        st.data = {"conditions": kept, "restarts": 0}
        st.condition("InvalidSpec", False, "SpecAccepted", "the current spec is in effect")
    if obs.refused_fields and not st.condition_of("InvalidSpec"):
        allowed = ", ".join(f"spec.{f}" for f in MUTABLE_FIELDS)
        why = (
            f"cannot change {', '.join(f'spec.{f}' for f in obs.refused_fields)} of a running "
            f"job; the job keeps its previous spec. Only {allowed} change in flight; "
            "revert the edit, or delete and re-create the job"
        )
        st.condition("InvalidSpec", True, "SpecChangeRefused", why)
        st.events.append(Event("Warning", "SpecChangeRefused", why))
    elif not obs.refused_fields and st.condition_of("InvalidSpec"):
        st.condition("InvalidSpec", False, "SpecAccepted", "the current spec is in effect")


def _children_created(children: ChildrenSeen, st: _Status) -> None:
    """3. Created, once every child exists and the job goes on (not while a child is refused
    or the JobSet API is missing, nor for a finished job); the start time counts from it."""
    if children.made:
        st.events.append(Event("Normal", "Created", f"Created {children.made} objects"))
    refused = children.refusal is not None or children.jobset_unserved
    if refused or st.get("phase") in TERMINAL or st.condition_of("Created"):
        return
    st.condition("Created", True, "ChildrenCreated", f"{children.desired} child objects exist")
    if not st.get("phase"):
        st.phase("Pending", "Normal", "Pending", "children created", event=False)
    st.set(startTime=st.get("startTime") or st.now)


def _request_refused(obs: Observation, st: _Status, refusal: Refusal) -> Outcome:
    """4 (a child) and 8 (an action). The API server refused a request: Blocked while an
    admin can clear it (RBAC, quota, a kind not installed, a name taken), Failed when the
    object itself is invalid. The Event is posted when the job becomes so, not every pass."""
    reason, message = refusal.reason, refusal.message
    prev = obs.previous
    if st.get("phase") in TERMINAL and obs.spec is not None:
        return _finished_child_refused(obs.spec, prev, st, refusal, obs.now)
    if refusal.verdict == "invalid":
        _finish(st, "Failed", reason, message, event=False)
    else:
        st.phase("Blocked", "Warning", reason, message, event=False)
        st.condition("Blocked", True, reason, message)
        st.condition("Running", False, reason, message)
    if not _true(prev, "Blocked") or prev.get("phase") != st.get("phase"):
        st.events.append(Event("Warning", reason, message))
    return Outcome(st.done(), st.events, halt=refusal.verdict)


def _finished_child_refused(
    spec: GSPOJobSpec, prev: Mapping[str, Any], st: _Status, refusal: Refusal, now: datetime
) -> Outcome:
    """4, for a Succeeded or Failed job: it stays so. Its phase, reason and completionTime are
    what it ended with; only the Blocked condition tells of the refusal. A Blocked phase would
    not be finished() in the next pass, which would create the JobSet again (its pods rerun),
    ignore the TTL and, once the refusal cleared, make the job Pending. "blocked" either way:
    the job is not to be edited, and its children are tried again after a back-off; the
    TTL still deletes it."""
    reason, message = refusal.reason, refusal.message
    st.condition("Blocked", True, reason, message)
    if not _true(prev, "Blocked"):
        st.events.append(Event("Warning", reason, message))
    expired = _ttl_passed(spec, prev, now)
    return Outcome(st.done(), st.events, delete_job=expired, halt="blocked")


def _unblocked(st: _Status) -> None:
    """5. Every child was accepted again: the Blocked condition clears."""
    if st.condition_of("Blocked"):
        st.condition("Blocked", False, "Cleared", "the API server accepted every child")
        if st.get("phase") == "Blocked":
            st.data["phase"] = "Pending"


def _jobset_unserved(out: Outcome, now: datetime) -> None:
    """7. Pending, with the fix named, while the cluster serves no JobSet API."""
    st = _Status(out.status, now)
    st.phase("Pending", "Warning", "JobSetMissing", JOBSET_MISSING, event=False)
    st.condition("Created", False, "JobSetMissing", JOBSET_MISSING)
    st.condition("Running", False, "JobSetMissing", JOBSET_MISSING)
    out.status = st.done()


def refused_before_creation(previous: Mapping[str, Any]) -> bool:
    """Whether an invalid spec stops the job before anything is made: no child was ever
    created, or the job already failed for its spec at creation."""
    return not _has(previous, "Created") or rejected_at_creation(previous)


def finished(previous: Mapping[str, Any], valid: bool) -> bool:
    """Whether the job stays finished this pass (its pods stay stopped): Succeeded or Failed,
    but for a job refused at creation whose spec is valid now (it starts afresh)."""
    if valid and rejected_at_creation(previous):
        return False
    return previous.get("phase") in TERMINAL


def rejected_at_creation(st: Mapping[str, Any]) -> bool:
    """Failed for an invalid spec before any child existed. The Created condition tells it from
    a job that failed after an invalid edit (InvalidSpec, reason InvalidSpec too): that one's
    children were created, and its failure, status and frozen fields stay."""
    return (
        st.get("phase") == "Failed"
        and not _has(st, "Created")
        and any(
            c["type"] == "InvalidSpec"
            and c.get("reason") == "InvalidSpec"
            and c["status"] == "True"
            for c in st.get("conditions") or []
        )
    )


def _has(st: Mapping[str, Any], type_: ConditionType) -> bool:
    return any(c.get("type") == type_ for c in st.get("conditions") or [])


def _true(st: Mapping[str, Any], type_: ConditionType) -> bool:
    return any(
        c.get("type") == type_ and c.get("status") == "True" for c in st.get("conditions") or []
    )


def _lifecycle(
    spec: GSPOJobSpec,
    observed: Observed,
    previous: Mapping[str, Any],
    now: datetime,
    generation: int | None,
) -> Outcome:
    """6. The job's life as JobSet, Kueue and the pods report it, and the operator's own
    rules over it (suspend, deadline, disruptions, TTL), in this order."""
    prev = dict(previous)
    st = _Status(prev, now)
    _report(st, spec, observed, generation)
    if prev.get("phase") in TERMINAL:
        return _finished(st, spec, prev, now)
    js = observed.jobset
    if js is None:
        st.phase("Pending", "Normal", "Pending", "creating the JobSet")
        st.condition("Running", False, "JobSetMissing", "the job's JobSet does not exist yet")
        return Outcome(st.done(), st.events)
    held, resume = _held(st, spec, js, observed)
    if held is not None:
        return held
    ended = (
        _deadline(st, spec, now)
        or _jobset_ended(st, spec, observed, js)
        or _disruption_limit(st, spec.run_policy.max_disruption_restarts, js)
    )
    if ended is not None:
        return ended
    _restarts(st, spec, observed, js.restarts, prev)
    learners = observed.learners(js.restarts)
    _readiness(st, spec, observed, learners)
    _learner_phase(st, spec, observed, learners, js.restarts)
    return Outcome(st.done(), st.events, suspend_jobset=resume)


def _report(st: _Status, spec: GSPOJobSpec, observed: Observed, generation: int | None) -> None:
    """6a. What every pass reports: the generation, progress, ready servers, code sandbox."""
    st.set(observedGeneration=generation)
    _record_progress(st, observed.progress)
    st.set(rolloutReady=f"{observed.rollout_ready()}/{spec.rollout.replicas}")
    _code_sandbox(st, spec)


def _finished(st: _Status, spec: GSPOJobSpec, prev: Mapping[str, Any], now: datetime) -> Outcome:
    """6b. A finished job stays so; ttlSecondsAfterFinished after it ended, it is deleted."""
    return Outcome(st.done(), delete_job=_ttl_passed(spec, prev, now))


def _ttl_passed(spec: GSPOJobSpec, prev: Mapping[str, Any], now: datetime) -> bool:
    """ttlSecondsAfterFinished has passed since the job finished (its completionTime)."""
    done = prev.get("completionTime")
    ttl = spec.run_policy.ttl_seconds_after_finished
    if ttl is None or not done:
        return False
    return now >= _parse(done) + timedelta(seconds=ttl)


def _held(
    st: _Status, spec: GSPOJobSpec, js: JobSetView, observed: Observed
) -> tuple[Outcome | None, bool | None]:
    """6c. Queued in Kueue or suspended: an Outcome while held. Else None, and the JobSet's
    suspend to set (False to resume it) or None."""
    policy = spec.run_policy
    if policy.scheduling.queue and observed.kueue:
        return _queued(st, spec, js, observed), None
    if policy.suspend:
        _suspended(st, "runPolicy.suspend is true")
        suspend = True if not js.suspended else None
        return Outcome(st.done(), st.events, suspend_jobset=suspend), None
    # By the condition, not the JobSet: the watch may show the JobSet's suspend only after
    # the resume, and the phase has moved on by then.
    if st.condition_of("Suspended"):
        st.condition("Suspended", False, "Resumed", "resuming from the latest checkpoint")
        st.set(startTime=st.now)  # the deadline counts running time since the resume
    return None, False if js.suspended else None


def _deadline(st: _Status, spec: GSPOJobSpec, now: datetime) -> Outcome | None:
    """6d. activeDeadlineSeconds of running time passed: Failed, and every pod stopped."""
    start = _parse(st.get("startTime") or st.now)
    st.set(startTime=st.get("startTime") or st.now)
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is None or now < start + timedelta(seconds=deadline):
        return None
    why = f"ran longer than runPolicy.activeDeadlineSeconds={deadline}"
    out = _finish(st, "Failed", "DeadlineExceeded", why)
    out.delete_jobset = True
    return out


def _jobset_ended(
    st: _Status, spec: GSPOJobSpec, observed: Observed, js: JobSetView
) -> Outcome | None:
    """6e. JobSet failed (with the pods' own words) or completed."""
    if (failed := js.true("Failed")) is not None:
        reason, message = _failure(spec, observed, js, *failed)
        return _finish(st, "Failed", reason, message)
    if js.true("Completed") is None:
        return None
    # The learner Job completes only once the learner exited 0 at maxSteps (a stopped one
    # is deleted, not completed); its /progress is gone by now, so the last read may lag.
    st.set(step=spec.algorithm.max_steps)
    message = f"every learner pod exited 0 at step {st.get('step')}"
    return _finish(st, "Succeeded", "Completed", message)


def _restarts(
    st: _Status, spec: GSPOJobSpec, observed: Observed, restarts: int, prev: Mapping[str, Any]
) -> None:
    """6g. A JobSet restart is reported once, with the failed pods' words (kept: JobSet
    deletes the failed group's pods once it restarts, often before the operator sees it)."""
    if seen := _why_failed(observed, restarts):
        st.set(learnerFailure={"restartAttempt": restarts, "message": seen})
    if restarts > int(prev.get("restarts") or 0):
        why = (
            _why_failed(observed, restarts - 1)
            or _remembered_failure(prev, restarts - 1)
            or "a learner pod failed"
        )
        message = (
            f"{why}; JobSet restarted the job's pods from the latest checkpoint "
            f"(restart {restarts}, runPolicy.backoffLimit={spec.run_policy.backoff_limit})"
        )
        st.events.append(Event("Warning", "LearnerRestart", message))
        st.condition("Restarting", True, "LearnerPodFailed", message)
    st.set(restarts=restarts)


def _readiness(st: _Status, spec: GSPOJobSpec, observed: Observed, learners: list[PodView]) -> None:
    """6h. LearnerReady, RolloutReady (with the API server's refusal of a server's pod) and
    WeightsSynced (the policy version the servers hold)."""
    replicas, desired = spec.learner.replicas, spec.rollout.replicas
    ready = sum(p.ready and p.phase == "Running" for p in learners)
    st.condition(
        "LearnerReady",
        ready == replicas,
        "PodsReady" if ready == replicas else "PodsNotReady",
        f"{ready}/{replicas} learner pods ready",
    )
    ready_servers = observed.rollout_ready()
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


def _learner_phase(
    st: _Status, spec: GSPOJobSpec, observed: Observed, learners: list[PodView], restarts: int
) -> None:
    """6i. The phase and Running from the learner group: Running once every pod runs;
    Restarting after a restart until then; else Pending with why the pods do not run (the
    API server refuses them, the claim does not bind, a pod's own reason)."""
    replicas = spec.learner.replicas
    if len(learners) == replicas and all(p.phase == "Running" for p in learners):
        st.phase("Running", "Normal", "Running", f"{replicas} learner pods running")
        st.condition("Running", True, "LearnerRunning", f"{replicas} learner pods running")
        if st.condition_of("Restarting"):
            st.condition("Restarting", False, "Recovered", f"learner group {restarts} running")
        return
    if st.condition_of("Restarting"):
        message = f"waiting for the learner group (restart {restarts}) to run again"
        st.phase("Restarting", "Warning", "Restarting", message, event=False)
        st.condition("Running", False, "Restarting", message)
        return
    claim = observed.claim
    kind: EventType = "Warning"
    if observed.failed_create and len(learners) < replicas:
        # The pods do not exist: the API server refuses them, and the Job controller says why.
        reason = "FailedCreate"
        message = f"{len(learners)}/{replicas} learner pods created; {observed.failed_create}"
    elif claim is not None and claim.phase != "Bound" and claim.warning:
        # The pods cannot start before their claim binds; the provisioner says why it does not.
        reason = "ClaimPending"
        message = f"checkpoint claim {claim.name} is {claim.phase}: {claim.warning}"
    else:
        waiting = next((p for p in learners if p.phase == "Pending" and p.message), None)
        why = f"; {waiting.name}: {waiting.message}" if waiting else ""
        running = sum(p.phase == "Running" for p in learners)
        kind, reason, message = (
            "Normal",
            "Pending",
            f"{running}/{replicas} learner pods running{why}",
        )
    st.phase("Pending", kind, reason, message)
    st.condition("Running", False, "PodsPending" if reason == "Pending" else reason, message)


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


def _finish(
    st: _Status,
    phase: Literal["Succeeded", "Failed"],
    reason: str,
    message: str,
    event: bool = True,
) -> Outcome:
    st.phase(phase, "Normal" if phase == "Succeeded" else "Warning", reason, message, event)
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

    def condition_of(self, type_: ConditionType) -> bool:
        return any(c["type"] == type_ and c["status"] == "True" for c in self.data["conditions"])

    def phase(
        self, phase: Phase, kind: EventType, reason: str, message: str, event: bool = True
    ) -> None:
        if self.data.get("phase") != phase and event:
            self.events.append(Event(kind, reason, message))
        self.data["phase"] = phase

    def condition(self, type_: ConditionType, status: bool, reason: str, message: str) -> None:
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
