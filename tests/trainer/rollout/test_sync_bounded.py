"""Weight sync under NCCL's semantics, shown on CPU: `work.wait()` neither blocks the host nor
raises there, so every wait is bounded by polling `is_completed()` against a deadline, a
group whose collective does not finish is aborted on both sides, the group before every
regroup is shut down, and the sync's time is the transfer's.

The failures are injected: a work that never completes (a peer died mid-broadcast), whose
`wait()` returns at once as NCCL's does. The torch calls NCCL needs are checked against
torch's real API as far as the CPU build has it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gspo_trainer.rollout import client as client_mod
from gspo_trainer.rollout import weight_sync as ws
from gspo_trainer.rollout.client import RolloutClient, RolloutError, SyncOptions
from gspo_trainer.rollout.worker_ext import WeightSyncExtension


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Work:
    """A collective's handle as NCCL gives it: `wait()` returns at once, done or not."""

    def __init__(self, done_at: float | None, clock: Any = time.monotonic) -> None:
        self.done_at, self.clock, self.waited = done_at, clock, False

    def is_completed(self) -> bool:
        return self.done_at is not None and self.clock() >= self.done_at

    def wait(self) -> bool:
        self.waited = True
        return True


class PG:
    """A process group backend whose broadcasts complete for the first `good` calls (at once,
    or after `seconds`), then never; records abort and shutdown."""

    def __init__(self, good: int = 10**9, seconds: float = 0.0, clock: Any = time.monotonic):
        self.good, self.seconds, self.clock = good, seconds, clock
        self.calls, self.ended = 0, []

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        self.calls += 1
        done = self.clock() + self.seconds if self.calls <= self.good else None
        return Work(done, self.clock)

    def abort(self) -> None:
        self.ended.append("abort")

    def shutdown(self) -> None:
        self.ended.append("shutdown")


def group_on(pg: PG, clock: FakeClock | None = None, timeout_s: float = 30.0) -> ws.SyncGroup:
    group = ws.SyncGroup(pg, None, 0, 2, "cpu", timeout_s)
    if clock is not None:
        group.clock, group.sleep = clock, clock.sleep
    return group


WEIGHTS = [(f"w{i}", torch.full((64,), float(i))) for i in range(8)]


def test_a_collective_that_never_completes_times_out_without_waiting_on_it() -> None:
    clock = FakeClock()
    work = Work(None, clock)
    with pytest.raises(ws.SyncTimeout, match="30 s"):
        ws.wait_bounded(work, 30.0, clock=clock, sleep=clock.sleep)
    assert 30.0 <= clock.now < 31.0
    assert not work.waited  # under NCCL it would have queued the stream behind the hang


def test_a_finished_collective_is_waited_on_so_a_gloo_error_surfaces() -> None:
    class Failed(Work):
        def wait(self) -> bool:
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        ws.wait_bounded(Failed(0.0), 30.0)


def test_the_sender_fails_in_bounded_time_when_a_bucket_never_arrives() -> None:
    """The header goes, the first bucket never completes: the send raises after the group's
    timeout (on the fake clock) instead of returning as if the weights were sent."""
    clock = FakeClock()
    sender = ws.WeightSender(group_on(PG(good=2, clock=clock), clock), bucket_mb=512 / 2**20)
    with pytest.raises(ws.SyncTimeout):
        sender.send(WEIGHTS, version=1)
    assert clock.now >= 30.0


def test_the_sync_time_is_the_transfer_not_the_enqueueing() -> None:
    """Each bucket takes 50 ms to arrive and `wait()` returns at once (NCCL): the reported
    time covers the transfers."""
    sender = ws.WeightSender(group_on(PG(seconds=0.05)), bucket_mb=1024 / 2**20)
    stats = sender.send(WEIGHTS, version=1)
    assert stats.buckets >= 2
    assert stats.seconds >= 0.05 * (stats.buckets + 2)  # header (2 broadcasts) and buckets


def test_a_receiver_whose_learner_died_aborts_its_group() -> None:
    """The server's side: the header arrives, the first bucket never does; the update fails
    in bounded time and the worker aborts its group (the learner forms a new one)."""
    clock = FakeClock()
    pg = PG(good=0, clock=clock)
    head = torch.tensor([3, 0], dtype=torch.int64)

    class Header(PG):
        def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
            self.calls += 1
            if self.calls == 1:
                layout = ws.encode_layout(ws.plan_buckets([("w", (4,), "float32", 16)], 64))
                head[1] = len(layout)
                tensors[0].copy_(head)
                self.layout = layout
                return Work(0.0, clock)
            if self.calls == 2:
                tensors[0].copy_(torch.frombuffer(bytearray(self.layout), dtype=torch.uint8))
                return Work(0.0, clock)
            return Work(None, clock)  # the bucket: the learner is gone

    pg = Header(clock=clock)
    worker = WeightSyncExtension()
    worker._gspo_group = group_on(pg, clock)
    worker.model_runner = SimpleNamespace(  # type: ignore[attr-defined]
        get_model=lambda: torch.nn.Module(),
        reload_weights=lambda weights_iterator: [None for _ in weights_iterator],
    )
    with pytest.raises(ws.SyncTimeout):
        worker.gspo_receive_weights()
    assert pg.ended == ["abort"] and worker._gspo_group is None


def fake_fleet(
    monkeypatch: pytest.MonkeyPatch,
    pgs: list[PG],
    clock: FakeClock | None = None,
    post: Any = None,
) -> list[ws.SyncGroup]:
    """The client's sync against stand-ins: each group it forms is on the next of `pgs`
    (after its join broadcast), the store is a placeholder, and every server call answers
    `post` (by default, policy version 1). Returns the groups formed, in order."""
    formed: list[ws.SyncGroup] = []

    def open_group(store: Any, name: str, rank: int, world: int, **kw: Any) -> ws.SyncGroup:
        group = group_on(pgs[len(formed)], clock, timeout_s=kw["timeout_s"])
        group.broadcast(torch.zeros(1, dtype=torch.uint8))
        formed.append(group)
        return group

    async def answer(self: Any, url: str, path: str, body: Any, timeout_s: float) -> Any:
        return {"policy_version": 1}

    monkeypatch.setattr(ws, "open_group", open_group)
    monkeypatch.setattr(ws, "connect_store", lambda *a, **k: object())
    monkeypatch.setattr(client_mod.RolloutClient, "_post", post or answer)
    return formed


def test_the_learner_aborts_a_failed_group_and_shuts_the_old_one_down_on_regroup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attempt 1: the broadcast never completes; its group is aborted, a new one formed and
    the weights sent again. Then a server joins: the healthy group is shut down, not left."""
    clock = FakeClock()
    pgs = [PG(good=1, clock=clock), PG(), PG()]  # the first breaks after its join broadcast
    formed = fake_fleet(monkeypatch, pgs, clock)

    async def scenario() -> None:
        opts = SyncOptions("127.0.0.1", 1, bucket_mb=1024 / 2**20, timeout_s=30)
        client = RolloutClient(["http://a"], sync=opts)

        async def refresh(only_down: bool = False) -> None:
            return None

        client.refresh = refresh  # type: ignore[method-assign]
        report = await client.sync_weights(WEIGHTS, 1)
        assert report.regrouped and report.servers == ["http://a"]
        assert pgs[0].ended == ["abort"] and pgs[1].ended == []
        client.servers["http://b"] = client_mod.Server("http://b")
        await client.sync_weights(WEIGHTS, 2)
        assert pgs[1].ended == ["shutdown"] and len(formed) == 3
        await client.close()
        assert pgs[2].ended == ["shutdown"]

    asyncio.run(scenario())


def test_a_sync_that_fails_twice_aborts_both_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    pgs = [PG(good=1, clock=clock), PG(good=1, clock=clock)]
    fake_fleet(monkeypatch, pgs, clock)

    async def scenario() -> None:
        client = RolloutClient(["http://a"], sync=SyncOptions("127.0.0.1", 1, timeout_s=30))

        async def refresh(only_down: bool = False) -> None:
            return None

        client.refresh = refresh  # type: ignore[method-assign]
        with pytest.raises(RolloutError, match="did not complete"):
            await client.sync_weights(WEIGHTS, 1)

    asyncio.run(scenario())
    assert [pg.ended for pg in pgs] == [["abort"], ["abort"]]


def test_a_server_refusing_its_update_ends_the_sync_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server answers /control/sync/update with an error and never joins the broadcast
    (its engine died, say): the learner's send stops waiting for it at once, both attempts'
    groups are aborted, and the sync fails naming the server, long before the group's
    timeout (600 s by default; 60 s here, on the real clock)."""
    pgs = [PG(good=1), PG(good=1)]  # each attempt's join, then broadcasts that never finish

    async def post(self: Any, url: str, path: str, body: Any, timeout_s: float) -> Any:
        if path == "/control/sync/update":
            raise RolloutError(f"{url}{path}: HTTP 500: EngineCore encountered an issue")
        return {"policy_version": 0}

    fake_fleet(monkeypatch, pgs, post=post)

    async def scenario() -> None:
        client = RolloutClient(["http://a"], sync=SyncOptions("127.0.0.1", 1, timeout_s=60))

        async def refresh(only_down: bool = False) -> None:
            client.servers["http://a"].alive = True  # its /health still answers

        client.refresh = refresh  # type: ignore[method-assign]
        with pytest.raises(RolloutError, match="http://a failed its part of the update"):
            await client.sync_weights(WEIGHTS, 1)

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 20.0  # the timeout would be 60 s per attempt
    assert [pg.ended for pg in pgs] == [["abort"], ["abort"]]


def test_a_cancel_reaches_the_receivers_through_the_groups_store() -> None:
    """Real gloo and a real TCPStore, the learner (rank 0) and a server's worker (rank 1) in
    two threads: the worker waits on a broadcast the learner never sends (another server
    refused its update); the learner's cancel ends the worker's wait within a poll, naming
    why, instead of after the group's 30 s timeout. Both abort their groups after."""
    from concurrent.futures import ThreadPoolExecutor

    from gspo_api.ports import free_port

    port = free_port()
    master = ws.connect_store("127.0.0.1", port, is_master=True, timeout_s=30)
    joined = ws.connect_store("127.0.0.1", port, is_master=False, timeout_s=30)
    with ThreadPoolExecutor(2) as pool:
        groups = list(
            pool.map(
                lambda rank: ws.open_group((master, joined)[rank], "cancel", rank, 2, timeout_s=30),
                (0, 1),
            )
        )
        learner, worker = groups
        try:
            receiving = pool.submit(lambda: list(ws.receive_weights(worker)[1]))
            time.sleep(0.3)  # the worker is waiting on the header now
            started = time.monotonic()
            learner.cancel("http://a failed its part of the update: HTTP 500")
            with pytest.raises(ws.SyncCancelled, match="http://a failed its part"):
                receiving.result(timeout=20)
            assert time.monotonic() - started < 5.0  # a poll is 0.1 s; the timeout 30 s
        finally:
            for group in groups:
                group.close(abort=True)
            # The learner's group goes first: its sockets closing fail the worker's pending
            # receive. Freed the other way round (by the garbage collector, the exception's
            # frames hold the worker's), gloo's destructor joins its threads holding the GIL
            # until that receive times out: 30 s of a stalled test process.
            learner.pg = None


def test_the_torch_calls_nccl_needs_exist_and_end_a_real_group() -> None:
    """What the CPU build can show: the c10d ProcessGroup API NCCL implements has abort and
    shutdown, a Work answers is_completed without blocking, backend options carry the
    `_timeout` open_group sets on NCCL's, and a real gloo group ends both ways."""
    assert callable(dist.ProcessGroup.abort) and callable(dist.ProcessGroup.shutdown)
    assert hasattr(torch._C._distributed_c10d.Backend.Options, "_timeout")
    for abort in (False, True):
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
        group = ws.SyncGroup(pg, None, 0, 1, "cpu", 5.0)
        work = group.broadcast_async(torch.zeros(4))
        group.wait(work)
        assert work.is_completed()
        group.close(abort=abort)
        group.close(abort=abort)  # once
        assert group.closed


class FrozenStore:
    """A TCPStore whose master stopped answering without closing its socket: torch's client
    blocks in check() past any timeout (measured on torch 2.13 with a SIGSTOPped master)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        self.release.wait()
        return False

    def set(self, key: str, value: str) -> None:
        pass


def test_a_store_that_stops_answering_does_not_hold_the_wait_past_its_deadline() -> None:
    store = FrozenStore()
    group = ws.SyncGroup(PG(), store, 1, 2, "cpu", timeout_s=0.5)
    threading.Timer(5.0, store.release.set).start()  # a wait that blocks in check() fails late
    try:
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeout):
            group.wait(Work(None))
        assert time.monotonic() - started < 3.0  # the deadline, not the blocked check
        assert store.checks == 1
    finally:
        store.release.set()
        group.close(abort=True)


class DeadStore:
    def __init__(self) -> None:
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        raise RuntimeError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Connection reset by peer")


def test_a_store_whose_master_died_is_asked_once() -> None:
    """Each failed call prints a C++ stack trace: asked again every poll, a dead master would
    flood the server's log until the collective fails."""
    store = DeadStore()
    group = ws.SyncGroup(PG(), store, 1, 2, "cpu", timeout_s=0.6)
    try:
        with pytest.raises(ws.SyncTimeout):
            group.wait(Work(None))  # 0.6 s: six polls were it to keep asking
        with pytest.raises(ws.SyncTimeout):
            group.wait(Work(None))  # nor at the next wait
    finally:
        group.close(abort=True)
    assert store.checks == 1
    assert group._watch is not None and group._watch.failed == "Connection reset by peer"


def test_the_first_reason_for_a_cancel_stays() -> None:
    store = dist.HashStore()
    group = ws.SyncGroup(PG(), store, 0, 2, "cpu", timeout_s=5)
    group.cancel("http://a failed its part of the update: HTTP 500")
    group.cancel("http://b failed its part of the update: cancelled by a peer")
    assert group.cancelled is not None and group.cancelled.startswith("http://a")
    assert bytes(store.get(ws.CANCEL_KEY)).decode().startswith("http://a")
    with pytest.raises(ws.SyncCancelled, match="http://a"):
        group.wait(Work(None))
    group.close(abort=True)


def test_a_cancelled_sync_returns_only_once_its_sender_thread_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner stops mid-broadcast (its task is cancelled): the group is cancelled and
    aborted, and the cancellation completes only after the sender's thread has left its
    collectives, so no other collective of the learner's ranks starts beside them."""
    pgs = [PG(good=1)]  # the join, then a broadcast that never finishes

    async def post(self: Any, url: str, path: str, body: Any, timeout_s: float) -> Any:
        if path == "/control/sync/update":
            await asyncio.sleep(3600)  # the server waits on the broadcast
        return {"policy_version": 0}

    fake_fleet(monkeypatch, pgs, post=post)
    ended = threading.Event()
    send = ws.WeightSender.send

    def slow_to_notice(self: ws.WeightSender, *args: Any, **kwargs: Any) -> Any:
        try:
            return send(self, *args, **kwargs)
        finally:
            time.sleep(0.5)  # still in the sender's thread when the cancel lands
            ended.set()

    monkeypatch.setattr(ws.WeightSender, "send", slow_to_notice)

    async def scenario() -> bool:
        client = RolloutClient(["http://a"], sync=SyncOptions("127.0.0.1", 1, timeout_s=60))

        async def refresh(only_down: bool = False) -> None:
            client.servers["http://a"].alive = True

        client.refresh = refresh  # type: ignore[method-assign]
        task = asyncio.create_task(client.sync_weights(WEIGHTS, 1))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ended.is_set()

    started = time.monotonic()
    assert asyncio.run(scenario())
    assert time.monotonic() - started < 20.0 and pgs[0].ended == ["abort"]
