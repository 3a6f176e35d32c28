"""The lifecycle and failure policy as tables: observed children -> phase, conditions, actions."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from gspo_api.progress import LearnerProgress
from gspo_api.validation import parse_spec
from gspo_operator import status, views
from gspo_operator.status import (
    ChildrenSeen,
    Observation,
    compute,
)
from gspo_operator.views import (
    JobSetView,
    Observed,
    PodView,
    WorkloadView,
)

REPO = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())["spec"]
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB = "qwen3-30b-a3b-math"


def spec(**run_policy):
    raw = copy.deepcopy(RAW)
    raw["runPolicy"].update(run_policy)
    return parse_spec(raw)


def pods(*phases: str, attempt: int = 0, ready: bool = True) -> list[PodView]:
    """Learner pods of JobSet restart attempt `attempt`, node ranks in order."""
    return [
        PodView(
            f"{JOB}-learner-0-{i}-abcde",
            phase=p,
            ready=ready and p == "Running",
            restart_attempt=attempt,
            index=i,
        )
        for i, p in enumerate(phases)
    ]


def servers(ready: int, attempt: int = 0) -> list[PodView]:
    return [
        PodView(f"{JOB}-rollout-{i}-0-abcde", role="rollout", phase="Running", ready=True,
                restart_attempt=attempt)
        for i in range(ready)
    ]  # fmt: skip


def js(restarts: int = 0, suspended: bool = False, **conditions: tuple[str, str]) -> JobSetView:
    """A JobSet's status: conditions given as Type=(reason, message) are True."""
    return JobSetView(
        suspended=suspended,
        restarts=restarts,
        conditions={t: (True, r, m) for t, (r, m) in conditions.items()},
    )


def observed(*pod_lists: list[PodView], jobset: JobSetView | None = None, progress=None):
    everything = [p for group in pod_lists for p in group]
    return Observed(jobset=jobset or js(), pods=everything, progress=progress)


def cond(st: dict, type_: str) -> dict:
    (found,) = [c for c in st["conditions"] if c["type"] == type_]
    return found


def step(s, obs, prev, now=NOW):
    return compute(Observation(prev or {}, now, spec=s, generation=1, observed=obs))


def test_pending_until_every_learner_pod_runs_with_the_reason_shown() -> None:
    waiting = PodView(f"{JOB}-learner-0-1-abcde", index=1, message="Unschedulable: 0/1 nodes are "
                      "available: 1 Insufficient nvidia.com/gpu.")  # fmt: skip
    out = step(spec(), observed([pods("Running")[0], waiting]), None)
    assert out.status["phase"] == "Pending"
    assert out.suspend_jobset is None
    assert cond(out.status, "LearnerReady")["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in cond(out.status, "Running")["message"]
    assert out.status["rolloutReady"] == "0/4"
    assert out.events[0].reason == "Pending"


def test_a_missing_jobset_is_created() -> None:
    out = step(spec(), Observed(jobset=None), None)
    assert out.status["phase"] == "Pending"
    assert cond(out.status, "Running")["reason"] == "JobSetMissing"


def test_running_with_progress_written_to_status() -> None:
    progress = LearnerProgress(step=12, reward=0.41234, last_checkpoint="step-000010",
                               policy_version=12, phase="Running",
                               server_versions={"http://10.0.0.7:8000": 12,
                                                "http://10.0.0.9:8000": None})  # fmt: skip
    prev = step(spec(), observed(pods("Pending", "Pending")), None).status
    out = step(spec(), observed(pods("Running", "Running"), servers(3), progress=progress), prev)
    st = out.status
    assert st["phase"] == "Running"
    assert (st["step"], st["reward"], st["lastCheckpoint"], st["policyVersion"]) == (
        12, 0.4123, "step-000010", 12)  # fmt: skip
    assert st["rolloutReady"] == "3/4"
    assert st["serverVersions"] == {"http://10.0.0.7:8000": 12, "http://10.0.0.9:8000": None}
    assert cond(st, "LearnerReady")["status"] == "True"
    assert cond(st, "RolloutReady")["status"] == "False"
    synced = cond(st, "WeightsSynced")
    assert synced["status"] == "True"
    assert synced["message"] == "1/2 rollout servers hold policy version 12"
    assert cond(st, "Running")["status"] == "True"
    assert [e.reason for e in out.events] == ["Running"]


def test_every_learner_pod_counts_towards_ready() -> None:
    """Rank 1 is ready too (every pod serves /healthz): LearnerReady needs all of them."""
    one_ready = [*pods("Running"), *pods("Running", "Running", ready=False)[1:]]
    out = step(spec(), observed(one_ready), None)
    assert cond(out.status, "LearnerReady")["message"] == "1/2 learner pods ready"
    out = step(spec(), observed(pods("Running", "Running")), out.status)
    assert cond(out.status, "LearnerReady")["status"] == "True"


def test_unchanged_observation_gives_an_identical_status() -> None:
    """The timer patches only when the status changed: a steady job must compute equal dicts."""
    obs = observed(pods("Running", "Running"), servers(4))
    first = step(spec(), obs, None).status
    again = step(spec(), obs, copy.deepcopy(first), NOW + timedelta(minutes=5))
    assert again.status == first
    assert again.events == []


def test_a_jobset_restart_is_reported_with_the_failed_pods_words() -> None:
    prev = step(spec(), observed(pods("Running", "Running")), None).status
    failed = PodView(f"{JOB}-learner-0-1-abcde", phase="Failed", index=1, exit_code=137,
                     message="OOMKilled (exit code 137)")  # fmt: skip
    new_group = pods("Pending", "Pending", attempt=1)
    out = step(spec(backoffLimit=2), observed([failed], new_group, jobset=js(restarts=1)), prev)
    assert out.status["phase"] == "Restarting" and out.status["restarts"] == 1
    assert "OOMKilled" in cond(out.status, "Restarting")["message"]
    assert [e.reason for e in out.events] == ["LearnerRestart"]
    # Pods of the old attempt do not count; the new group runs: Running, Restarting cleared.
    out2 = step(
        spec(backoffLimit=2),
        observed([failed], pods("Running", "Running", attempt=1), jobset=js(restarts=1)),
        out.status,
    )
    assert out2.status["phase"] == "Running"
    assert cond(out2.status, "Restarting")["status"] == "False"
    assert out2.events[0].reason == "Running"


def test_a_restart_seen_after_jobset_deleted_the_failed_pods_keeps_their_words() -> None:
    """JobSet deletes the failed group's pods when it restarts; an operator that sees the
    restart only then still reports the words it saw while the pod was Failed."""
    failed = PodView(f"{JOB}-learner-0-1-abcde", phase="Failed", index=1, exit_code=137,
                     message="OOMKilled (exit code 137)")  # fmt: skip
    seen = step(spec(backoffLimit=2), observed([pods("Running")[0], failed]), None).status
    words = f"pod {failed.name} failed: OOMKilled (exit code 137)"
    assert seen["learnerFailure"] == {"restartAttempt": 0, "message": words}
    gone = observed(pods("Pending", "Pending", attempt=1), jobset=js(restarts=1))
    out = step(spec(backoffLimit=2), gone, seen)
    assert "OOMKilled" in cond(out.status, "Restarting")["message"]
    # Words kept for another group are not this restart's.
    out = step(spec(backoffLimit=2), replace(gone, jobset=js(restarts=2)), seen)
    assert cond(out.status, "Restarting")["message"].startswith("a learner pod failed;")


def test_learner_exit_2_fails_the_job_with_the_learners_message() -> None:
    prev = {"phase": "Running", "startTime": "2026-01-01T11:00:00Z"}
    bad = PodView(f"{JOB}-learner-0-0-abcde", phase="Failed", exit_code=2,
                  message="Error (exit code 2): gspo learner: spec.data.source: /data/x.jsonl "
                  "does not exist")  # fmt: skip
    failed = js(Failed=("FailurePolicyRuleMatched", "LearnerInvalidConfig matched"))
    out = step(spec(), observed([bad], jobset=failed), prev)
    assert out.status["phase"] == "Failed"
    c = cond(out.status, "Failed")
    assert c["reason"] == "InvalidConfig"
    assert "spec.data.source" in c["message"] and "not retried" in c["message"]
    assert out.status["completionTime"] == "2026-01-01T12:00:00Z"


def test_max_restarts_exhausted_fails_the_job() -> None:
    prev = {"phase": "Running", "restarts": 2, "startTime": "2026-01-01T11:00:00Z"}
    failed_pod = PodView(f"{JOB}-learner-0-0-abcde", phase="Failed", exit_code=1,
                         restart_attempt=2, message="Error (exit code 1)")  # fmt: skip
    failed = js(restarts=2, Failed=("ReachedMaxRestarts", "jobset failed due to reaching max "
                                    "number of restarts"))  # fmt: skip
    out = step(spec(backoffLimit=2), observed([failed_pod], jobset=failed), prev)
    assert out.status["phase"] == "Failed"
    c = cond(out.status, "Failed")
    assert c["reason"] == "BackoffLimitExceeded"
    assert "exit code 1" in c["message"] and "max number of restarts" in c["message"]


def test_succeeded_when_the_jobset_completes_then_ttl_deletes() -> None:
    # The last /progress read was a few steps before the end; the learner is gone now.
    prev = {"phase": "Running", "startTime": "2026-01-01T11:00:00Z", "step": 996}
    done = js(Completed=("AllJobsCompleted", "jobset completed successfully"))
    out = step(spec(ttlSecondsAfterFinished=60), observed(jobset=done), prev)
    assert out.status["phase"] == "Succeeded" and out.status["step"] == 1000  # maxSteps
    assert cond(out.status, "Succeeded")["message"] == "every learner pod exited 0 at step 1000"
    assert not out.delete_job
    later = step(
        spec(ttlSecondsAfterFinished=60), Observed(), out.status, NOW + timedelta(seconds=59)
    )
    assert not later.delete_job
    later = step(
        spec(ttlSecondsAfterFinished=60), Observed(), out.status, NOW + timedelta(seconds=60)
    )
    assert later.delete_job and later.status["phase"] == "Succeeded"


def test_active_deadline_fails_the_job_and_stops_its_pods() -> None:
    prev = {"phase": "Running", "startTime": "2026-01-01T11:00:00Z"}
    out = step(spec(activeDeadlineSeconds=3600), observed(pods("Running", "Running")), prev)
    assert out.status["phase"] == "Failed"
    assert cond(out.status, "Failed")["reason"] == "DeadlineExceeded"
    assert out.delete_jobset
    fine = step(spec(activeDeadlineSeconds=3601), observed(pods("Running", "Running")), prev)
    assert fine.status["phase"] == "Running" and not fine.delete_jobset


def test_suspend_suspends_the_jobset_and_resume_continues() -> None:
    prev = step(spec(), observed(pods("Running", "Running"), servers(4)), None).status
    assert prev["phase"] == "Running"
    out = step(spec(suspend=True), observed(pods("Running", "Running")), prev)
    assert out.status["phase"] == "Suspended"
    assert out.suspend_jobset is True
    assert cond(out.status, "Suspended")["status"] == "True"
    gone = step(spec(suspend=True), observed(jobset=js(suspended=True)), out.status)
    assert gone.status["phase"] == "Suspended" and gone.suspend_jobset is None
    resumed = step(
        spec(), observed(jobset=js(suspended=True)), gone.status, NOW + timedelta(hours=1)
    )
    assert resumed.suspend_jobset is False
    assert resumed.status["phase"] == "Pending"
    assert cond(resumed.status, "Suspended")["status"] == "False"
    assert resumed.status["startTime"] == "2026-01-01T13:00:00Z"


def test_resume_seen_before_the_suspended_jobset_still_clears_suspended() -> None:
    """The JobSet watch lags: the resume arrives while the view still shows the JobSet running
    (its suspend not seen yet), then the suspended JobSet shows up after the phase moved on."""
    prev = step(spec(), observed(pods("Running", "Running"), servers(4)), None).status
    gone = step(spec(suspend=True), observed(pods("Running", "Running")), prev).status
    assert gone["phase"] == "Suspended"
    later = NOW + timedelta(hours=1)
    lagging = step(spec(), observed(jobset=js(suspended=False)), gone, later)
    assert lagging.status["phase"] == "Pending" and lagging.suspend_jobset is None
    assert cond(lagging.status, "Suspended")["status"] == "False"
    caught_up = step(spec(), observed(jobset=js(suspended=True)), lagging.status, later)
    assert caught_up.suspend_jobset is False
    assert cond(caught_up.status, "Suspended")["reason"] == "Resumed"
    assert caught_up.status["startTime"] == "2026-01-01T13:00:00Z"


def test_condition_transition_time_changes_only_on_flip() -> None:
    first = step(spec(), observed(pods("Running", "Pending")), None, NOW).status
    t0 = cond(first, "LearnerReady")["lastTransitionTime"]
    same = step(
        spec(), observed(pods("Running", "Pending")), first, NOW + timedelta(minutes=1)
    ).status
    assert cond(same, "LearnerReady")["lastTransitionTime"] == t0
    flip = step(
        spec(), observed(pods("Running", "Running")), same, NOW + timedelta(minutes=2)
    ).status
    assert cond(flip, "LearnerReady")["lastTransitionTime"] == "2026-01-01T12:02:00Z"


def test_pod_view_reads_what_jobset_and_the_kubelet_wrote() -> None:
    pod = {
        "metadata": {
            "name": "j-learner-0-1-abcde",
            "labels": {"gspo.dev/role": "learner", "jobset.sigs.k8s.io/restart-attempt": "2"},
            "annotations": {"batch.kubernetes.io/job-completion-index": "1"},
        },
        "status": {
            "phase": "Failed",
            "podIP": "10.0.0.5",
            "containerStatuses": [
                {"state": {"terminated": {"reason": "Error", "exitCode": 2,
                                          "message": "gspo learner: spec.x: bad\n"}}}
            ],
        },
    }  # fmt: skip
    view = PodView.from_pod(pod)
    assert (view.phase, view.restart_attempt, view.index, view.ip) == ("Failed", 2, 1, "10.0.0.5")
    assert view.exit_code == 2
    assert view.message == "Error (exit code 2): gspo learner: spec.x: bad"
    waiting = PodView.from_pod(
        {"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}}]}}
    )  # fmt: skip
    assert waiting.message == 'CreateContainerConfigError: secret "hf" not found'


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"runPolicy": {"suspend": True, "activeDeadlineSeconds": 9}}, []),
        ({"rollout": {"replicas": 8}}, ["rollout.replicas"]),
        ({"runPolicy": {"backoffLimit": 9}}, ["runPolicy.backoffLimit"]),
        ({"algorithm": {"learningRate": 2e-6}}, ["algorithm.learningRate"]),
        ({"learner": {"replicas": 4}}, ["learner.replicas"]),
    ],
)
def test_spec_changes_in_flight(change: dict, refused: list[str]) -> None:
    new = copy.deepcopy(RAW)
    for section, fields in change.items():
        new[section].update(fields)
    if "learner" in change:
        new["algorithm"]["promptsPerStep"] = 64
    assert status.refused_fields(parse_spec(RAW), parse_spec(new)) == refused


def test_invalid_and_refused_statuses_name_the_field() -> None:
    from gspo_api.validation import Problem

    problems = (Problem("spec.algorithm.groupSize", "too small"),)
    out = compute(Observation({}, NOW, problems=problems))
    st, (event,) = out.status, out.events
    assert st["phase"] == "Failed"
    assert cond(st, "InvalidSpec")["message"] == "spec.algorithm.groupSize: too small"
    assert event.type == "Warning"
    refused = ("learner.replicas",)
    out = compute(Observation({"phase": "Running"}, NOW, spec=spec(), refused_fields=refused))
    st, (event,) = out.status, out.events
    assert st["phase"] == "Running"
    assert "spec.learner.replicas" in cond(st, "InvalidSpec")["message"]
    accepted = compute(Observation(st, NOW, spec=spec())).status
    assert cond(accepted, "InvalidSpec")["status"] == "False"


def queued(jobset: JobSetView, workload: WorkloadView | None, *pod_lists: list[PodView]):
    """What the operator sees on a cluster with Kueue (it serves the Workload API)."""
    everything = [p for group in pod_lists for p in group]
    return Observed(jobset=jobset, pods=everything, kueue=True, workload=workload)


def workload(active: bool = True, **conditions: tuple[bool, str, str]) -> WorkloadView:
    return WorkloadView("jobset-x-1a2b3", active=active, conditions=conditions, cluster_queue="cq")


ADMITTED = {
    "QuotaReserved": (True, "QuotaReserved", "Quota reserved in ClusterQueue cq"),
    "Admitted": (True, "Admitted", "The workload is admitted"),
}


def test_a_queued_jobset_waits_for_kueue_and_is_never_unsuspended_by_the_operator() -> None:
    """The example names a Kueue queue: Kueue, not the operator, unsuspends its JobSet."""
    out = step(spec(), queued(js(suspended=True), None), None)
    assert out.status["phase"] == "Pending" and out.suspend_jobset is None
    assert "gpu-team" in cond(out.status, "Running")["message"]
    assert cond(out.status, "Queued")["reason"] == "WorkloadMissing"
    unqueued = spec(scheduling={})
    assert step(unqueued, observed(jobset=js(suspended=True)), None).suspend_jobset is False
    # Without Kueue on the cluster nothing else would ever resume it.
    assert step(spec(), observed(jobset=js(suspended=True)), None).suspend_jobset is False


@pytest.mark.parametrize(
    ("conditions", "active", "reason", "message"),
    [
        (
            {
                "QuotaReserved": (
                    False,
                    "Pending",
                    "couldn't assign flavors to pod set learner: "
                    "resource nvidia.com/gpu unavailable in ClusterQueue",
                )
            },
            True,
            "Pending",
            "couldn't assign flavors to pod set learner: resource nvidia.com/gpu unavailable in "
            "ClusterQueue",
        ),
        (
            {"QuotaReserved": (False, "Inadmissible", "LocalQueue gpu-team doesn't exist")},
            True,
            "Inadmissible",
            "LocalQueue gpu-team doesn't exist",
        ),
        (
            {
                "Evicted": (True, "PodsReadyTimeout", "Exceeded the PodsReady timeout ns/wl"),
                **ADMITTED,
            },
            True,
            "PodsReadyTimeout",
            "evicted: Exceeded the PodsReady timeout ns/wl",
        ),
        (
            {
                "Requeued": (False, "PodsReadyTimeout", "Exceeded the PodsReady timeout ns/wl"),
                "QuotaReserved": (False, "Pending", "Exceeded the PodsReady timeout ns/wl"),
            },
            True,
            "PodsReadyTimeout",
            "evicted (PodsReadyTimeout: Exceeded the PodsReady timeout ns/wl); requeued after "
            "Kueue's backoff",
        ),
        ({}, False, "Deactivated", "deactivated (spec.active: false)"),
    ],
)
def test_a_queued_job_says_why_it_waits_in_kueues_words(conditions, active, reason, message):
    wl = workload(active, **conditions)
    out = step(spec(), queued(js(suspended=True), wl), {"phase": "Pending"})
    assert out.status["phase"] == "Pending" and out.suspend_jobset is None
    queued_cond = cond(out.status, "Queued")
    assert (queued_cond["status"], queued_cond["reason"]) == ("True", reason)
    assert queued_cond["message"].startswith(f"Workload {wl.name}: ")
    assert queued_cond["message"].endswith(message)
    assert cond(out.status, "Running")["reason"] == "Queued"
    assert message in cond(out.status, "Running")["message"]


def test_suspending_a_queued_job_deactivates_its_workload_and_leaves_the_jobset_to_kueue() -> None:
    """Kueue unsuspends any suspended JobSet whose Workload is admitted: patching the JobSet
    would loop. Its way to stop a job is the Workload's spec.active."""
    running = queued(js(), workload(**ADMITTED), pods("Running", "Running"), servers(4))
    out = step(spec(suspend=True), running, {"phase": "Running"})
    assert out.status["phase"] == "Suspended"
    assert out.suspend_jobset is None and out.activate_workload is False
    assert "deactivated" in cond(out.status, "Suspended")["message"]
    stopped = queued(js(suspended=True), workload(active=False))
    again = step(spec(suspend=True), stopped, out.status)
    assert again.activate_workload is None and again.suspend_jobset is None

    orphan = queued(js(), None, pods("Running", "Running"))  # its Workload was deleted
    assert step(spec(suspend=True), orphan, out.status).suspend_jobset is True

    resumed = step(spec(), stopped, again.status, NOW + timedelta(hours=1))
    assert resumed.activate_workload is True and resumed.suspend_jobset is None
    assert cond(resumed.status, "Suspended")["status"] == "False"
    assert resumed.status["phase"] == "Pending"
    assert cond(resumed.status, "Queued")["reason"] == "Deactivated"
    admitted = queued(js(), workload(**ADMITTED), pods("Running", "Running"), servers(4))
    back = step(spec(), admitted, resumed.status, NOW + timedelta(hours=1))
    assert back.status["phase"] == "Running" and back.activate_workload is None
    assert cond(back.status, "Queued")["reason"] == "Admitted"


def test_time_in_kueues_queue_does_not_count_against_the_deadline() -> None:
    """activeDeadlineSeconds counts running time, as a Job's does: from admission."""
    timed = spec(activeDeadlineSeconds=3600)
    created = compute(Observation({}, NOW, spec=timed, children=ChildrenSeen(desired=8))).status
    waiting = workload(QuotaReserved=(False, "Pending", "insufficient unused quota"))
    held = step(timed, queued(js(suspended=True), waiting), created, NOW + timedelta(hours=2))
    assert "startTime" not in held.status
    later = NOW + timedelta(hours=3)
    admitted = queued(js(), workload(**ADMITTED), pods("Running", "Running"), servers(4))
    running = step(timed, admitted, held.status, later)
    assert running.status["phase"] == "Running"
    assert running.status["startTime"] == later.strftime("%Y-%m-%dT%H:%M:%SZ")
    past = step(timed, admitted, running.status, later + timedelta(seconds=3601))
    assert past.status["phase"] == "Failed" and past.delete_jobset


def test_restarts_after_disruptions_beyond_the_cap_fail_the_job_and_stop_its_pods() -> None:
    """JobSet ignores maxRestarts for the disruption rule, and a kubelet's memory-pressure
    eviction is a disruption: past runPolicy.maxDisruptionRestarts the operator fails the job."""
    prev = {"phase": "Restarting", "restarts": 3, "startTime": "2026-01-01T11:00:00Z"}
    at_cap = JobSetView(restarts=4, restarts_counted=1)  # 3 disruptions, 1 learner failure
    out = step(spec(maxDisruptionRestarts=3), observed(pods("Pending", "Pending"), jobset=at_cap),
               prev)  # fmt: skip
    assert out.status["phase"] != "Failed" and not out.delete_jobset
    past = JobSetView(restarts=5, restarts_counted=1)
    out = step(spec(maxDisruptionRestarts=3), observed(pods("Pending"), jobset=past), prev)
    assert out.status["phase"] == "Failed" and out.delete_jobset
    c = cond(out.status, "Failed")
    assert c["reason"] == "DisruptionLimitExceeded"
    assert "after 4 disruptions" in c["message"] and "maxDisruptionRestarts=3" in c["message"]
    assert "learner.resources.limits.memory" in c["message"]
    assert out.status["restarts"] == 5 and out.status["completionTime"]
    # Counted restarts (learner failures) are JobSet's own maxRestarts, not this cap.
    counted = JobSetView(restarts=5, restarts_counted=5)
    out = step(spec(maxDisruptionRestarts=0), observed(pods("Pending"), jobset=counted), prev)
    assert out.status["phase"] != "Failed"


def test_a_claim_that_cannot_bind_shows_the_provisioners_reason() -> None:
    pvc = {"metadata": {"name": f"{JOB}-checkpoints", "uid": "c1"}, "status": {"phase": "Pending"}}
    events = [
        {"type": "Normal", "reason": "ExternalProvisioning", "message": "Waiting ...",
         "lastTimestamp": "2026-01-01T11:59:00Z", "involvedObject": {"uid": "c1"}},
        {"type": "Warning", "reason": "ProvisioningFailed", "message": "old",
         "lastTimestamp": "2026-01-01T11:58:00Z", "involvedObject": {"uid": "c1"}},
        {"type": "Warning", "reason": "ProvisioningFailed", "message": "rpc error: new",
         "lastTimestamp": "2026-01-01T11:59:30Z", "involvedObject": {"uid": "c1"}},
        {"type": "Warning", "reason": "ProvisioningFailed", "message": "an earlier claim's",
         "lastTimestamp": "2026-01-01T11:59:50Z", "involvedObject": {"uid": "c0"}},
    ]  # fmt: skip
    claim = views.ClaimView.from_claim(pvc, events)
    assert claim.warning == "ProvisioningFailed: rpc error: new"
    obs = Observed(jobset=js(), pods=pods("Pending", "Pending"), claim=claim)
    out = step(spec(), obs, None)
    running = cond(out.status, "Running")
    assert out.status["phase"] == "Pending" and running["reason"] == "ClaimPending"
    assert running["message"] == (
        f"checkpoint claim {JOB}-checkpoints is Pending: ProvisioningFailed: rpc error: new"
    )
    # Only progress so far (WaitForFirstConsumer, ExternalProvisioning): the pods' words stay.
    quiet = views.ClaimView.from_claim(pvc, events[:1])
    out = step(spec(), Observed(jobset=js(), pods=pods("Pending"), claim=quiet), None)
    assert cond(out.status, "Running")["reason"] == "PodsPending"


def test_failed_create_quotes_the_newest_refusal_of_the_job() -> None:
    def event(type_: str, reason: str, message: str, at: str) -> dict:
        return {"type": type_, "reason": reason, "message": message, "lastTimestamp": at}

    events = [
        event("Warning", "FailedCreate", "Error creating: exceeded quota", "2026-01-01T00:00:01Z"),
        event(
            "Warning", "FailedCreate", "Error creating: no PriorityClass", "2026-01-01T00:00:02Z"
        ),
        event("Normal", "SuccessfulCreate", "Created pod: j-learner-0-0-x", "2026-01-01T00:00:03Z"),
    ]
    assert views.failed_create("j-learner-0", events) == (
        "Job j-learner-0: Error creating: no PriorityClass"
    )
    assert views.failed_create("j-learner-0", events[2:]) == ""


def test_rollout_servers_the_api_server_refuses_are_named_in_rollout_ready() -> None:
    def event(job: str, message: str, at: str) -> dict:
        return {
            "type": "Warning",
            "reason": "FailedCreate",
            "message": message,
            "lastTimestamp": at,
            "involvedObject": {"kind": "Job", "name": job},
        }

    events = [
        event(f"{JOB}-rollout-0", "Error creating: exceeded quota", "2026-01-01T00:00:01Z"),
        event(f"{JOB}-rollout-1", "Error creating: exceeded quota", "2026-01-01T00:00:02Z"),
        event(f"{JOB}-learner-0", "Error creating: not a rollout Job", "2026-01-01T00:00:03Z"),
    ]
    refused = views.failed_creates([f"{JOB}-rollout-1", f"{JOB}-rollout-2"], events)
    assert refused == f"Job {JOB}-rollout-1: Error creating: exceeded quota"
    base = observed(pods("Running"))
    out = step(spec(), replace(base, rollout_failed_create=refused), None)
    ready = cond(out.status, "RolloutReady")
    assert (ready["status"], ready["reason"]) == ("False", "FailedCreate")
    assert ready["message"] == f"0/4 rollout servers ready; {refused}"
    assert cond(step(spec(), base, None).status, "RolloutReady")["reason"] == "ServersNotReady"
    pod = {"metadata": {"name": "p", "labels": {"batch.kubernetes.io/job-name": "j-rollout-3"}}}
    assert PodView.from_pod(pod).job == "j-rollout-3"
