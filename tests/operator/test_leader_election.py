"""Leader election (gspo_operator.leader): the decisions as tables of plain data, two electors
racing for one Lease on the API stand-in, and two real `gspo operator --leader-elect`
processes: one leads and reconciles, the other stands by, and takes over when the leader is
SIGKILLed (after the lease duration) or SIGTERMed (at once: the Lease is released)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from apiserver import ClusterApiServer
from checkout import REPO, checkout_env
from jobset_webhook import admit
from kmock_apiserver import ApiServer
from kubectl import write_kubeconfig
from operator_harness import NS, eventually, free_port, tiny_job

from gspo_operator import names
from gspo_operator.kube import ApiError, Kube
from gspo_operator.leader import (
    Action,
    Conflict,
    LeaderElector,
    LeaseLock,
    Observed,
    Record,
    Timing,
    claim,
    decide,
    identity_of,
    micro_time,
    must_give_up,
    observe,
    parse_micro_time,
    released,
)

T0 = dt.datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
LEASE = "gspo-operator"


def held(holder: str, at: float, duration: int = 15, **fields: Any) -> Observed:
    return Observed(Record(holder, duration, T0, T0, **fields), at)


# --- the decisions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("observed", "now", "action"),
    [
        (None, 0.0, Action.CREATE),  # no Lease: create it
        (held("me", 0.0), 100.0, Action.RENEW),  # ours, however old: renew
        (held("", 0.0), 0.0, Action.ACQUIRE),  # released: take it at once
        (held("other", 0.0), 14.9, Action.WAIT),  # the holder's lease still runs
        (held("other", 0.0), 15.0, Action.ACQUIRE),  # unchanged for a lease duration
        (held("other", 10.0), 20.0, Action.WAIT),  # first seen at 10: valid until 25
        (held("other", 0.0, duration=60), 59.0, Action.WAIT),  # the holder's duration counts
    ],
)
def test_decide(observed: Observed | None, now: float, action: Action) -> None:
    assert decide(observed, "me", now) is action


def test_expiry_is_measured_on_our_clock_not_the_holders() -> None:
    """A renewTime an hour old (the holder's clock lags ours) does not make the lease free:
    only how long the record stayed unchanged *as we watched it* counts (client-go)."""
    stale = Record("other", 15, T0 - dt.timedelta(hours=1), T0 - dt.timedelta(hours=1))
    first = observe(None, stale, now=1000.0)
    assert decide(first, "me", 1000.0) is Action.WAIT
    assert decide(observe(first, stale, now=1014.0), "me", 1014.0) is Action.WAIT
    assert decide(observe(first, stale, now=1015.0), "me", 1015.0) is Action.ACQUIRE


@pytest.mark.parametrize(
    ("previous_at", "changed", "now", "at"),
    [
        (None, False, 7.0, 7.0),  # first sighting
        (3.0, False, 7.0, 3.0),  # unchanged: the clock keeps running from the first sighting
        (3.0, True, 7.0, 7.0),  # renewed (or a new holder): the clock restarts
    ],
)
def test_observe(previous_at: float | None, changed: bool, now: float, at: float) -> None:
    record = Record("other", 15, T0, T0)
    previous = None if previous_at is None else Observed(record, previous_at)
    seen = Record("other", 15, T0, T0 + dt.timedelta(seconds=2)) if changed else record
    assert observe(previous, seen, now) == Observed(seen, at)


@pytest.mark.parametrize(
    ("action", "old", "expected"),
    [
        (Action.CREATE, None, Record("me", 15, T0, T0, 0)),
        # A renewal keeps acquireTime and the transition count.
        (
            Action.RENEW,
            Record("me", 15, T0 - dt.timedelta(minutes=5), T0 - dt.timedelta(seconds=2), 3),
            Record("me", 15, T0 - dt.timedelta(minutes=5), T0, 3),
        ),
        # A takeover (from a dead or a released holder) is one more transition.
        (Action.ACQUIRE, Record("other", 15, T0, T0, 3), Record("me", 15, T0, T0, 4)),
        (Action.ACQUIRE, Record("", 1, T0, T0, 4), Record("me", 15, T0, T0, 5)),
    ],
)
def test_claim(action: Action, old: Record | None, expected: Record) -> None:
    assert claim(action, old, "me", T0, 15) == expected


def test_nothing_is_claimed_while_waiting() -> None:
    with pytest.raises(ValueError):
        claim(Action.WAIT, Record("other", 15, T0, T0), "me", T0, 15)


def test_release_frees_the_lease_and_keeps_the_count() -> None:
    assert released(Record("me", 15, T0, T0, 7), T0) == Record("", 1, T0, T0, 7)


@pytest.mark.parametrize(
    ("last_renewed", "now", "give_up"),
    [(0.0, 2.0, False), (0.0, 9.99, False), (0.0, 10.0, True), (5.0, 16.0, True)],
)
def test_must_give_up_after_the_renew_deadline(
    last_renewed: float, now: float, give_up: bool
) -> None:
    assert must_give_up(last_renewed, now, Timing()) is give_up


@pytest.mark.parametrize(
    ("lease", "renew", "retry"),
    [(10, 10, 2), (15, 2, 2), (15, 10, 0)],
)
def test_timing_refuses_what_client_go_refuses(lease: float, renew: float, retry: float) -> None:
    with pytest.raises(ValueError):
        Timing(lease, renew, retry)


def test_defaults_are_client_gos() -> None:
    t = Timing()
    assert (t.lease_duration_s, t.renew_deadline_s, t.retry_period_s) == (15, 10, 2)


def test_lease_spec_round_trip_in_micro_time() -> None:
    assert micro_time(T0) == "2025-01-02T03:04:05.678901Z"
    assert parse_micro_time("2025-01-02T03:04:05.678901Z") == T0
    record = Record("me", 15, T0, T0 + dt.timedelta(seconds=1), 2)
    spec = record.to_spec()
    assert spec == {
        "holderIdentity": "me",
        "leaseDurationSeconds": 15,
        "acquireTime": "2025-01-02T03:04:05.678901Z",
        "renewTime": "2025-01-02T03:04:06.678901Z",
        "leaseTransitions": 2,
    }
    assert Record.from_lease({"spec": spec}) == record
    assert Record.from_lease({}) == Record()


def test_identity_is_the_pod_name_plus_a_random_suffix() -> None:
    a, b = identity_of({"POD_NAME": "op-7f9c"}), identity_of({"POD_NAME": "op-7f9c"})
    assert re.fullmatch(r"op-7f9c_[0-9a-f]{8}", a) and a != b


# --- electors against the API stand-in --------------------------------------------------------


@contextlib.asynccontextmanager
async def stand_in(server: ApiServer | None = None) -> AsyncIterator[ApiServer]:
    api = ApiServer() if server is None else server  # a kmock server may be falsy (empty)
    async with api, kmock.Server(api) as http:
        api.base_url = str(http.url).rstrip("/")
        yield api


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(kube: Kube, name: str, clock: Clock) -> LeaderElector:
    return LeaderElector(LeaseLock(kube, NS, LEASE), name, clock=clock)


def spec_of(api: ApiServer) -> dict[str, Any]:
    lease = api.get("Lease", NS, LEASE)
    assert lease is not None
    return lease["spec"]


async def test_a_stale_replace_gets_409_conflict() -> None:
    """The stand-in honours metadata.resourceVersion on PUT, as kube-apiserver does."""
    async with stand_in() as api:
        kube = Kube.for_host(api.base_url)
        try:
            lock = LeaseLock(kube, NS, LEASE)
            await lock.create(Record("a", 15, T0, T0))
            read = await lock.get()
            assert read is not None
            await lock.replace(read, Record("b", 15, T0, T0, 1))  # the first writer wins
            with pytest.raises(ApiError) as info:  # the second carries a stale resourceVersion
                await kube.request("PUT", f"{lock.collection}/{LEASE}", body=read)
            assert info.value.status == 409 and "has been modified" in str(info.value)
            assert spec_of(api)["holderIdentity"] == "b"
            meta = {k: v for k, v in read["metadata"].items() if k != "resourceVersion"}
            unconditional = {**read, "metadata": meta}
            await kube.request("PUT", f"{lock.collection}/{LEASE}", body=unconditional)
            assert spec_of(api)["holderIdentity"] == "a"  # no resourceVersion: unconditional
        finally:
            kube.close()


async def test_electors_take_turns_and_never_both_win() -> None:
    async with stand_in() as api:
        kube, clock = Kube.for_host(api.base_url), Clock()
        try:
            a, b = elector(kube, "a", clock), elector(kube, "b", clock)
            assert await a.try_acquire_or_renew() and a.is_leader
            assert not await b.try_acquire_or_renew() and b.leader == "a"
            clock.now += 2
            assert await a.try_acquire_or_renew()  # renews (fast path)
            assert spec_of(api)["holderIdentity"] == "a"
            clock.now += 14
            assert not await b.try_acquire_or_renew()  # b sees that renewal only now
            clock.now += 14
            assert not await b.try_acquire_or_renew()  # unchanged for 14 s on b's clock
            clock.now += 1
            assert await b.try_acquire_or_renew()  # a missed its renewals: b takes over
            assert spec_of(api)["leaseTransitions"] == 1
            assert not await a.try_acquire_or_renew() and not a.is_leader  # 409, then b's
            # b's renewal that timed out on b's side yet landed: b's copy is stale, and its
            # release reads the Lease again rather than leave it to run out.
            assert b.lease is not None and b.observed is not None
            await b.lock.replace(b.lease, claim(Action.RENEW, b.observed.record, "b", T0, 15))
            assert await b.release()
            assert spec_of(api)["holderIdentity"] == ""
            assert await a.try_acquire_or_renew()  # released: no waiting
            assert spec_of(api)["leaseTransitions"] == 2

            # Candidates that all see the lease free race for it: exactly one wins each time.
            for round_ in range(5):
                racers = [elector(kube, f"r{round_}-{i}", clock) for i in range(4)]
                for r in racers:  # all saw the Lease held by a, whose lease then ran out
                    assert not await r.try_acquire_or_renew()
                clock.now += 16
                won = await asyncio.gather(*(r.try_acquire_or_renew() for r in racers))
                assert sum(won) == 1, won
                a = racers[won.index(True)]
                assert spec_of(api)["holderIdentity"] == a.identity
        finally:
            kube.close()


class MemoryLock(LeaseLock):
    """A Lease in memory with resourceVersions, and a switch that makes the API unreachable."""

    def __init__(self) -> None:
        super().__init__(Kube.__new__(Kube), NS, LEASE)  # never used: every call is overridden
        self.stored: dict[str, Any] | None = None
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise OSError("connection refused")

    async def get(self) -> dict[str, Any] | None:
        self._check()
        return self.stored

    async def create(self, record: Record) -> dict[str, Any]:
        self._check()
        self.stored = {"metadata": {"resourceVersion": "1"}, "spec": record.to_spec()}
        return self.stored

    async def replace(self, lease: dict[str, Any], record: Record) -> dict[str, Any]:
        self._check()
        assert self.stored is not None
        rv = self.stored["metadata"]["resourceVersion"]
        if lease["metadata"]["resourceVersion"] != rv:
            raise Conflict(rv)
        self.stored = {"metadata": {"resourceVersion": str(int(rv) + 1)}, "spec": record.to_spec()}
        return self.stored


FAST = Timing(lease_duration_s=0.6, renew_deadline_s=0.4, retry_period_s=0.1)


async def test_a_leader_that_cannot_renew_gives_up_at_the_renew_deadline() -> None:
    lock = MemoryLock()
    me = LeaderElector(lock, "me", FAST)
    assert await me.acquire(asyncio.Event())
    lock.down = True
    loop = asyncio.get_running_loop()
    began = loop.time()
    why = await asyncio.wait_for(me.hold(asyncio.Event()), 5)
    assert why == "failed to renew within 0.4s"
    assert 0.3 <= loop.time() - began < 1.0  # after the deadline, before the lease runs out


async def test_a_leader_that_sees_another_holder_stops_at_once() -> None:
    lock = MemoryLock()
    me = LeaderElector(lock, "me", FAST)
    assert await me.acquire(asyncio.Event())
    assert lock.stored is not None
    other = LeaderElector(lock, "other", FAST)
    other.observed = Observed(Record.from_lease(lock.stored), -100.0)  # saw it long ago
    assert await other.try_acquire_or_renew()
    why = await asyncio.wait_for(me.hold(asyncio.Event()), 5)
    assert why == "the lease is held by other"
    assert await me.release() and lock.stored["spec"]["holderIdentity"] == "other"


async def test_hold_returns_nothing_when_told_to_stop() -> None:
    me = LeaderElector(MemoryLock(), "me", FAST)
    assert await me.acquire(asyncio.Event())
    stop = asyncio.Event()
    holding = asyncio.create_task(me.hold(stop))
    await asyncio.sleep(0.35)  # a few renewals
    stop.set()
    assert await asyncio.wait_for(holding, 5) == ""
    assert await me.release() and not me.is_leader


# --- two real operator processes --------------------------------------------------------------


@dataclass
class Replica:
    """One `gspo operator --leader-elect` process, as one pod of the Deployment."""

    pod: str
    proc: asyncio.subprocess.Process
    metrics_port: int
    health_port: int
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    async def metric(self, name: str) -> float | None:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            text = await resp.text()
        pattern = rf"^{re.escape(name)} (\S+)$"
        found = re.search(pattern, text, re.MULTILINE)
        return float(found.group(1)) if found else None

    async def healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False


# The replicas' Lease timings, through their flags: a third of client-go's (15 s, 10 s, 2 s),
# so a takeover after SIGKILL waits ~6 s instead of ~17 s; the renew deadline still leaves a
# leader four tries at renewing on a loaded machine.
LEASE_FLAGS = (
    *("--leader-election-lease-duration", "5", "--leader-election-renew-deadline", "4"),
    *("--leader-election-retry-period", "1"),
)


async def start_replica(pod: str, kubeconfig: Path) -> Replica:
    metrics_port, health_port = free_port(), free_port()
    env = checkout_env(KUBECONFIG=str(kubeconfig), POD_NAME=pod, PYTHONUNBUFFERED="1")
    for var in ("KUBERNETES_SERVICE_HOST", "POD_NAMESPACE"):
        env.pop(var, None)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gspo_operator.cli", "operator", "--leader-elect"),
        *("--leader-election-namespace", NS, "--namespace", NS, "--interval", "1"),
        *("--metrics-port", str(metrics_port), "--health-port", str(health_port)),
        *LEASE_FLAGS,
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    replica = Replica(pod, proc, metrics_port, health_port)

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            replica.lines.append(raw.decode(errors="replace").rstrip())

    replica.reader = asyncio.create_task(read())
    return replica


async def eventually_async(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str
) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def create_job(api: ApiServer, name: str) -> None:
    url = f"{api.base_url}/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs"
    async with aiohttp.ClientSession() as s, s.post(url, json=tiny_job(name)) as resp:
        assert resp.status < 300, await resp.text()


def children_of(api: ApiServer, job: str) -> Callable[[], bool]:
    def made() -> bool:
        return bool(
            api.get("JobSet", NS, names.jobset(job))
            and api.get("ConfigMap", NS, names.config_map(job))
        )

    return made


def holder(api: ApiServer) -> str:
    lease = api.get("Lease", NS, LEASE)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def holder_is(api: ApiServer, replica: Replica) -> Callable[[], bool]:
    return lambda: holder(api).startswith(f"{replica.pod}_")


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    """Started replicas, killed (with their output shown) when the test ends."""
    started: list[Replica] = []
    yield started
    for r in started:
        if r.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            await r.proc.wait()
        if r.reader is not None:
            await asyncio.wait([r.reader], timeout=5)
        print(f"--- {r.pod} (exit {r.proc.returncode})\n" + "\n".join(r.lines))


@pytest.mark.e2e
async def test_two_replicas_one_leader_and_takeovers(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    loop = asyncio.get_running_loop()
    async with stand_in(ClusterApiServer(admission=[admit])) as api:
        kubeconfig = write_kubeconfig(api.base_url, tmp_path / "kubeconfig")
        replicas += [
            await start_replica("op-a", kubeconfig),
            await start_replica("op-b", kubeconfig),
        ]
        await eventually(lambda: holder(api), 30, "a leader")
        first, second = replicas if holder_is(api, replicas[0])() else replicas[::-1]

        # One leads and reconciles; the other stands by, healthy, and reconciles nothing.
        await create_job(api, "one")
        await eventually(children_of(api, "one"), 20, "job one's children")
        for r in (first, second):
            assert await eventually_async(r.healthy, 10, f"{r.pod}'s /healthz")
        assert await first.metric("gspo_operator_leader") == 1
        assert await second.metric("gspo_operator_leader") == 0
        success = 'controller_runtime_reconcile_total{controller="gspojob",result="success"}'
        assert (await first.metric(success) or 0) > 0
        assert await second.metric(success) == 0
        assert first.said("Became leader (lease gspo-operator in ns default)")
        await eventually(lambda: second.said("New leader elected: op-"), 10, "the standby's log")
        assert not second.said("Became leader")
        # The log line follows the API's answer through a pipe: wait for it, not for the object.
        await eventually(lambda: first.said("Created JobSet one"), 10, "op-a's log")
        assert not second.said("Created")

        # SIGKILL: nothing is released; the standby takes over once the lease runs out.
        killed_at = loop.time()
        first.proc.send_signal(signal.SIGKILL)
        await create_job(api, "two")
        await eventually(holder_is(api, second), 30, "the standby to take over")
        kill_lease_s = loop.time() - killed_at
        await eventually(children_of(api, "two"), 30, "job two's children")
        kill_takeover_s = loop.time() - killed_at
        assert await first.proc.wait() == -signal.SIGKILL
        assert kill_takeover_s < 30, kill_takeover_s
        await eventually(lambda: second.said("Created JobSet two"), 10, "the new leader's log")
        assert spec_of(api)["leaseTransitions"] >= 1
        assert await second.metric("gspo_operator_leader") == 1

        # A new candidate (Kubernetes replaced the killed pod) stands by behind `second`.
        third = await start_replica("op-c", kubeconfig)
        replicas.append(third)
        await eventually(lambda: third.said("New leader elected: op-"), 20, "op-c to stand by")

        # SIGTERM: kopf stops, the Lease is released, the standby takes it on its next poll.
        termed_at = loop.time()
        second.proc.send_signal(signal.SIGTERM)
        await eventually(holder_is(api, third), 20, "op-c to take over")
        term_lease_s = loop.time() - termed_at
        assert await asyncio.wait_for(second.proc.wait(), 20) == 0
        assert second.said("Released lease default/gspo-operator")
        assert term_lease_s < 10, term_lease_s  # ~2 s idle; a loaded CI runner is slower
        await create_job(api, "three")  # only now: the stopping leader might have taken it
        await eventually(children_of(api, "three"), 20, "job three's children")
        term_takeover_s = loop.time() - termed_at
        await eventually(lambda: third.said("Created JobSet three"), 10, "op-c's log")
        assert not second.said("Created JobSet three")

        # A leader that sees someone else holding its Lease stops and exits non-zero at once.
        lease = api.get("Lease", NS, LEASE)
        assert lease is not None
        now = micro_time(dt.datetime.now(dt.UTC))
        intruder = {**lease["spec"], "holderIdentity": "intruder", "renewTime": now}
        async with aiohttp.ClientSession() as s:
            url = f"{api.base_url}/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}"
            async with s.put(url, json={**lease, "spec": intruder}) as resp:
                assert resp.status == 200, await resp.text()
        assert await asyncio.wait_for(third.proc.wait(), 15) == 1
        assert third.said("Lost leadership (lease gspo-operator in ns default)")

        # Every Lease request was one the chart's leader-election Role grants.
        verbs = {
            (r.method.value, bool(r.name))
            for r in api._requests
            if r.resource is not None and r.resource.plural == "leases"
        }
        assert verbs <= {("GET", True), ("POST", False), ("PUT", True)}, verbs
        print(
            f"\ntakeover after SIGKILL: lease {kill_lease_s:.1f}s, job two's children"
            f" {kill_takeover_s:.1f}s; after SIGTERM: lease {term_lease_s:.1f}s, job three's"
            f" children (created after the takeover) {term_takeover_s:.1f}s"
        )
