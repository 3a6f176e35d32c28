"""status.compute as a whole: every status a run of observations can produce is one the CRD
and `kubectl get` accept, its phase agrees with its conditions, and the rules take
precedence in their order (a refused spec over everything, a refused child over the
lifecycle, a refused action and a missing JobSet API over what the lifecycle says)."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_admission import validate

from gspo_api.progress import LearnerProgress
from gspo_api.spec import MAX_CONDITIONS, GSPOJobStatus, Phase
from gspo_api.validation import Problem, parse_spec
from gspo_operator import crd, names
from gspo_operator.status import (
    TERMINAL,
    ChildrenSeen,
    ConditionType,
    Observation,
    Outcome,
    Refusal,
    compute,
    finished,
    refused_before_creation,
    rejected_at_creation,
)
from gspo_operator.views import (
    ClaimView,
    JobSetView,
    Observed,
    PodView,
    WorkloadView,
)

REPO = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())["spec"]
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB = "qwen3-30b-a3b-math"
_CRD = crd.render_crd()["spec"]["versions"][0]
STATUS_SCHEMA = _CRD["schema"]["openAPIV3Schema"]["properties"]["status"]
PRINTER_COLUMNS = _CRD["additionalPrinterColumns"]
JSON_TYPES = {"string": str, "integer": int, "number": (int, float)}


def _spec(**run_policy: Any) -> Any:
    raw = copy.deepcopy(RAW)
    raw["runPolicy"].update(run_policy)
    return parse_spec(raw)


SPECS = [
    _spec(),  # queued (the example names a Kueue queue)
    _spec(scheduling={}),
    _spec(scheduling={}, suspend=True),
    _spec(suspend=True),
    _spec(scheduling={}, activeDeadlineSeconds=60, ttlSecondsAfterFinished=30),
    _spec(scheduling={}, maxDisruptionRestarts=0, backoffLimit=1),
]
PROBLEMS = (Problem("spec.algorithm.groupSize", "1 leaves every response with zero advantage"),)
FAILED = "jobset failed (first failed job: qwen3-30b-a3b-math-learner-0)"
REFUSALS = [
    Refusal("blocked", "Forbidden", "the API server refused to create Secret x: forbidden"),
    Refusal("invalid", "Invalid", "the API server refused to create Service x: invalid"),
]


@st.composite
def observed(draw: st.DrawFn, restarts: int) -> Observed:
    jobset = (
        None
        if draw(st.integers(0, 3)) == 3
        else draw(
            st.builds(
                JobSetView,
                suspended=st.sampled_from([False, False, True]),
                restarts=st.just(restarts),
                restarts_counted=st.integers(0, restarts),
                conditions=st.sampled_from(
                    [
                        *[{}] * 6,
                        {"Failed": (True, "FailedJobs", FAILED)},
                        {"Completed": (True, "AllJobsCompleted", "done")},
                    ]
                ),
            )
        )
    )
    # The learner group: half the time both pods run in JobSet's current attempt.
    healthy = PodView("", phase="Running", ready=True, restart_attempt=restarts)
    pod = st.builds(
        PodView,
        phase=st.sampled_from(["Pending", "Running", "Failed", "Succeeded"]),
        ready=st.booleans(),
        restart_attempt=st.integers(0, restarts),
        exit_code=st.sampled_from([None, 1, 2]),
        message=st.sampled_from(["", "Error (exit code 1): out of memory"]),
    )
    learners = [
        replace(draw(st.just(healthy) | pod), name=f"{JOB}-learner-0-{i}-a", index=i)
        for i in range(draw(st.sampled_from([2, 1, 0])))
    ]
    server = st.builds(
        PodView,
        name=st.sampled_from([f"{JOB}-rollout-{i}-0-a" for i in range(4)]),
        role=st.just(names.ROLLOUT),
        phase=st.sampled_from(["Pending", "Running"]),
        ready=st.booleans(),
    )
    admitted = {
        "QuotaReserved": (True, "QuotaReserved", "reserved in cq"),
        "Admitted": (True, "Admitted", "admitted"),
    }
    workload = st.builds(
        WorkloadView,
        name=st.just("jobset-x"),
        active=st.booleans(),
        conditions=st.sampled_from([{}, admitted]),
        cluster_queue=st.just("cq"),
    )
    progress = st.builds(
        LearnerProgress,
        step=st.integers(0, 50),
        reward=st.none() | st.floats(0, 1),
        policy_version=st.integers(0, 50),
        server_versions=st.just({"http://rollout-0:8000": 3}),
    )
    return Observed(
        jobset=jobset,
        pods=learners + draw(st.lists(server, max_size=4)),
        progress=draw(st.none() | progress),
        kueue=draw(st.booleans()),
        workload=draw(st.none() | workload),
        workload_error=draw(st.sampled_from(["", "cannot read Kueue's Workloads"])),
        claim=draw(st.none() | st.just(ClaimView("ckpt", warning="ProvisioningFailed: no"))),
        failed_create=draw(st.sampled_from(["", "Job x: forbidden"])),
        rollout_failed_create=draw(st.sampled_from(["", "Job y: exceeded quota"])),
    )


@st.composite
def passes(draw: st.DrawFn) -> list[tuple[Observation, bool]]:
    """Observations as reconcile makes them, pass after pass (each one's status is the next
    one's previous): a job may start invalid, be edited, have children refused, and run. The
    flag: whether act's request is refused when the outcome asks for one."""
    spec = draw(st.sampled_from(SPECS))
    out: list[tuple[Observation, bool]] = []
    restarts = 0  # JobSet's count never goes down
    for i in range(draw(st.integers(1, 6))):
        restarts += draw(st.sampled_from([0, 0, 0, 1]))
        obs = Observation(
            {},
            NOW + timedelta(seconds=45 * i),
            spec=spec,
            problems=draw(st.sampled_from([(), (), (), (), (), PROBLEMS])),
            refused_fields=draw(st.sampled_from([(), (), ("learner.replicas",)])),
            generation=i + 1,
            children=ChildrenSeen(
                desired=9,
                made=draw(st.integers(0, 2)),
                jobset_unserved=draw(st.booleans()) and draw(st.booleans()),
                refusal=draw(st.sampled_from([*[None] * 8, *REFUSALS])),
            ),
            observed=draw(observed(restarts)),
        )
        out.append((obs, draw(st.booleans())))
    return out


def reconcile_pass(obs: Observation, refuse_act: bool) -> Outcome:
    """What reconcile hands compute, as its _observe and _act decide it (no I/O)."""
    if obs.problems and refused_before_creation(obs.previous):
        return compute(replace(obs, spec=None, children=None, observed=None))
    assert obs.children is not None
    if finished(obs.previous, valid=not obs.problems):  # the JobSet is not among the children
        obs = replace(obs, children=replace(obs.children, jobset_unserved=False))
    if obs.children.refusal is not None:
        obs = replace(obs, observed=None)
    out = compute(obs)
    asks = out.suspend_jobset is not None or out.activate_workload is not None
    if out.halt is None and asks and refuse_act:
        denied = Refusal("blocked", "Forbidden", "the API server refused to suspend JobSet x")
        out = compute(replace(obs, act_refusal=denied))
    return out


def check(status: dict[str, Any]) -> None:
    """What the API server and `kubectl get` require of a status, and what a reader of it
    relies on: the phase is told by a True condition of its name, Running by its phase."""
    assert validate(STATUS_SCHEMA, status, "status") == []
    GSPOJobStatus.model_validate(status)
    types = [c["type"] for c in status["conditions"]]
    assert set(types) <= set(get_args(ConditionType)), types
    assert len(types) == len(set(types)) <= MAX_CONDITIONS
    for c in status["conditions"]:
        assert c["status"] in ("True", "False") and c["reason"] and c["lastTransitionTime"]
    for column in PRINTER_COLUMNS:
        path = column["jsonPath"].split(".")
        if path[1] == "status" and path[2] in status:
            assert isinstance(status[path[2]], JSON_TYPES[column["type"]]), column
    phase: Phase | None = status.get("phase")
    assert phase is None or phase in get_args(Phase)
    true = {c["type"] for c in status["conditions"] if c["status"] == "True"}
    if phase not in (None, "Pending"):
        assert phase in true, (phase, true)
    if "Running" in true:
        assert phase == "Running", (phase, true)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(passes())
def test_every_status_a_run_of_passes_produces_is_one_the_crd_accepts(
    run: list[tuple[Observation, bool]],
) -> None:
    previous: dict[str, Any] = {}
    for obs, refuse_act in run:
        before = copy.deepcopy(previous)
        out = reconcile_pass(replace(obs, previous=previous), refuse_act)
        assert previous == before  # pure: the previous status is read, never edited
        check(out.status)
        assert out.phase == (out.status.get("phase") or "Pending")
        if out.halt == "invalid":
            assert out.status["phase"] == "Failed"
        if out.halt == "blocked":
            assert out.status["phase"] in ("Blocked", *TERMINAL)
            assert cond(out.status, "Blocked")["status"] == "True"
        if previous.get("phase") in TERMINAL and not rejected_at_creation(previous):
            # A finished job stays so (unless it was refused at creation and is fixed now).
            assert out.status["phase"] == previous["phase"]
            assert out.status.get("completionTime") == previous.get("completionTime")
        previous = out.status


# --- precedence, rule by rule ----------------------------------------------------------------

RUNNING_PODS = [
    PodView(f"{JOB}-learner-0-{i}-a", phase="Running", ready=True, index=i) for i in range(2)
] + [
    PodView(f"{JOB}-rollout-{i}-0-a", role=names.ROLLOUT, phase="Running", ready=True)
    for i in range(4)
]
RUNNING = Observed(jobset=JobSetView(), pods=RUNNING_PODS)
UNQUEUED = SPECS[1]


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    (found,) = [c for c in status["conditions"] if c["type"] == type_]
    return found


def running_status() -> dict[str, Any]:
    obs = Observation({}, NOW, spec=UNQUEUED, children=ChildrenSeen(9, made=9), observed=RUNNING)
    out = compute(obs)
    assert out.status["phase"] == "Running" and cond(out.status, "Created")["status"] == "True"
    return out.status


def test_a_spec_refused_at_creation_fails_the_job_before_anything_else() -> None:
    out = compute(Observation({}, NOW, problems=PROBLEMS, observed=RUNNING))
    assert out.status["phase"] == "Failed" and out.halt == "invalid"
    assert {c["type"] for c in out.status["conditions"]} == {"InvalidSpec", "Failed"}
    again = compute(Observation(out.status, NOW, problems=PROBLEMS))
    assert again.status == out.status and again.events == []  # said once


def test_a_refused_child_beats_what_the_pods_say() -> None:
    previous = running_status()
    for refusal, phase in zip(REFUSALS, ("Blocked", "Failed"), strict=True):
        children = ChildrenSeen(9, refusal=refusal)
        out = compute(Observation(previous, NOW, spec=UNQUEUED, children=children))
        assert out.status["phase"] == phase and out.halt == refusal.verdict
        assert cond(out.status, "Running")["status"] == "False"
        assert [e.reason for e in out.events] == [refusal.reason]
    blocked = compute(
        Observation(previous, NOW, spec=UNQUEUED, children=ChildrenSeen(9, refusal=REFUSALS[0]))
    ).status
    cleared = compute(
        Observation(blocked, NOW, spec=UNQUEUED, children=ChildrenSeen(9), observed=RUNNING)
    )
    assert cleared.status["phase"] == "Running"
    assert cond(cleared.status, "Blocked")["reason"] == "Cleared"


def test_a_child_refused_after_the_job_finished_leaves_it_finished() -> None:
    """A finished job still checks its ConfigMap, Services and Secret. One refused (a name
    taken, a 403, a 422) shows in the Blocked condition only: the phase, its reason and the
    completionTime stay, the finished Event is not posted again, finished() stays True (so
    reconcile never creates the JobSet again) and the TTL still deletes the job, through the
    refusal and after it clears."""
    spec = SPECS[4]  # ttlSecondsAfterFinished: 30
    running = compute(
        Observation({}, NOW, spec=spec, children=ChildrenSeen(9, made=9), observed=RUNNING)
    ).status
    ends = {
        "Succeeded": JobSetView(conditions={"Completed": (True, "AllJobsCompleted", "")}),
        "Failed": JobSetView(conditions={"Failed": (True, "FailedJobs", FAILED)}),
    }
    for phase, jobset in ends.items():
        ended = compute(
            Observation(
                running, NOW, spec=spec, children=ChildrenSeen(9), observed=Observed(jobset)
            )
        ).status
        assert ended["phase"] == phase
        kept = {k: ended[k] for k in ("phase", "completionTime")}
        for refusal in REFUSALS:
            previous, later = ended, NOW
            for children in (ChildrenSeen(9, refusal=refusal),) * 2 + (ChildrenSeen(9, made=1),):
                later += timedelta(seconds=20)
                observed = None if children.refusal else Observed(None)  # the JobSet is gone
                obs = Observation(previous, later, spec=spec, children=children, observed=observed)
                out = compute(obs)
                assert {k: out.status[k] for k in kept} == kept, (phase, refusal, children)
                assert cond(out.status, phase)["status"] == "True"
                assert finished(out.status, valid=True)
                assert out.delete_job == (later >= NOW + timedelta(seconds=30))  # the TTL
                reasons = [e.reason for e in out.events if e.reason != "Created"]
                assert reasons == ([refusal.reason] if previous is ended else []), reasons
                previous = out.status
            assert cond(previous, "Blocked")["reason"] == "Cleared"


def test_a_refused_action_and_a_missing_jobset_api_override_the_lifecycle() -> None:
    suspended = replace(RUNNING, jobset=JobSetView(suspended=True))
    obs = Observation(
        running_status(), NOW, spec=UNQUEUED, refused_fields=("learner.replicas",),
        children=ChildrenSeen(9), observed=suspended,
    )  # fmt: skip
    assert compute(obs).suspend_jobset is False  # the lifecycle resumes it
    denied = Refusal("blocked", "Forbidden", "the API server refused to resume JobSet x")
    out = compute(replace(obs, act_refusal=denied))
    assert out.status["phase"] == "Blocked" and out.halt == "blocked"
    # The spec rule's Event first, the refusal's, then the lifecycle's.
    assert [e.reason for e in out.events][:2] == ["SpecChangeRefused", "Forbidden"]
    unserved = ChildrenSeen(9, jobset_unserved=True)
    missing = compute(replace(obs, children=unserved, observed=RUNNING)).status
    assert missing["phase"] == "Pending"
    assert cond(missing, "Created")["reason"] == cond(missing, "Running")["reason"]
    assert cond(missing, "Running")["reason"] == "JobSetMissing"


def test_an_invalid_edit_of_a_running_job_keeps_it_running_and_says_so_once() -> None:
    previous = running_status()
    obs = Observation(
        previous, NOW, spec=UNQUEUED, problems=PROBLEMS, children=ChildrenSeen(9), observed=RUNNING
    )
    out = compute(obs)
    assert out.status["phase"] == "Running"
    assert cond(out.status, "InvalidSpec")["status"] == "True"
    assert [e.reason for e in out.events] == ["InvalidSpec"]
    assert compute(replace(obs, previous=out.status)).events == []
    fixed = compute(replace(obs, previous=out.status, problems=()))
    assert cond(fixed.status, "InvalidSpec")["reason"] == "SpecAccepted"


def test_a_job_that_failed_after_an_invalid_edit_keeps_its_failure() -> None:
    """An invalid edit's InvalidSpec has the reason a refusal at creation has; Created tells
    them apart. The job's own failure stays while the spec is invalid and after it is fixed:
    no InvalidSpec Event again, no status wiped, no fresh start."""
    obs = Observation(
        running_status(), NOW, spec=UNQUEUED, problems=PROBLEMS, children=ChildrenSeen(9),
        observed=RUNNING,
    )  # fmt: skip
    edited = compute(obs).status
    ended = Observed(JobSetView(conditions={"Failed": (True, "FailedJobs", FAILED)}))
    failed = compute(replace(obs, previous=edited, observed=ended)).status
    assert failed["phase"] == "Failed" and not rejected_at_creation(failed)
    assert not refused_before_creation(failed)
    for problems in (PROBLEMS, ()):
        later = replace(obs, previous=failed, problems=problems, observed=Observed(None))
        out = reconcile_pass(later, refuse_act=False)
        assert finished(failed, valid=not problems)
        assert out.status["phase"] == "Failed" and out.halt is None
        assert cond(out.status, "Failed") == cond(failed, "Failed")
        assert out.status["completionTime"] == failed["completionTime"]
        assert "InvalidSpec" not in [e.reason for e in out.events]


def test_a_spec_fixed_after_it_was_refused_at_creation_starts_the_job_afresh() -> None:
    refused = compute(Observation({}, NOW, problems=PROBLEMS)).status
    later = NOW + timedelta(minutes=5)
    out = compute(Observation(refused, later, spec=UNQUEUED, children=ChildrenSeen(9, made=9)))
    assert out.status["phase"] == "Pending" and out.halt is None
    assert cond(out.status, "InvalidSpec")["reason"] == "SpecAccepted"
    assert cond(out.status, "Created")["status"] == "True"
    assert "Failed" not in {c["type"] for c in out.status["conditions"]}
    assert out.status["startTime"] == later.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert out.phase not in TERMINAL
