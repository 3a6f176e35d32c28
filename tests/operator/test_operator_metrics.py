"""Operator metrics: reconcile outcomes are counted and timed; deleted jobs leave no series."""

from __future__ import annotations

import pytest

from gspo_operator.metrics import CONTROLLER, OperatorMetrics


def value(m: OperatorMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_reconcile_counts_success_and_error() -> None:
    m = OperatorMetrics()
    with m.reconcile():
        pass
    with pytest.raises(RuntimeError), m.reconcile():
        raise RuntimeError("boom")
    ok = value(m, "controller_runtime_reconcile_total", controller=CONTROLLER, result="success")
    err = value(m, "controller_runtime_reconcile_total", controller=CONTROLLER, result="error")
    assert (ok, err) == (1, 1)
    assert value(m, "controller_runtime_reconcile_errors_total", controller=CONTROLLER) == 1
    count = value(m, "controller_runtime_reconcile_time_seconds_count", controller=CONTROLLER)
    assert count == 2


def test_job_series_follow_the_job_and_vanish_when_it_is_forgotten() -> None:
    m = OperatorMetrics()
    m.set_job("ns", "a", "Running", ready=3, desired=4, step=7)
    m.set_job("ns", "a", "Restarting", ready=3, desired=4, step=7)
    phase = {"namespace": "ns", "gspojob": "a"}
    assert value(m, "gspo_operator_job_phase", **phase, phase="Restarting") == 1
    assert value(m, "gspo_operator_job_phase", **phase, phase="Running") == 0
    assert value(m, "gspo_operator_rollout_replicas", **phase, state="ready") == 3
    m.forget_job("ns", "a")
    assert value(m, "gspo_operator_job_phase", **phase, phase="Restarting") is None
    assert value(m, "gspo_operator_rollout_replicas", **phase, state="desired") is None


def test_jobs_by_phase_counts_every_phase() -> None:
    m = OperatorMetrics()
    m.count_phases(["Running", "Running", "Failed"])
    assert value(m, "gspo_operator_jobs", phase="Running") == 2
    assert value(m, "gspo_operator_jobs", phase="Failed") == 1
    assert value(m, "gspo_operator_jobs", phase="Pending") == 0
