"""The operator's Prometheus metrics.

Reconcile metrics keep controller-runtime's names, so dashboards users already have for
other operators work unchanged; the gspo_operator_ ones describe the jobs themselves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gspo_api.spec import Phase

CONTROLLER = "gspojob"
RESULTS = ("success", "error", "requeue")
PHASES: tuple[str, ...] = get_args(Phase)


class OperatorMetrics:
    """Every metric the operator exports, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconcile_total = Counter(
            "controller_runtime_reconcile",  # exposed with _total, as controller-runtime does
            "Reconciliations per controller, by result.",
            ["controller", "result"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "controller_runtime_reconcile_errors",
            "Reconciliations that ended in an error.",
            ["controller"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "controller_runtime_reconcile_time_seconds",
            "Seconds per reconciliation.",
            ["controller"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        for result in RESULTS:
            self.reconcile_total.labels(CONTROLLER, result)
        self.reconcile_errors.labels(CONTROLLER)
        self.jobs = Gauge(
            "gspo_operator_jobs",
            "GSPOJobs this operator watches, by phase.",
            ["phase"],
            registry=r,
        )
        self.job_phase = Gauge(
            "gspo_operator_job_phase",
            "1 for each job's current phase, 0 for the others.",
            ["namespace", "gspojob", "phase"],
            registry=r,
        )
        self.rollout_replicas = Gauge(
            "gspo_operator_rollout_replicas",
            "Rollout servers per job, desired and ready.",
            ["namespace", "gspojob", "state"],
            registry=r,
        )
        self.learner_restarts = Counter(
            "gspo_operator_learner_restarts",
            "Learner group restarts from the latest checkpoint.",
            ["namespace", "gspojob"],
            registry=r,
        )
        self.step = Gauge(
            "gspo_operator_job_step",
            "Training step each job's learner last reported.",
            ["namespace", "gspojob"],
            registry=r,
        )
        # Two replicas run (leader election); each one's /metrics tells which one reconciles.
        self.leader = Gauge(
            "gspo_operator_leader",
            "1 on the replica that holds the leader-election Lease and reconciles, 0 on a standby.",
            registry=r,
        )

    @contextmanager
    def reconcile(self) -> Iterator[None]:
        """Time one reconciliation and count its result (an exception counts as an error)."""
        start = time.perf_counter()
        try:
            yield
        except Exception:
            self.reconcile_total.labels(CONTROLLER, "error").inc()
            self.reconcile_errors.labels(CONTROLLER).inc()
            raise
        else:
            self.reconcile_total.labels(CONTROLLER, "success").inc()
        finally:
            self.reconcile_seconds.labels(CONTROLLER).observe(time.perf_counter() - start)

    def set_job(
        self, namespace: str, name: str, phase: Phase, ready: int, desired: int, step: int
    ) -> None:
        for candidate in PHASES:
            self.job_phase.labels(namespace, name, candidate).set(1 if candidate == phase else 0)
        self.rollout_replicas.labels(namespace, name, "desired").set(desired)
        self.rollout_replicas.labels(namespace, name, "ready").set(ready)
        self.step.labels(namespace, name).set(step)

    def forget_job(self, namespace: str, name: str) -> None:
        """Drop a deleted job's series so alerts about it resolve."""
        for candidate in PHASES:
            _remove(self.job_phase, namespace, name, candidate)
        for state in ("desired", "ready"):
            _remove(self.rollout_replicas, namespace, name, state)
        _remove(self.step, namespace, name)
        _remove(self.learner_restarts, namespace, name)

    def count_phases(self, phases: list[Phase]) -> None:
        for candidate in PHASES:
            self.jobs.labels(candidate).set(sum(1 for p in phases if p == candidate))


def _remove(metric: Gauge | Counter, *labels: str) -> None:
    with suppress(KeyError):
        metric.remove(*labels)
