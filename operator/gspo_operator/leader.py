"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's tools/leaderelection does it.

Two operator replicas run; only the one holding the Lease reconciles, so kopf's handlers never
run twice for one event, and the other takes over when the leader dies. The Lease's spec is
client-go's LeaderElectionRecord: `holderIdentity`, `leaseDurationSeconds`, `acquireTime` and
`renewTime` (MicroTime) and `leaseTransitions`, so `kubectl get lease` and any tooling that
reads controller leases show who leads.

The rules, client-go's:
- a candidate takes the Lease only when it has no holder, or when the holder's record has not
  changed for `leaseDurationSeconds` *as measured on the candidate's own clock from when it
  first saw that record* (client-go's observedTime; the renewTime written by another node is
  never compared with our clock, so clock skew between nodes does not matter);
- every write is a replace carrying the resourceVersion that was read, so two candidates that
  both see an expired Lease cannot both win: the API server answers the second with 409
  Conflict, and a conflict means "you lost this round";
- the leader renews every retry period and stops leading when it has not renewed within the
  renew deadline (shorter than the lease duration, so it stops before anyone may take over);
- a leader that stops cleanly releases the Lease (empty holder, a 1 s duration) so a standby
  takes over on its next poll instead of waiting out the lease.

The decisions are pure functions of plain data (`observe`, `decide`, `claim`, `released`,
`must_give_up`), tested by tables; `LeaderElector` does the I/O around them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_operator.kube import ApiError, Kube

Obj = dict[str, Any]
log = logging.getLogger("gspo_operator.leader")

LEASE_API_VERSION = "coordination.k8s.io/v1"
DEFAULT_LEASE_NAME = "gspo-operator"
# client-go jitters each retry by up to 1.2x to spread a herd of candidates; two replicas are no
# herd, and a small jitter keeps a takeover after a crash near lease duration + retry period.
JITTER = 0.2
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


# --- plain data ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """client-go's three durations, with its defaults (kube-controller-manager's too)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        # client-go's NewLeaderElector checks: the leader must give up (renew deadline) before a
        # standby may take over (lease duration), and must get more than one try at renewing.
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError("the lease duration must be longer than the renew deadline")
        if not self.renew_deadline_s > self.retry_period_s * (1 + JITTER):
            raise ValueError(f"the renew deadline must exceed {1 + JITTER} x the retry period")
        if self.retry_period_s <= 0:
            raise ValueError("the retry period must be positive")


@dataclass(frozen=True)
class Record:
    """A Lease's spec (client-go's LeaderElectionRecord); empty `holder` means free."""

    holder: str = ""
    lease_duration_s: int = 0
    acquire_time: dt.datetime | None = None
    renew_time: dt.datetime | None = None
    transitions: int = 0

    @classmethod
    def from_lease(cls, lease: Obj) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=parse_micro_time(spec.get("acquireTime")),
            renew_time=parse_micro_time(spec.get("renewTime")),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def to_spec(self) -> Obj:
        spec: Obj = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration_s,
            "leaseTransitions": self.transitions,
        }
        if self.acquire_time is not None:
            spec["acquireTime"] = micro_time(self.acquire_time)
        if self.renew_time is not None:
            spec["renewTime"] = micro_time(self.renew_time)
        return spec


@dataclass(frozen=True)
class Observed:
    """A record as this candidate saw it, and when (its monotonic clock) it first saw it."""

    record: Record
    at: float


class Action(enum.Enum):
    CREATE = "create"  # no Lease yet: create it, holding it
    ACQUIRE = "acquire"  # free, released or expired: take it over
    RENEW = "renew"  # ours: renew it
    WAIT = "wait"  # another holder's lease is still valid


def micro_time(t: dt.datetime) -> str:
    """Kubernetes MicroTime: RFC 3339 in UTC with exactly six fractional digits."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


# --- the decisions (pure) ---------------------------------------------------------------------


def observe(previous: Observed | None, record: Record, now: float) -> Observed:
    """Keep the first sighting of an unchanged record; a changed record (a renewal, a new
    holder) restarts the clock. Only this local time decides expiry, never `renew_time`."""
    if previous is not None and previous.record == record:
        return previous
    return Observed(record, now)


def expires_at(observed: Observed) -> float:
    return observed.at + observed.record.lease_duration_s


def decide(observed: Observed | None, identity: str, now: float) -> Action:
    """What a candidate does with the Lease as it last saw it (None: there is none)."""
    if observed is None:
        return Action.CREATE
    holder = observed.record.holder
    if holder == identity:
        return Action.RENEW
    if not holder or now >= expires_at(observed):
        return Action.ACQUIRE
    return Action.WAIT


def claim(
    action: Action, old: Record | None, identity: str, now: dt.datetime, duration_s: int
) -> Record:
    """The record to write for CREATE, ACQUIRE or RENEW (client-go's tryAcquireOrRenew): a
    renewal keeps acquireTime and the transition count; a takeover counts one transition."""
    if action is Action.RENEW and old is not None:
        return Record(identity, duration_s, old.acquire_time or now, now, old.transitions)
    if action is Action.ACQUIRE and old is not None:
        return Record(identity, duration_s, now, now, old.transitions + 1)
    if action is Action.CREATE:
        return Record(identity, duration_s, now, now, 0)
    raise ValueError(f"nothing to write for {action.name} of {old}")


def released(old: Record, now: dt.datetime) -> Record:
    """client-go's release: no holder and a 1 s duration, transitions kept."""
    return Record("", 1, now, now, old.transitions)


def must_give_up(last_renewed: float, now: float, timing: Timing) -> bool:
    """The leader stops leading when its last successful renewal (the moment it was *sent*,
    so request latency counts against it) is a renew deadline old."""
    return now - last_renewed >= timing.renew_deadline_s


def identity_of(env: dict[str, str] | None = None) -> str:
    """$POD_NAME (the downward API) or the hostname, plus a random suffix: a restarted
    container in the same pod is a new candidate, never mistaken for the leader it was."""
    env = dict(os.environ) if env is None else env
    return f"{env.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def default_namespace(env: dict[str, str] | None = None) -> str:
    """$POD_NAMESPACE, else the service account's namespace when in a pod, else 'default'."""
    env = dict(os.environ) if env is None else env
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


# --- the Lease through the API ----------------------------------------------------------------


class Conflict(Exception):
    """Another writer changed or created the Lease first (HTTP 409): this round is lost."""


class LeaseLock:
    """Get, create and replace one Lease through `Kube.request` (the official client)."""

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.collection = f"/apis/{LEASE_API_VERSION}/namespaces/{namespace}/leases"

    def describe(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def get(self) -> Obj | None:
        try:
            return await self.kube.request("GET", f"{self.collection}/{self.name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, record: Record) -> Obj:
        body = {
            "apiVersion": LEASE_API_VERSION,
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": record.to_spec(),
        }
        try:
            return await self.kube.request("POST", self.collection, body=body)
        except ApiError as exc:
            if exc.status == 409:
                raise Conflict(str(exc)) from exc
            raise

    async def replace(self, lease: Obj, record: Record) -> Obj:
        """PUT `record` over `lease` as read: its resourceVersion makes the write conditional."""
        body = {**lease, "spec": {**(lease.get("spec") or {}), **record.to_spec()}}
        try:
            return await self.kube.request("PUT", f"{self.collection}/{self.name}", body=body)
        except ApiError as exc:
            if exc.status == 409:
                raise Conflict(str(exc)) from exc
            raise


# --- the elector ------------------------------------------------------------------------------


class LeaderElector:
    """One candidate: `acquire` waits until it leads, `hold` renews until it loses or is told
    to stop, `release` gives the Lease up. Not reentrant: one task drives it at a time."""

    def __init__(
        self,
        lock: LeaseLock,
        identity: str,
        timing: Timing | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.lock, self.identity = lock, identity
        self.timing = timing or Timing()
        self.clock, self.wall = clock, wall
        self.observed: Observed | None = None
        self.lease: Obj | None = None  # the Lease as last read or written (its resourceVersion)
        self.last_renewed = float("-inf")  # when the last successful write was sent
        self.leader = ""  # the holder last seen, for "new leader" logs

    @property
    def is_leader(self) -> bool:
        return self.observed is not None and self.observed.record.holder == self.identity

    async def try_acquire_or_renew(self) -> bool:
        """One round: read the Lease, decide, write if the decision is to. True while we lead."""
        sent = self.clock()
        duration = round(self.timing.lease_duration_s)
        if self.is_leader and self.lease is not None:
            # client-go's fast path: the leader replaces the Lease it last wrote, unread; a
            # conflict (someone wrote since) falls back to reading it.
            assert self.observed is not None
            record = claim(Action.RENEW, self.observed.record, self.identity, self.wall(), duration)
            try:
                self._wrote(await self.lock.replace(self.lease, record), record, sent)
                return True
            except Conflict:
                log.info("Lease %s changed since we renewed it; reading it", self.lock.describe())
        lease = await self.lock.get()
        if lease is None:
            record = claim(Action.CREATE, None, self.identity, self.wall(), duration)
            try:
                self._wrote(await self.lock.create(record), record, sent)
            except Conflict:
                return False
            return True
        self.lease = lease
        self.observed = observe(self.observed, Record.from_lease(lease), self.clock())
        self._note_leader(self.observed.record.holder)
        action = decide(self.observed, self.identity, self.clock())
        if action is Action.WAIT:
            return False
        record = claim(action, self.observed.record, self.identity, self.wall(), duration)
        try:
            self._wrote(await self.lock.replace(lease, record), record, sent)
        except Conflict:
            return False
        return True

    def _wrote(self, lease: Obj, record: Record, sent: float) -> None:
        self.lease = lease
        self.observed = Observed(record, self.clock())
        self.last_renewed = sent
        self._note_leader(self.identity)

    def _note_leader(self, holder: str) -> None:
        if holder and holder != self.leader and holder != self.identity:
            log.info("New leader elected: %s (lease %s)", holder, self.lock.describe())
        self.leader = holder

    async def _round(self, timeout_s: float) -> bool:
        """A round that fails rather than hangs or raises (the API may be down)."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.1)):
                return await self.try_acquire_or_renew()
        except TimeoutError:
            log.error(
                "Lease %s: no answer from the API within %.1fs", self.lock.describe(), timeout_s
            )
        except (ApiError, OSError, ValueError) as exc:
            log.error("Lease %s: %s", self.lock.describe(), exc)
        return False

    def _pause(self) -> float:
        return self.timing.retry_period_s * (1 + random.uniform(0, JITTER))

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Poll until this candidate leads (True) or `stop` is set (False)."""
        log.info("Attempting to acquire leader lease %s as %s", self.lock.describe(), self.identity)
        while not stop.is_set():
            if await self._round(self.timing.renew_deadline_s):
                log.info(
                    "Became leader (lease %s in ns %s) as %s",
                    self.lock.name,
                    self.lock.namespace,
                    self.identity,
                )
                return True
            await _wait(stop, self._pause())
        return False

    async def hold(self, stop: asyncio.Event) -> str:
        """Renew every retry period until `stop` is set (returns "") or leadership is lost
        (returns why): another holder is seen, or no renewal succeeded within the deadline."""
        while not await _wait(stop, self.timing.retry_period_s):
            deadline = self.last_renewed + self.timing.renew_deadline_s
            if await self._round(deadline - self.clock()):
                continue
            if not self.is_leader:
                return f"the lease is held by {self.leader or 'nobody'}"
            if must_give_up(self.last_renewed, self.clock(), self.timing):
                return f"failed to renew within {self.timing.renew_deadline_s:g}s"
        return ""

    async def release(self) -> bool:
        """Give the Lease up (client-go's ReleaseOnCancel), so a standby takes over at once
        instead of after the lease duration. False when the write failed."""
        if not self.is_leader or self.lease is None or self.observed is None:
            return True
        record = released(self.observed.record, self.wall())
        try:
            async with asyncio.timeout(self.timing.renew_deadline_s):
                lease = await self._release(record)
        except Conflict:
            lease = None
        except (TimeoutError, ApiError, OSError) as exc:
            log.error("Failed to release lease %s: %s", self.lock.describe(), exc)
            return False
        if lease is None:
            log.info("Lease %s was taken over before we released it", self.lock.describe())
            return True
        self.lease, self.observed = lease, Observed(record, self.clock())
        log.info("Released lease %s", self.lock.describe())
        return True

    async def _release(self, record: Record) -> Obj | None:
        """Write `record` over the Lease we last wrote; on a conflict (a renewal that timed
        out here yet landed there) read it once more and write again if it is still ours."""
        assert self.lease is not None
        try:
            return await self.lock.replace(self.lease, record)
        except Conflict:
            current = await self.lock.get()
            if current is None or Record.from_lease(current).holder != self.identity:
                return None
            return await self.lock.replace(current, record)


async def _wait(flag: asyncio.Event, timeout_s: float) -> bool:
    """Sleep `timeout_s` unless `flag` is set first; True when it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await flag.wait()
    except TimeoutError:
        return False
    return True
