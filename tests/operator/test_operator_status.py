"""The lifecycle and failure policy as tables: observed children -> phase, conditions, actions."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from gspo_operator import status
from gspo_operator.status import Observed, PodView, compute
from gspo_trainer.progress import LearnerProgress
from gspo_trainer.validation import parse_spec

REPO = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())["spec"]
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB = "qwen3-30b-a3b-math"


def spec(**run_policy):
    raw = copy.deepcopy(RAW)
    raw["runPolicy"].update(run_policy)
    return parse_spec(raw)


def pods(*phases: str, restart: int = 0, ready: bool = True) -> list[PodView]:
    return [
        PodView(f"{JOB}-learner-{i}", phase=p, ready=ready and p == "Running", restart=restart)
        for i, p in enumerate(phases)
    ]


def cond(st: dict, type_: str) -> dict:
    (found,) = [c for c in st["conditions"] if c["type"] == type_]
    return found


def step(s, observed, prev, now=NOW):
    return compute(s, observed, prev, now, generation=1)


def test_pending_until_every_learner_pod_runs() -> None:
    out = step(spec(), Observed(pods("Running", "Pending")), None)
    assert out.status["phase"] == "Pending"
    assert out.ensure_children and out.delete_pods == []
    assert cond(out.status, "LearnerReady")["status"] == "False"
    assert out.status["rolloutReady"] == "0/4"
    assert out.events[0].reason == "Pending"


def test_running_with_progress_written_to_status() -> None:
    progress = LearnerProgress(step=12, reward=0.41234, last_checkpoint="step-000010",
                               policy_version=12, phase="Running")  # fmt: skip
    prev = step(spec(), Observed(pods("Pending", "Pending")), None).status
    out = step(
        spec(), Observed(pods("Running", "Running"), rollout_ready=3, progress=progress), prev
    )
    st = out.status
    assert st["phase"] == "Running"
    assert (st["step"], st["reward"], st["lastCheckpoint"], st["policyVersion"]) == (
        12, 0.4123, "step-000010", 12)  # fmt: skip
    assert st["rolloutReady"] == "3/4"
    assert cond(st, "LearnerReady")["status"] == "True"
    assert cond(st, "RolloutReady")["status"] == "False"
    assert cond(st, "WeightsSynced")["status"] == "True"
    assert cond(st, "Running")["status"] == "True"
    assert [e.reason for e in out.events] == ["Running"]
    assert out.rollout_replicas == 4


def test_unchanged_observation_gives_an_identical_status() -> None:
    """The timer patches only when the status changed: a steady job must compute equal dicts."""
    obs = Observed(pods("Running", "Running"), rollout_ready=4)
    first = step(spec(), obs, None).status
    again = step(spec(), obs, copy.deepcopy(first), NOW + timedelta(minutes=5))
    assert again.status == first
    assert again.events == []


def test_learner_failure_restarts_the_whole_group() -> None:
    prev = step(spec(), Observed(pods("Running", "Running")), None).status
    failed = [
        pods("Running")[0],
        PodView(f"{JOB}-learner-1", phase="Failed", message="OOMKilled (exit code 137)"),
    ]
    out = step(spec(backoffLimit=2), Observed(failed), prev)
    assert out.status["phase"] == "Restarting"
    assert out.status["restarts"] == 1
    assert sorted(out.delete_pods) == [f"{JOB}-learner-0", f"{JOB}-learner-1"]
    assert not out.ensure_children
    assert "OOMKilled" in cond(out.status, "Restarting")["message"]
    assert [e.reason for e in out.events] == ["LearnerRestart"]

    # Old pods terminating: still Restarting, recreate the missing ones of generation 1.
    old = [PodView(p.name, phase="Running", restart=0, deleting=True) for p in failed]
    out2 = step(spec(backoffLimit=2), Observed(old), out.status)
    assert out2.status["phase"] == "Restarting" and out2.ensure_children
    assert out2.status["restarts"] == 1

    # The new group runs: back to Running, Restarting condition cleared.
    out3 = step(spec(backoffLimit=2), Observed(pods("Running", "Running", restart=1)), out2.status)
    assert out3.status["phase"] == "Running"
    assert cond(out3.status, "Restarting")["status"] == "False"


def test_backoff_limit_exhausted_fails_the_job() -> None:
    prev = {"phase": "Running", "restarts": 2, "startTime": "2026-01-01T11:00:00Z"}
    out = step(spec(backoffLimit=2), Observed(pods("Failed", "Running", restart=2)), prev)
    assert out.status["phase"] == "Failed"
    assert cond(out.status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert out.status["completionTime"] == "2026-01-01T12:00:00Z"
    assert out.delete_pods == [f"{JOB}-learner-1"]  # the still-running rank stops
    assert out.rollout_replicas == 0


def test_failures_of_an_older_group_do_not_count_again() -> None:
    prev = {"phase": "Restarting", "restarts": 1, "startTime": "2026-01-01T11:00:00Z"}
    observed = Observed([*pods("Failed", "Failed", restart=0)])
    out = step(spec(backoffLimit=1), observed, prev)
    assert out.status["phase"] == "Restarting" and out.status["restarts"] == 1
    assert sorted(out.delete_pods) == [f"{JOB}-learner-0", f"{JOB}-learner-1"]


def test_succeeded_when_every_learner_pod_exits_zero_then_ttl_deletes() -> None:
    prev = {"phase": "Running", "startTime": "2026-01-01T11:00:00Z", "step": 1000}
    out = step(spec(ttlSecondsAfterFinished=60), Observed(pods("Succeeded", "Succeeded")), prev)
    assert out.status["phase"] == "Succeeded"
    assert cond(out.status, "Succeeded")["status"] == "True"
    assert out.rollout_replicas == 0 and not out.delete_job
    later = step(
        spec(ttlSecondsAfterFinished=60), Observed(), out.status, NOW + timedelta(seconds=59)
    )
    assert not later.delete_job
    later = step(
        spec(ttlSecondsAfterFinished=60), Observed(), out.status, NOW + timedelta(seconds=60)
    )
    assert later.delete_job and later.status["phase"] == "Succeeded"


def test_active_deadline_fails_the_job() -> None:
    prev = {"phase": "Running", "startTime": "2026-01-01T11:00:00Z"}
    out = step(spec(activeDeadlineSeconds=3600), Observed(pods("Running", "Running")), prev)
    assert out.status["phase"] == "Failed"
    assert cond(out.status, "Failed")["reason"] == "DeadlineExceeded"
    assert sorted(out.delete_pods) == [f"{JOB}-learner-0", f"{JOB}-learner-1"]
    fine = step(spec(activeDeadlineSeconds=3601), Observed(pods("Running", "Running")), prev)
    assert fine.status["phase"] == "Running"


def test_suspend_stops_pods_and_resume_continues() -> None:
    prev = step(spec(), Observed(pods("Running", "Running"), rollout_ready=4), None).status
    out = step(spec(suspend=True), Observed(pods("Running", "Running")), prev)
    assert out.status["phase"] == "Suspended"
    assert sorted(out.delete_pods) == [f"{JOB}-learner-0", f"{JOB}-learner-1"]
    assert out.rollout_replicas == 0 and not out.ensure_children
    assert cond(out.status, "Suspended")["status"] == "True"
    gone = step(spec(suspend=True), Observed(), out.status)
    assert gone.status["phase"] == "Suspended" and gone.delete_pods == []
    resumed = step(spec(), Observed(), gone.status, NOW + timedelta(hours=1))
    assert resumed.ensure_children and resumed.rollout_replicas == 4
    assert resumed.status["phase"] == "Pending"
    assert cond(resumed.status, "Suspended")["status"] == "False"
    assert resumed.status["startTime"] == "2026-01-01T13:00:00Z"


def test_condition_transition_time_changes_only_on_flip() -> None:
    first = step(spec(), Observed(pods("Running", "Pending")), None, NOW).status
    t0 = cond(first, "LearnerReady")["lastTransitionTime"]
    same = step(
        spec(), Observed(pods("Running", "Pending")), first, NOW + timedelta(minutes=1)
    ).status
    assert cond(same, "LearnerReady")["lastTransitionTime"] == t0
    flip = step(
        spec(), Observed(pods("Running", "Running")), same, NOW + timedelta(minutes=2)
    ).status
    assert cond(flip, "LearnerReady")["lastTransitionTime"] == "2026-01-01T12:02:00Z"


def test_pod_view_reads_a_failed_pod() -> None:
    pod = {
        "metadata": {"name": "j-learner-0", "annotations": {"gspo.dev/restart": "2"}},
        "status": {
            "phase": "Failed",
            "podIP": "10.0.0.5",
            "containerStatuses": [{"state": {"terminated": {"reason": "Error", "exitCode": 1}}}],
        },
    }
    view = PodView.from_pod(pod)
    assert (view.phase, view.restart, view.ip, view.ready) == ("Failed", 2, "10.0.0.5", False)
    assert view.message == "Error (exit code 1)"


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"rollout": {"replicas": 8}}, []),
        ({"runPolicy": {"suspend": True, "backoffLimit": 9}}, []),
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
    from gspo_trainer.validation import Problem

    st, event = status.invalid_spec(None, NOW, [Problem("spec.algorithm.groupSize", "too small")])
    assert st["phase"] == "Failed"
    assert cond(st, "InvalidSpec")["message"] == "spec.algorithm.groupSize: too small"
    assert event.type == "Warning"
    st, event = status.refused_change({"phase": "Running"}, NOW, ["learner.replicas"])
    assert st["phase"] == "Running"
    assert "spec.learner.replicas" in cond(st, "InvalidSpec")["message"]
    assert cond(status.accepted_change(st, NOW), "InvalidSpec")["status"] == "False"
