"""A stand-in for kube-controller-manager's Job controller (batch/v1) in the local cluster.

The operator's JobSets become Jobs, and Jobs become pods only through this controller, so the
local cluster needs one whose pod names, labels, hostnames, counters and conditions are the ones
a real cluster produces. Written from Kubernetes' own sources and docs, read through the search
index (not from the gspo operator): kubernetes/kubernetes pkg/controller/job/job_controller.go
(syncJob, manageJob, trackJobStatusAndRemoveFinalizers, enactJobFinished, isPodFailed,
pastBackoffLimitOnFailure, getFailJobMessage), pkg/controller/job/pod_failure_policy.go
(matchPodFailurePolicy and its exact FailJob messages), pkg/controller/job/indexed_job_utils.go
(firstPendingIndexes, completedIndexes intervals, podGenerateNameWithIndex,
addCompletionIndexEnvVariables), pkg/controller/job/util (trackTerminatingPods,
onlyReplaceFailedPods), pkg/apis/batch/v1/defaults.go and pkg/apis/batch/validation (defaults
and the podFailurePolicy / restartPolicy checks), and the Job concept page on kubernetes.io.

Implemented (a level-triggered loop that re-reads every Job and its pods each ~0.1 s):
- Pods from `spec.template`, owned by the Job (ownerReference controller/blockOwnerDeletion),
  with labels batch.kubernetes.io/job-name, batch.kubernetes.io/controller-uid, job-name and
  controller-uid (kube-apiserver puts these on the Job's template; this stand-in's API server
  cannot, it assigns the uid after admission, so the controller adds them to each pod). Indexed
  mode: pod name `<job>-<index>-<5 random chars>` (the prefix cut to 58 characters as
  podGenerateNameWithIndex does), annotation and label batch.kubernetes.io/job-completion-index,
  hostname `<job>-<index>` (the template's subdomain kept), and env JOB_COMPLETION_INDEX from a
  fieldRef to that annotation on every container and init container that lacks it. NonIndexed:
  `<job>-<5 random chars>`.
- parallelism / completions (wantActive = min(parallelism, completions - succeeded); without
  completions, parallelism until the first success); excess or duplicate-index pods deleted
  (not-ready, unscheduled, pending and newest first); the lowest pending indexes created first;
  a replaced pod keeps its index.
- podReplacementPolicy as defaulted by the API (Failed when podFailurePolicy is set, else
  TerminatingOrFailed). TerminatingOrFailed: a pod being deleted (deletionTimestamp, not
  Succeeded) counts as failed at once and its replacement is created at once, even while the
  old pod is still terminating (so two pods of one index may coexist, as on a real cluster).
  Failed: a terminating pod blocks its replacement until it is Failed or gone.
- Counters: status.active (pods neither finished nor being deleted), ready (active with
  condition Ready=True), terminating (being deleted, not finished), succeeded, failed,
  completedIndexes ("0-2,4" intervals, "0,1" for a pair), startTime (first sync while not
  suspended; reset on resume), completionTime, uncountedTerminatedPods {}.
- backoffLimit (default 6): failed > backoffLimit fails the Job with reason
  BackoffLimitExceeded, message "Job has reached the specified backoff limit"; for
  restartPolicy OnFailure also the sum of containers' restartCount of running/pending pods
  (>= backoffLimit, or > 0 when it is 0). activeDeadlineSeconds: DeadlineExceeded, "Job was
  active longer than specified deadline".
- podFailurePolicy rules in order, first match wins: onExitCodes (operator In/NotIn,
  containerName, non-zero exit codes of terminated containers, then init containers) and
  onPodConditions (type, status default True, e.g. DisruptionTarget); actions FailJob
  (reason PodFailurePolicy, message "Container <c> for pod <ns>/<pod> failed with exit code <n>
  matching FailJob rule at index <i>" or "Pod <ns>/<pod> has condition <Type> matching FailJob
  rule at index <i>"), Ignore (not counted towards backoffLimit, replaced), Count.
- Terminal conditions in two steps as with JobPodReplacementPolicy/JobManagedBy on (the
  default since 1.31): a failing Job deletes its active pods (counting every uncounted
  unfinished pod as failed, as the real controller does), gets FailureTarget, and gets Failed
  (same reason and message) once no pod is terminating; a Job whose completions are reached
  gets SuccessCriteriaMet and then Complete (reason CompletionsReached, message "Reached
  expected number of succeeded pods") with completionTime once nothing is terminating.
- suspend: active pods deleted (not counted as failed), condition Suspended=True (JobSuspended,
  "Job suspended"), status.active 0, no startTime while suspended; resuming sets Suspended=False
  (JobResumed, "Job resumed"), resets startTime and recreates the pods.
- Jobs with spec.managedBy other than kubernetes.io/job-controller are left alone; a Job being
  deleted creates no pods. Deleting a Job deletes its pods through the store's ownerReference
  garbage collection.
- `default_job`, `validate_job`, `admit_job`: the API server's Job defaults (parallelism,
  completions, backoffLimit, completionMode, suspend, podReplacementPolicy, pod restartPolicy
  Always, onPodConditions status True) and its refusals with the real messages: restartPolicy
  must be OnFailure or Never, only Never with a podFailurePolicy, podReplacementPolicy Failed
  with a podFailurePolicy, completions required for Indexed, job names that make too long a
  job-name label value, malformed podFailurePolicy rules.

- A pod the API server refuses (admission: a missing PriorityClass, a quota) is retried on the
  next pass and recorded as the real RealPodControl.createPods does (pkg/controller/
  controller_utils.go): a Warning Event on the Job, reason FailedCreate, message
  "Error creating: <the API server's error>", source job-controller; the real event
  recorder's aggregation of repeats into `count` is not modelled (one Event per message).
- The pod-failure back-off before pods are created again (backoff.py): 10 s doubling per pod
  failure since the Job's last success, capped at 10 minutes, times `time_scale` (TIME_SCALE by
  default, 0.05: 0.5 s to 30 s), on the injectable `clock`.

Not implemented: backoffLimitPerIndex / maxFailedIndexes / the FailIndex action
(a FailIndex rule is skipped), the Job successPolicy (SuccessPolicy reason),
ttlSecondsAfterFinished, spec.selector generation and pod adoption (pods are matched by the
controller ownerReference), expectations and the job-tracking finalizer: instead of a finalizer
this stand-in remembers, per Job, which pod uids it has already counted, and counts a pod that
disappears before it was ever seen Succeeded or Failed as failed (a real pod cannot disappear
uncounted: the finalizer holds it); that memory is lost if the controller object is recreated.
Events are not emitted.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kmock
from backoff import (
    JOB_POD_FAILURE_BACKOFF_MAX_S,
    JOB_POD_FAILURE_BACKOFF_S,
    TIME_SCALE,
    PodFailureRecord,
    next_record,
    pod_failure_delay_s,
)
from jobset_webhook import invalid, invalid_message, is_valid_label_value
from reconciler import Reconciler

if TYPE_CHECKING:
    from apiserver import ClusterApiServer

Obj = dict[str, Any]
log = logging.getLogger(__name__)

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
LEGACY_JOB_NAME_LABEL = "job-name"
LEGACY_CONTROLLER_UID_LABEL = "controller-uid"
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
INDEX_FIELD_PATH = f"metadata.annotations['{COMPLETION_INDEX_KEY}']"
JOB_CONTROLLER_NAME = "kubernetes.io/job-controller"
DEFAULT_BACKOFF_LIMIT = 6
MAX_GENERATED_NAME_LENGTH = 58  # 63 minus the 5 random characters
# k8s.io/apiserver/pkg/storage/names: the alphabet of generated name suffixes (no vowels).
NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"

BACKOFF_LIMIT_MESSAGE = "Job has reached the specified backoff limit"
DEADLINE_MESSAGE = "Job was active longer than specified deadline"
COMPLETIONS_REACHED_MESSAGE = "Reached expected number of succeeded pods"


def now_rfc3339() -> str:
    """Timestamps as the API server writes them (second precision, UTC)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(stamp: str) -> dt.datetime:
    """An RFC 3339 timestamp from the store."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


# --- pods -----------------------------------------------------------------------------------------


def phase(pod: Obj) -> str:
    """The pod's phase (a new pod with no status yet is Pending)."""
    return (pod.get("status") or {}).get("phase") or "Pending"


def is_finished(pod: Obj) -> bool:
    """Succeeded or Failed: the kubelet will not run it again."""
    return phase(pod) in ("Succeeded", "Failed")


def is_deleting(pod: Obj) -> bool:
    """DELETE was called (graceful termination in progress)."""
    return bool(pod["metadata"].get("deletionTimestamp"))


def is_active(pod: Obj) -> bool:
    """controller.IsPodActive: neither finished nor being deleted."""
    return not is_finished(pod) and not is_deleting(pod)


def is_terminating(pod: Obj) -> bool:
    """controller.CountTerminatingPods counts these: being deleted and not finished."""
    return is_deleting(pod) and not is_finished(pod)


def is_ready(pod: Obj) -> bool:
    """podutil.IsPodReady: condition Ready is True."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def completion_index(pod: Obj) -> int | None:
    """The pod's completion index annotation, None when absent or malformed."""
    value = (pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX_KEY)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def owned_by(obj: Obj, uid: str) -> bool:
    """Whether `obj`'s controller ownerReference points at `uid`."""
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


# --- the pod failure policy -------------------------------------------------------------------


def _exit_code_matches(code: int, requirement: Obj) -> bool:
    """The In / NotIn operator of an onExitCodes requirement (unknown operators match nothing)."""
    values = requirement.get("values") or []
    operator = requirement.get("operator")
    if operator == "In":
        return code in values
    if operator == "NotIn":
        return code not in values
    return False


def _matching_container(pod: Obj, requirement: Obj) -> Obj | None:
    """The first terminated container (then init container) with a matching non-zero code."""
    status = pod.get("status") or {}
    wanted = requirement.get("containerName")
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or []:
            terminated = (cs.get("state") or {}).get("terminated")
            if terminated is None or (wanted is not None and cs.get("name") != wanted):
                continue
            code = int(terminated.get("exitCode", 0))
            if code != 0 and _exit_code_matches(code, requirement):
                return cs
    return None


def _matching_condition(pod: Obj, patterns: list[Obj]) -> Obj | None:
    """The first pod condition matching one of the patterns (status defaults to True)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        for pattern in patterns:
            if cond.get("type") == pattern.get("type") and cond.get("status") == pattern.get(
                "status", "True"
            ):
                return cond
    return None


def match_pod_failure_policy(policy: Obj | None, pod: Obj) -> tuple[str | None, bool, str | None]:
    """matchPodFailurePolicy: (FailJob message or None, counts towards backoffLimit, action)."""
    if policy is None:
        return None, True, None
    meta = pod["metadata"]
    for index, rule in enumerate(policy.get("rules") or []):
        action = rule.get("action")
        if action not in ("FailJob", "Ignore", "Count"):
            continue  # FailIndex (needs backoffLimitPerIndex) and unknown actions are skipped
        message = None
        if rule.get("onExitCodes") is not None:
            cs = _matching_container(pod, rule["onExitCodes"])
            if cs is None:
                continue
            code = cs["state"]["terminated"]["exitCode"]
            message = (
                f"Container {cs.get('name')} for pod {meta.get('namespace')}/{meta['name']} "
                f"failed with exit code {code} matching FailJob rule at index {index}"
            )
        elif rule.get("onPodConditions") is not None:
            cond = _matching_condition(pod, rule["onPodConditions"])
            if cond is None:
                continue
            message = (
                f"Pod {meta.get('namespace')}/{meta['name']} has condition {cond.get('type')} "
                f"matching FailJob rule at index {index}"
            )
        else:
            continue
        if action == "Ignore":
            return None, False, action
        if action == "Count":
            return None, True, action
        return message, True, action
    return None, True, None


# --- completed indexes ------------------------------------------------------------------------


def format_indexes(indexes: set[int]) -> str:
    """status.completedIndexes: sorted intervals, "a-b" for three or more, "a,b" for two."""
    parts: list[str] = []
    ordered = sorted(indexes)
    i = 0
    while i < len(ordered):
        first = last = ordered[i]
        while i + 1 < len(ordered) and ordered[i + 1] == last + 1:
            i += 1
            last = ordered[i]
        if last == first:
            parts.append(str(first))
        elif last == first + 1:
            parts.append(f"{first},{last}")
        else:
            parts.append(f"{first}-{last}")
        i += 1
    return ",".join(parts)


def parse_indexes(text: str | None, completions: int) -> set[int]:
    """The inverse of format_indexes, dropping indexes >= completions."""
    result: set[int] = set()
    for part in filter(None, (text or "").split(",")):
        first, _, last = part.partition("-")
        with contextlib.suppress(ValueError):
            result.update(range(int(first), int(last or first) + 1))
    return {i for i in result if 0 <= i < completions}


# --- conditions -------------------------------------------------------------------------------


def find_condition(conditions: list[Obj], type_: str) -> Obj | None:
    """The condition of that type, if any."""
    return next((c for c in conditions if c.get("type") == type_), None)


def condition_true(conditions: list[Obj], type_: str) -> bool:
    """Whether a condition of that type is True."""
    cond = find_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def ensure_condition(
    conditions: list[Obj], type_: str, status: str, reason: str, message: str, now: str
) -> bool:
    """ensureJobConditionStatus: update or append (never append a False one); True if changed."""
    new = {
        "type": type_,
        "status": status,
        "lastProbeTime": now,
        "lastTransitionTime": now,
        "reason": reason,
        "message": message,
    }
    cond = find_condition(conditions, type_)
    if cond is not None:
        if (cond.get("status"), cond.get("reason"), cond.get("message")) != (
            status,
            reason,
            message,
        ):
            cond.clear()
            cond.update(new)
            return True
        return False
    if status != "False":
        conditions.append(new)
        return True
    return False


# --- the API server's part: defaults and validation of Jobs ----------------------------------


def default_job(obj: Obj) -> Obj:
    """kube-apiserver's batch/v1 Job defaults (SetDefaults_Job and pod spec defaults), in place."""
    spec = obj.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    if spec.get("parallelism") is None:
        spec["parallelism"] = 1
    if spec.get("backoffLimit") is None:
        spec["backoffLimit"] = 2**31 - 1 if spec.get("backoffLimitPerIndex") else 6
    if spec.get("completionMode") is None:
        spec["completionMode"] = "NonIndexed"
    if spec.get("suspend") is None:
        spec["suspend"] = False
    policy = spec.get("podFailurePolicy")
    if spec.get("podReplacementPolicy") is None:
        spec["podReplacementPolicy"] = "Failed" if policy is not None else "TerminatingOrFailed"
    for rule in (policy or {}).get("rules") or []:
        for pattern in rule.get("onPodConditions") or []:
            pattern.setdefault("status", "True")
    pod_spec = spec.setdefault("template", {}).setdefault("spec", {})
    if not pod_spec.get("restartPolicy"):
        pod_spec["restartPolicy"] = "Always"
    return obj


def validate_job(obj: Obj) -> list[str]:
    """The refusals kube-apiserver's Job validation would make, as field errors."""
    errs: list[str] = []
    spec = obj.get("spec") or {}
    name = obj.get("metadata", {}).get("name", "")
    if name and is_valid_label_value(name):
        errs.append(invalid("spec.template.labels", name, "must be no more than 63 characters"))
    restart = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy", "")
    path = "spec.template.spec.restartPolicy"
    policy = spec.get("podFailurePolicy")
    if restart not in ("OnFailure", "Never"):
        errs.append(
            f'{path}: Unsupported value: "{restart}": supported values: "OnFailure", "Never"'
        )
    elif policy is not None and restart != "Never":
        errs.append(
            invalid(path, restart, 'only "Never" is supported when podFailurePolicy is specified')
        )
    if policy is not None and spec.get("podReplacementPolicy", "Failed") != "Failed":
        errs.append(
            invalid(
                "spec.podReplacementPolicy",
                spec.get("podReplacementPolicy"),
                'must be "Failed" when podFailurePolicy is used',
            )
        )
    if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
        errs.append("spec.completions: Required value: when completion mode is Indexed")
    containers = {
        c.get("name")
        for key in ("containers", "initContainers")
        for c in ((spec.get("template") or {}).get("spec") or {}).get(key) or []
    }
    for i, rule in enumerate((policy or {}).get("rules") or []):
        rpath = f"spec.podFailurePolicy.rules[{i}]"
        codes, conds = rule.get("onExitCodes"), rule.get("onPodConditions")
        if (codes is None) == (conds is None):
            errs.append(
                f"{rpath}: Invalid value: specifying one of onExitCodes and onPodConditions is "
                "required"
            )
        if codes is not None:
            if codes.get("operator") not in ("In", "NotIn"):
                errs.append(
                    f'{rpath}.onExitCodes.operator: Unsupported value: "{codes.get("operator")}"'
                    ': supported values: "In", "NotIn"'
                )
            name_wanted = codes.get("containerName")
            if name_wanted is not None and name_wanted not in containers:
                errs.append(
                    invalid(
                        f"{rpath}.onExitCodes.containerName",
                        name_wanted,
                        "must be one of the container or initContainer names in the pod template",
                    )
                )
            if codes.get("operator") == "In" and 0 in (codes.get("values") or []):
                errs.append(
                    invalid(
                        f"{rpath}.onExitCodes.values[0]", 0, "must not be 0 for the In operator"
                    )
                )
        if rule.get("action") not in ("FailJob", "FailIndex", "Ignore", "Count"):
            errs.append(
                f'{rpath}.action: Unsupported value: "{rule.get("action")}": supported values: '
                '"Count", "FailIndex", "FailJob", "Ignore"'
            )
    return errs


def admit_job(obj: Obj) -> str | None:
    """kube-apiserver's Job handling as a `ClusterApiServer.admission` hook (kind Job only)."""
    if obj.get("kind") != "Job" or obj.get("apiVersion") != "batch/v1":
        return None
    default_job(obj)
    errors = validate_job(obj)
    if not errors:
        return None
    return invalid_message("Job.batch", obj.get("metadata", {}).get("name", ""), errors)


# --- the controller ---------------------------------------------------------------------------


@dataclass
class _Tracking:
    """What a job-tracking finalizer records on a real cluster, kept in memory per Job."""

    counted: set[str] = field(default_factory=set)  # pods already in succeeded/failed
    untracked: set[str] = field(default_factory=set)  # deleted by us: never counted
    last_seen: dict[str, Obj] = field(default_factory=dict)  # unfinished pods, last state


def _removal_order(pod: Obj) -> tuple[Any, ...]:
    """controller.ActivePods: unscheduled, pending, not ready, restarting, newest go first."""
    rank = {"Pending": 0, "Unknown": 1, "Running": 2}.get(phase(pod), 1)
    status = pod.get("status") or {}
    restarts = sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or [])
    created = pod["metadata"].get("creationTimestamp") or ""
    newest_first = -parse_time(created).timestamp() if created else 0.0
    return (
        bool((pod.get("spec") or {}).get("nodeName")),
        rank,
        is_ready(pod),
        -restarts,
        newest_first,
    )


class JobController(Reconciler):
    """batch/v1 Jobs: pods from the template, counters, conditions (see the module docstring)."""

    def __init__(
        self,
        api: ClusterApiServer,
        *,
        period_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        time_scale: float = TIME_SCALE,
    ) -> None:
        """`api`: the store to reconcile; `period_s`: how often `run` re-reads every Job;
        `clock`: seconds (a fake one in tests); `time_scale`: multiplies the pod-failure
        back-off's 10 s and 10 min (backoff.py)."""
        super().__init__(api, period_s)
        self.clock = clock
        self.backoff_s = JOB_POD_FAILURE_BACKOFF_S * time_scale
        self.backoff_max_s = JOB_POD_FAILURE_BACKOFF_MAX_S * time_scale
        self._tracking: dict[str, _Tracking] = {}
        # By Job uid (the real store keys it by namespace/name and drops it when a sync finds
        # the Job gone, which it does before JobSet can recreate a Job under the same name).
        self._backoff: dict[str, PodFailureRecord] = {}
        self._failed_creates: set[tuple[str, str]] = set()  # (Job uid, Event message)

    async def sync_all(self) -> None:
        """One pass over all Jobs; what is tracked for Jobs that are gone is dropped."""
        seen = await self.sync_each("Job", self.sync_job)
        for uid in set(self._tracking) - seen:
            del self._tracking[uid]
        for uid in set(self._backoff) - seen:  # syncJob of a deleted Job removes its record
            del self._backoff[uid]

    def pod_failure_delay_s(self, job: Obj) -> float:
        """How long the Job's next pod creation still waits after its pods' failures."""
        record = self._backoff.get(job["metadata"]["uid"], PodFailureRecord())
        return pod_failure_delay_s(record, self.clock(), self.backoff_s, self.backoff_max_s)

    def _pods_of(self, namespace: str, uid: str) -> list[Obj]:
        """The Job's pods, by controller ownerReference (the stand-in has no selectors)."""
        return [
            p for p in self.api.owned(uid, "Pod") if p["metadata"].get("namespace") == namespace
        ]

    async def sync_job(self, job: Obj) -> None:
        """syncJob for one Job: count finished pods, decide its fate, manage pods, write status."""
        meta, spec = job["metadata"], job.get("spec") or {}
        status = job.get("status") or {}
        ns, uid = meta.get("namespace", ""), meta["uid"]
        if spec.get("managedBy") not in (None, JOB_CONTROLLER_NAME):
            return
        conditions = copy.deepcopy(status.get("conditions") or [])
        if condition_true(conditions, "Complete") or condition_true(conditions, "Failed"):
            self._tracking.pop(uid, None)
            self._backoff.pop(uid, None)
            return
        indexed = spec.get("completionMode") == "Indexed"
        completions = spec.get("completions")
        if indexed and completions is None:
            return  # invalid (validation refuses it); the real controller cannot sync it either
        policy = spec.get("podFailurePolicy")
        only_failed = _only_replace_failed(spec)
        suspended = bool(spec.get("suspend"))
        now = now_rfc3339()
        tr = self._tracking.setdefault(uid, _Tracking())
        pods = self._pods_of(ns, uid)

        # Count pods that finished since the last pass (what the finalizer protocol does).
        completed = parse_indexes(status.get("completedIndexes"), int(completions or 0))
        succeeded = int(status.get("succeeded") or 0)
        failed = int(status.get("failed") or 0)
        failed_pods: list[Obj] = []
        new_succeeded = new_failed = 0  # pods first seen finished in this pass
        present = {p["metadata"]["uid"] for p in pods}
        for pod_uid in [u for u in tr.last_seen if u not in present]:
            gone = tr.last_seen.pop(pod_uid)
            if pod_uid in tr.counted or pod_uid in tr.untracked:
                continue
            tr.counted.add(pod_uid)  # vanished unfinished: the finalizer would count a failure
            failed_pods.append(gone)
            new_failed += 1
            if match_pod_failure_policy(policy, gone)[1]:
                failed += 1
        for pod in pods:
            pod_uid = pod["metadata"]["uid"]
            pod_failed = _is_pod_failed(pod, only_failed)
            if pod_failed:
                failed_pods.append(pod)
            if pod_uid in tr.counted or pod_uid in tr.untracked:
                continue
            if phase(pod) == "Succeeded":
                tr.counted.add(pod_uid)
                tr.last_seen.pop(pod_uid, None)
                new_succeeded += 1
                index = completion_index(pod)
                if not indexed:
                    succeeded += 1
                elif index is not None and 0 <= index < int(completions):
                    completed.add(index)
            elif pod_failed:
                tr.counted.add(pod_uid)
                tr.last_seen.pop(pod_uid, None)
                new_failed += 1  # Ignored ones too: the back-off counts every failed pod
                if match_pod_failure_policy(policy, pod)[1]:
                    failed += 1
            else:
                tr.last_seen[pod_uid] = pod
        if indexed:
            succeeded = len(completed)
        finished_s = self.clock()
        self._backoff[uid] = next_record(
            self._backoff.get(uid, PodFailureRecord()),
            [finished_s] * new_succeeded,
            [finished_s] * new_failed,
        )

        start_time = status.get("startTime")
        if start_time is None and not suspended:
            start_time = now
        completion_time = status.get("completionTime")

        # What finishes the Job, if anything: (terminal type, reason, message).
        finished: tuple[str, str, str] | None = None
        criteria = find_condition(conditions, "SuccessCriteriaMet")
        target = find_condition(conditions, "FailureTarget")
        if criteria is not None and criteria.get("status") == "True":
            finished = ("Complete", criteria.get("reason", ""), criteria.get("message", ""))
        elif target is not None and target.get("status") == "True":
            finished = ("Failed", target.get("reason", ""), target.get("message", ""))
        elif policy is not None:
            for pod in failed_pods:
                message = match_pod_failure_policy(policy, pod)[0]
                if message is not None:
                    finished = ("Failed", "PodFailurePolicy", message)
                    break
        if finished is None:
            backoff_limit = spec.get("backoffLimit")
            limit = DEFAULT_BACKOFF_LIMIT if backoff_limit is None else int(backoff_limit)
            if failed > limit or _past_backoff_limit_on_failure(spec, pods, limit):
                finished = ("Failed", "BackoffLimitExceeded", BACKOFF_LIMIT_MESSAGE)
            elif _past_active_deadline(spec, start_time, suspended):
                finished = ("Failed", "DeadlineExceeded", DEADLINE_MESSAGE)

        if finished is not None:
            kind, reason, message = finished
            for pod in pods:
                if is_active(pod):
                    await self.api.delete("Pod", ns, pod["metadata"]["name"])
            if kind == "Failed":
                # When the Job is failing, every unfinished pod it still tracks counts as failed.
                for pod in pods:
                    pod_uid = pod["metadata"]["uid"]
                    if pod_uid in tr.counted or pod_uid in tr.untracked:
                        continue
                    if phase(pod) != "Succeeded":
                        tr.counted.add(pod_uid)
                        tr.last_seen.pop(pod_uid, None)
                        if match_pod_failure_policy(policy, pod)[1]:
                            failed += 1
                ensure_condition(conditions, "FailureTarget", "True", reason, message, now)
            else:
                ensure_condition(conditions, "SuccessCriteriaMet", "True", reason, message, now)
            if not any(is_terminating(p) for p in self._pods_of(ns, uid)):
                ensure_condition(conditions, kind, "True", reason, message, now)
                if kind == "Complete":
                    completion_time = completion_time or now
        else:
            manage_called = False
            if not meta.get("deletionTimestamp"):
                await self._manage(job, pods, tr, succeeded, completed, only_failed)
                manage_called = True
            after = self._pods_of(ns, uid)
            active = sum(1 for p in after if is_active(p))
            if completions is None:
                complete = succeeded > 0 and active == 0
            else:
                complete = succeeded >= int(completions) and active == 0
            if complete:
                ensure_condition(
                    conditions,
                    "SuccessCriteriaMet",
                    "True",
                    "CompletionsReached",
                    COMPLETIONS_REACHED_MESSAGE,
                    now,
                )
                if not any(is_terminating(p) for p in after):
                    ensure_condition(
                        conditions,
                        "Complete",
                        "True",
                        "CompletionsReached",
                        COMPLETIONS_REACHED_MESSAGE,
                        now,
                    )
                    completion_time = completion_time or now
            elif manage_called:
                if suspended:
                    ensure_condition(
                        conditions, "Suspended", "True", "JobSuspended", "Job suspended", now
                    )
                elif ensure_condition(
                    conditions, "Suspended", "False", "JobResumed", "Job resumed", now
                ):
                    start_time = now  # a resumed Job starts its clock again

        after = self._pods_of(ns, uid)
        active_pods = [p for p in after if is_active(p)]
        new_status: Obj = {
            "conditions": conditions or None,
            "startTime": start_time,
            "completionTime": completion_time,
            "active": len(active_pods) or None,
            "ready": sum(1 for p in active_pods if is_ready(p)),
            "terminating": sum(1 for p in after if is_terminating(p)),
            "succeeded": succeeded or None,
            "failed": failed or None,
            "completedIndexes": (format_indexes(completed) or None) if indexed else None,
            "uncountedTerminatedPods": {},
        }
        if {k: v for k, v in new_status.items() if v is not None} != status:
            await self.api.patch_status("Job", ns, meta["name"], new_status)

    async def _manage(
        self,
        job: Obj,
        pods: list[Obj],
        tr: _Tracking,
        succeeded: int,
        completed: set[int],
        only_failed: bool,
    ) -> None:
        """manageJob: delete pods while suspended or in excess, else create the missing ones."""
        meta, spec = job["metadata"], job.get("spec") or {}
        ns = meta.get("namespace", "")
        indexed = spec.get("completionMode") == "Indexed"
        completions = spec.get("completions")
        parallelism = 1 if spec.get("parallelism") is None else int(spec["parallelism"])
        active = [p for p in pods if is_active(p)]

        async def remove(doomed: list[Obj]) -> None:
            """Delete pods the controller no longer wants; they never count as failures."""
            for pod in doomed:
                # The real controller drops the tracking finalizer first: never counted.
                tr.untracked.add(pod["metadata"]["uid"])
                tr.last_seen.pop(pod["metadata"]["uid"], None)
                await self.api.delete("Pod", ns, pod["metadata"]["name"])

        if spec.get("suspend"):
            await remove(active)
            return
        if completions is None:
            want = len(active) if succeeded > 0 else parallelism
        else:
            want = max(0, min(int(completions) - succeeded, parallelism))

        doomed: list[Obj] = []
        if indexed:
            by_index: dict[int, list[Obj]] = {}
            for pod in active:
                index = completion_index(pod)
                if index is None or index >= int(completions):
                    doomed.append(pod)
                else:
                    by_index.setdefault(index, []).append(pod)
            for same in by_index.values():
                same.sort(key=_removal_order)
                doomed += same[:-1]  # keep the one furthest along
        need = max(0, len(active) - want)
        if len(doomed) < need:
            rest = sorted((p for p in active if p not in doomed), key=_removal_order)
            doomed += rest[: need - len(doomed)]
        if doomed:
            await remove(doomed)
            return

        terminating = [p for p in pods if is_terminating(p)] if only_failed else []
        diff = want - len(terminating) - len(active)
        if diff <= 0:
            return
        if self.pod_failure_delay_s(job) > 0:
            return  # the real controller requeues the Job for then; this loop comes back
        if not indexed:
            for _ in range(diff):
                await self._create_pod(job, None)
            return
        busy = set(completed)
        busy.update(i for p in active + terminating if (i := completion_index(p)) is not None)
        pending = [i for i in range(int(completions)) if i not in busy][:diff]
        for index in pending:
            await self._create_pod(job, index)

    async def _create_pod(self, job: Obj, index: int | None) -> None:
        """One pod from the template, as the real controller's CreatePodsWithGenerateName."""
        meta, spec = job["metadata"], job.get("spec") or {}
        ns, name, uid = meta.get("namespace", ""), meta["name"], meta["uid"]
        template = copy.deepcopy(spec.get("template") or {})
        tmeta = template.get("metadata") or {}
        pod_spec = template.get("spec") or {}
        labels = dict(tmeta.get("labels") or {})
        labels.update(
            {
                CONTROLLER_UID_LABEL: uid,
                JOB_NAME_LABEL: name,
                LEGACY_CONTROLLER_UID_LABEL: uid,
                LEGACY_JOB_NAME_LABEL: name,
            }
        )
        annotations = dict(tmeta.get("annotations") or {})
        if index is None:
            prefix = name + "-"
            if len(prefix) > MAX_GENERATED_NAME_LENGTH:
                prefix = prefix[:MAX_GENERATED_NAME_LENGTH]
        else:
            for key in ("initContainers", "containers"):
                for container in pod_spec.get(key) or []:
                    env = container.setdefault("env", [])
                    if not any(e.get("name") == COMPLETION_INDEX_ENV for e in env):
                        env.append(
                            {
                                "name": COMPLETION_INDEX_ENV,
                                "valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD_PATH}},
                            }
                        )
            annotations[COMPLETION_INDEX_KEY] = str(index)
            labels[COMPLETION_INDEX_KEY] = str(index)
            pod_spec["hostname"] = f"{name}-{index}"
            suffix = f"-{index}-"
            prefix = name + suffix
            if len(prefix) > MAX_GENERATED_NAME_LENGTH:
                prefix = prefix[: MAX_GENERATED_NAME_LENGTH - len(suffix)] + suffix
        while True:
            pod_name = prefix + "".join(random.choices(NAME_SUFFIX_ALPHABET, k=5))
            if self.api.get("Pod", ns, pod_name) is None:
                break
        pod_meta: Obj = {
            "name": pod_name,
            "generateName": prefix,
            "namespace": ns,
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if annotations:
            pod_meta["annotations"] = annotations
        if tmeta.get("finalizers"):
            pod_meta["finalizers"] = list(tmeta["finalizers"])
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}
        try:
            await self.api.create(pod)
        except kmock.KubernetesError as exc:  # refused by admission: retried next pass
            log.warning("creating a pod for Job %s/%s: %s", ns, name, exc)
            self._failed_create(job, str(exc.message or exc))

    def _failed_create(self, job: Obj, error: str) -> None:
        """The FailedCreate Warning Event on the Job, once per message."""
        meta = job["metadata"]
        message = f"Error creating: {error}"
        if (meta["uid"], message) in self._failed_creates:
            return
        self._failed_creates.add((meta["uid"], message))
        now = now_rfc3339()
        self.api.add(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
                "type": "Warning",
                "reason": "FailedCreate",
                "message": message,
                "source": {"component": "job-controller"},
                "reportingComponent": "job-controller",
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )


def _only_replace_failed(spec: Obj) -> bool:
    """onlyReplaceFailedPods: policy Failed (the default when a pod failure policy is set)."""
    policy = spec.get("podReplacementPolicy")
    if policy is None:
        policy = "Failed" if spec.get("podFailurePolicy") is not None else "TerminatingOrFailed"
    return policy == "Failed" or spec.get("podFailurePolicy") is not None


def _is_pod_failed(pod: Obj, only_failed: bool) -> bool:
    """isPodFailed: phase Failed; or, unless only failed pods are replaced, being deleted."""
    if phase(pod) == "Failed":
        return True
    if only_failed:
        return False
    return is_deleting(pod) and phase(pod) != "Succeeded"


def _past_backoff_limit_on_failure(spec: Obj, pods: list[Obj], limit: int) -> bool:
    """With restartPolicy OnFailure the kubelet's container restarts count against the limit."""
    restart = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy")
    if restart != "OnFailure":
        return False
    total = 0
    for pod in pods:
        if phase(pod) in ("Running", "Pending"):
            status = pod.get("status") or {}
            for key in ("initContainerStatuses", "containerStatuses"):
                total += sum(int(c.get("restartCount", 0)) for c in status.get(key) or [])
    return total > 0 if limit == 0 else total >= limit


def _past_active_deadline(spec: Obj, start_time: str | None, suspended: bool) -> bool:
    """activeDeadlineSeconds elapsed since startTime (never while suspended)."""
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is None or start_time is None or suspended:
        return False
    elapsed = dt.datetime.now(dt.UTC) - parse_time(start_time)
    return elapsed.total_seconds() >= int(deadline)
