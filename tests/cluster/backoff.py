"""The two back-offs a real cluster puts between failures, counted as Kubernetes counts them.

Why: a stand-in that restarts a crashed container or replaces a failed pod at once hides what
a user waits through on a real cluster (a rollout server that keeps failing is replaced after
10 s, 20 s, 40 s, ...; a crash-looping container restarts after 0 s, 10 s, 20 s, ...), and what
the operator must show meanwhile. Both are pure here (the caller passes the clock's readings) so
tests check the sequence of delays against a fake clock.

Scale: the local cluster runs every duration multiplied by `TIME_SCALE` (0.05: 10 s becomes
0.5 s, the Job controller's 10-minute cap 30 s, the kubelet's 5-minute cap 15 s and its
10-minute reset window 30 s), so that its tests stay fast while the order, the doubling, the caps
and the resets stay those of the real components.

1. The Job controller's pod-failure back-off (kubernetes pkg/controller/job/backoff_utils.go,
   newBackoffRecord and getRemainingTimeForFailuresCount; the constants in job_controller.go:
   DefaultJobPodFailureBackOff 10 s, MaxJobPodFailureBackOff 10 min; read at master, 2026, the
   same since v1.28. The Job concept page still says "capped at six minutes", the cap of the
   controller before v1.28). One record per Job (namespace/name), not per pod: the number of pod
   failures since the Job's last success and the time of the last one. A sync that sees new
   successes counts only the failures that finished after the latest of them (none: the count
   drops to 0); failed pods include those a podFailurePolicy Ignores. Before creating pods the
   controller waits `10 s * 2^(failures-1)` (capped) after the last failure: the first
   replacement 10 s after the first failure. The record goes when the Job finishes or is
   deleted. Not modelled: backoffLimitPerIndex's per-index records (the stand-in does not
   implement per-index limits); a pod's finish time is when the controller first sees it
   finished (the store's timestamps have one-second precision, too coarse for scaled delays; the
   real one reads the containers' finishedAt).

2. The kubelet's CrashLoopBackOff (kubernetes pkg/kubelet/kubelet.go: initialCrashLoopBackOff
   10 s, MaxCrashLoopBackOff 300 s, newCrashLoopBackOff; pkg/kubelet/kuberuntime/
   kuberuntime_manager.go doBackOff; client-go util/flowcontrol/backoff.go Backoff; read at
   master, 2026, as v1.35 ships them with the default feature gates). One entry per container.
   When a container that exited must start again: if an entry exists, has not expired and
   `now - finishedAt < entry.backoff`, it waits (waiting reason CrashLoopBackOff, "back-off 20s
   restarting failed container=..."); otherwise Next: a missing or expired entry starts at 10 s,
   an existing one doubles (capped at 300 s), and its lastUpdate becomes now, the restart. So the
   first restart is immediate and the next ones wait 10 s, 20 s, 40 s, ... 300 s. An entry
   expires (back to 10 s) when the container finished more than 2 x 300 s after its last restart,
   that is after running 10 minutes. Not modelled: ReduceDefaultCrashLoopBackOffDecay (alpha,
   1 s to 60 s) and KubeletCrashLoopBackOffMax's per-node maximum, the 1 s PLEG relist before a
   restart, the periodic GC of entries (same effect as expiry), jitter (the kubelet uses none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIME_SCALE = 0.05  # seconds of the local cluster per second of a real one

JOB_POD_FAILURE_BACKOFF_S = 10.0  # DefaultJobPodFailureBackOff
JOB_POD_FAILURE_BACKOFF_MAX_S = 600.0  # MaxJobPodFailureBackOff
CRASH_LOOP_BACKOFF_S = 10.0  # initialCrashLoopBackOff
CRASH_LOOP_BACKOFF_MAX_S = 300.0  # MaxCrashLoopBackOff (kubelet config v1beta1.MaxContainerBackOff)


# --- the Job controller ---------------------------------------------------------------------


@dataclass(frozen=True)
class PodFailureRecord:
    """backoffRecord: pod failures since the Job's last success, and when the last one ended."""

    failures: int = 0
    last_failure_s: float | None = None


def next_record(
    record: PodFailureRecord, succeeded_s: list[float], failed_s: list[float]
) -> PodFailureRecord:
    """newBackoffRecord: the record after a sync that saw pods newly finished at these times."""
    failed = sorted(failed_s)
    if not succeeded_s:
        if not failed:
            return record
        return PodFailureRecord(record.failures + len(failed), failed[-1])
    last_success = max(succeeded_s)
    after = [t for t in failed if t > last_success]
    return PodFailureRecord(len(after), after[-1] if after else None)


def pod_failure_delay_s(
    record: PodFailureRecord,
    now_s: float,
    base_s: float = JOB_POD_FAILURE_BACKOFF_S,
    max_s: float = JOB_POD_FAILURE_BACKOFF_MAX_S,
) -> float:
    """getRemainingTimeForFailuresCount: how long pod creation still waits (0: create now)."""
    if record.failures == 0 or record.last_failure_s is None:
        return 0.0
    backoff = base_s
    for _ in range(1, record.failures):
        backoff *= 2
        if backoff >= max_s:
            backoff = max_s
            break
    elapsed = now_s - record.last_failure_s
    return 0.0 if backoff < elapsed else backoff - elapsed


# --- the kubelet ----------------------------------------------------------------------------


@dataclass
class _Entry:
    backoff_s: float
    last_update_s: float


@dataclass
class CrashLoopBackOff:
    """flowcontrol.Backoff as the kubelet drives it from doBackOff (see the module docstring)."""

    initial_s: float = CRASH_LOOP_BACKOFF_S
    max_s: float = CRASH_LOOP_BACKOFF_MAX_S
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def _expired(self, event_s: float, entry: _Entry) -> bool:
        return event_s - entry.last_update_s > 2 * self.max_s  # hasExpired

    def delay_s(self, key: str, finished_s: float, now_s: float) -> float:
        """IsInBackOffSince, as the time left: 0 when the container may start now."""
        entry = self._entries.get(key)
        if entry is None or self._expired(finished_s, entry):
            return 0.0
        return max(0.0, entry.backoff_s - (now_s - finished_s))

    def current_s(self, key: str) -> float:
        """Get: the entry's back-off (what the CrashLoopBackOff message says)."""
        entry = self._entries.get(key)
        return entry.backoff_s if entry is not None else 0.0

    def next(self, key: str, finished_s: float, now_s: float) -> None:
        """Next: called as the container starts again after an exit at `finished_s`."""
        entry = self._entries.get(key)
        if entry is None or self._expired(finished_s, entry):
            entry = self._entries[key] = _Entry(self.initial_s, now_s)
        else:
            entry.backoff_s = min(entry.backoff_s * 2, self.max_s)
        entry.last_update_s = now_s

    def forget(self, key_prefix: str) -> None:
        """Drop a pod's entries (it is gone; the GC would drop them after 2 x max)."""
        for key in [k for k in self._entries if k.startswith(key_prefix)]:
            del self._entries[key]


def go_duration(seconds: float) -> str:
    """A whole number of seconds as Go's time.Duration prints it: 10s, 1m20s, 5m0s."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60}s"
