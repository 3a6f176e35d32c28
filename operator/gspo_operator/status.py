"""Observed children + learner progress -> the GSPOJob's status and what to do next. Pure.

`compute` holds the whole lifecycle and failure policy (see docs/operator.md): it reads
plain data and returns the new status, the Events to post and the actions to take, so every
transition is tested as a table without an API server or a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gspo_operator import names
from gspo_trainer.config import GSPOJobSpec
from gspo_trainer.progress import LearnerProgress
from gspo_trainer.validation import Problem

TERMINAL = ("Succeeded", "Failed")
# Fields that change in flight; any other spec change is refused while the job exists.
MUTABLE_FIELDS = (
    "rollout.replicas",
    "runPolicy.suspend",
    "runPolicy.backoffLimit",
    "runPolicy.activeDeadlineSeconds",
    "runPolicy.ttlSecondsAfterFinished",
)


@dataclass(frozen=True)
class PodView:
    """What the status needs from one learner pod."""

    name: str
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    restart: int = 0  # the learner group generation the pod belongs to
    deleting: bool = False
    ip: str | None = None
    message: str = ""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodView:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        terminated = [
            cs.get("state", {}).get("terminated") or {}
            for cs in status.get("containerStatuses") or []
        ]
        message = status.get("message") or "; ".join(
            f"{t.get('reason', 'Error')} (exit code {t.get('exitCode')})" for t in terminated if t
        )
        return cls(
            name=meta.get("name", ""),
            phase=status.get("phase") or "Pending",
            ready=conditions.get("Ready") == "True",
            restart=int((meta.get("annotations") or {}).get(names.RESTART_ANNOTATION, 0)),
            deleting=bool(meta.get("deletionTimestamp")),
            ip=status.get("podIP"),
            message=message,
        )


@dataclass(frozen=True)
class Observed:
    learner_pods: list[PodView] = field(default_factory=list)
    rollout_ready: int = 0
    rollout_replicas: int | None = None  # the Deployment's spec.replicas; None when absent
    progress: LearnerProgress | None = None


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    ensure_children: bool = False  # create whatever child is missing (existing ones stay)
    delete_pods: list[str] = field(default_factory=list)  # learner pods to delete (SIGTERM)
    rollout_replicas: int | None = None  # scale the rollout Deployment to this
    delete_job: bool = False  # ttlSecondsAfterFinished has passed


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
    restarts = int(prev.get("restarts") or 0)
    policy = spec.run_policy
    pods = observed.learner_pods
    current = [p for p in pods if p.restart == restarts and not p.deleting]
    stale = [p.name for p in pods if p.restart < restarts]
    alive = [p.name for p in pods if not p.deleting and p.phase in ("Pending", "Running")]
    _record_progress(st, observed.progress)
    desired = spec.rollout.replicas
    st.set(rolloutReady=f"{observed.rollout_ready}/{desired}")

    phase = prev.get("phase")
    if phase in TERMINAL:
        out = Outcome(st.done(), delete_pods=alive, rollout_replicas=0)
        done = prev.get("completionTime")
        ttl = policy.ttl_seconds_after_finished
        if ttl is not None and done and now >= _parse(done) + timedelta(seconds=ttl):
            out.delete_job = True
        return out

    if policy.suspend:
        st.phase(
            "Suspended",
            "Normal",
            "Suspended",
            "Learner pods stop after a final checkpoint; rollout scaled to 0",
        )
        st.condition("Suspended", True, "Suspended", "runPolicy.suspend is true")
        st.condition("Running", False, "Suspended", "the job is suspended")
        return Outcome(st.done(), st.events, delete_pods=alive, rollout_replicas=0)
    if phase == "Suspended":
        st.condition("Suspended", False, "Resumed", "resuming from the latest checkpoint")
        st.set(startTime=st.now)  # the deadline counts running time since the resume

    start = _parse(st.get("startTime") or st.now)
    st.set(startTime=st.get("startTime") or st.now)
    deadline = policy.active_deadline_seconds
    if deadline is not None and now >= start + timedelta(seconds=deadline):
        return _finish(
            st,
            "Failed",
            "DeadlineExceeded",
            f"ran longer than runPolicy.activeDeadlineSeconds={deadline}",
            alive,
        )

    failed = [p for p in current if p.phase == "Failed"]
    if failed:
        why = "; ".join(
            f"pod {p.name} failed" + (f": {p.message}" if p.message else "") for p in failed
        )
        if restarts >= policy.backoff_limit:
            return _finish(
                st,
                "Failed",
                "BackoffLimitExceeded",
                f"{why}; runPolicy.backoffLimit={policy.backoff_limit} restarts already used",
                alive,
            )
        restarts += 1
        st.set(restarts=restarts)
        message = (
            f"{why}; restarting the learner group from the latest checkpoint "
            f"(restart {restarts} of {policy.backoff_limit})"
        )
        st.events.append(Event("Warning", "LearnerRestart", message))
        st.phase("Restarting", "Warning", "Restarting", message, event=False)
        st.condition("Restarting", True, "LearnerPodFailed", message)
        st.condition("Running", False, "Restarting", message)
        st.condition("LearnerReady", False, "Restarting", message)
        return Outcome(st.done(), st.events, delete_pods=[p.name for p in pods if not p.deleting])

    replicas = spec.learner.replicas
    if len(current) == replicas and all(p.phase == "Succeeded" for p in current):
        return _finish(
            st,
            "Succeeded",
            "Completed",
            f"every learner pod exited 0 at step {st.get('step') or 0}",
            [],
        )

    ready = sum(p.ready and p.phase == "Running" for p in current)
    running = len(current) == replicas and all(p.phase == "Running" for p in current)
    st.condition(
        "LearnerReady",
        ready == replicas,
        "PodsReady" if ready == replicas else "PodsNotReady",
        f"{ready}/{replicas} learner pods ready",
    )
    rollout_ok = desired > 0 and observed.rollout_ready >= desired
    st.condition(
        "RolloutReady",
        rollout_ok,
        "ServersReady" if rollout_ok else "ServersNotReady",
        f"{observed.rollout_ready}/{desired} rollout servers ready "
        "(ready means holding synced weights)",
    )
    version = st.get("policyVersion") or 0
    st.condition(
        "WeightsSynced",
        version > 0,
        "PolicyVersion" if version else "NotSynced",
        f"rollout servers hold policy version {version}"
        if version
        else "no weights synced to the rollout servers yet",
    )
    if stale or (phase == "Restarting" and not running):
        message = f"waiting for the learner group (restart {restarts}) to run again"
        st.phase("Restarting", "Warning", "Restarting", message, event=False)
        st.condition("Running", False, "Restarting", message)
    elif running:
        st.phase("Running", "Normal", "Running", f"{replicas} learner pods running")
        st.condition("Running", True, "LearnerRunning", f"{replicas} learner pods running")
        if phase == "Restarting" or "Restarting" in st.types():
            st.condition("Restarting", False, "Recovered", f"learner group {restarts} running")
    else:
        st.phase("Pending", "Normal", "Pending", f"{len(current)}/{replicas} learner pods exist")
        st.condition("Running", False, "PodsPending", "waiting for learner pods to run")
    return Outcome(
        st.done(), st.events, ensure_children=True, delete_pods=stale, rollout_replicas=desired
    )


def created(previous: Mapping[str, Any] | None, now: datetime, count: int) -> dict[str, Any]:
    """Status right after the children were created (the create/resume handler)."""
    st = _Status(dict(previous or {}), now)
    st.condition("Created", True, "ChildrenCreated", f"{count} child objects exist")
    if not st.get("phase"):
        st.phase("Pending", "Normal", "Pending", "children created")
    st.set(startTime=st.get("startTime") or st.now)
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


def _finish(st: _Status, phase: str, reason: str, message: str, alive: list[str]) -> Outcome:
    st.phase(phase, "Normal" if phase == "Succeeded" else "Warning", reason, message)
    st.condition(phase, True, reason, message)
    st.condition("Running", False, reason, message)
    st.set(completionTime=st.now)
    return Outcome(st.done(), st.events, delete_pods=alive, rollout_replicas=0)


def _record_progress(st: _Status, progress: LearnerProgress | None) -> None:
    if progress is None:
        return
    st.set(step=progress.step, policyVersion=progress.policy_version)
    if progress.reward is not None:
        st.set(reward=round(progress.reward, 4))
    if progress.last_checkpoint:
        st.set(lastCheckpoint=progress.last_checkpoint)


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

    def types(self) -> set[str]:
        return {c["type"] for c in self.data["conditions"]}

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
