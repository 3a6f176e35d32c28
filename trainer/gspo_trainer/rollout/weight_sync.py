"""Bucketed weight broadcast from learner rank 0 to the rollout servers' workers.

Parameters are packed as raw bytes into fixed-size flat buckets, so the number of
collective calls grows with the model's bytes, not its tensor count (a 48-layer MoE has
thousands of tensors). Before the buckets, rank 0 broadcasts a small JSON header that
lists, per bucket, each tensor's name, shape, dtype and byte offset; receivers unflatten
with that header alone. Both sides share this module: the learner through
`WeightSender`, a vLLM worker through `receive_weights` (see `worker_ext.py`).

The group is a standalone torch.distributed process group (gloo on CPU, NCCL on GPU) built
on a TCPStore that rank 0 hosts: it never touches the default group, which belongs to
DeepSpeed on the learner and to vLLM in the server's workers.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor  # for functions whose local `torch` is torch_module()

log = logging.getLogger("gspo.weight_sync")

HEADER_FORMAT = 1
ALIGN_BYTES = 64  # every tensor starts at an offset that any dtype can be viewed from


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int  # byte offset inside its bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    tensors: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class SyncStats:
    version: int
    bytes_total: int
    buckets: int
    tensors: int
    seconds: float


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(
    metas: Iterable[tuple[str, tuple[int, ...], str, int]], bucket_bytes: int
) -> list[Bucket]:
    """Group (name, shape, dtype, nbytes) in order into buckets of at most `bucket_bytes`.

    A tensor larger than a bucket gets a bucket of its own, sized to fit it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    used = 0
    for name, shape, dtype, nbytes in metas:
        start = _align(used)
        if current and start + nbytes > bucket_bytes:
            buckets.append(Bucket(used, tuple(current)))
            current, used, start = [], 0, 0
        current.append(TensorMeta(name, tuple(shape), dtype, start, nbytes))
        used = start + nbytes
    if current:
        buckets.append(Bucket(used, tuple(current)))
    return buckets


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_module() -> Any:
    import torch

    return torch


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off for the length of a sync. A sync makes thousands of
    short-lived tensor views, and in a process with a large heap (a vLLM worker, a learner)
    every collection they trigger walks all of it: that, not the views, was most of the
    per-tensor cost of a sync."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SendBuffers:
    """Send buffers for the buckets of one layout: two, so bucket k+1 is filled while bucket k
    is on the wire, each with cached views as every bucket's tensors, so filling a bucket
    copies each tensor straight to its place (no concatenation of per-tensor byte views)."""

    def __init__(self, buckets: Sequence[Bucket], device: Any) -> None:
        torch = torch_module()
        size = max((b.nbytes for b in buckets), default=0)
        slots = 2 if len(buckets) > 1 else 1
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.views: dict[tuple[int, int], list[Tensor]] = {}

    def fill(
        self, k: int, bucket: Bucket, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> torch.Tensor:
        """Copy bucket k's tensors, the next ones `tensors` yields, into a send buffer. Each is
        copied before the next is asked for: a stream may free it then (ParamStream)."""
        torch = torch_module()
        slot = k % len(self.buffers)
        buffer = self.buffers[slot][: bucket.nbytes]
        views = self.views.get((k, slot))
        if views is None:
            views = [view for _, view in unflatten_bucket(bucket, buffer)]
            self.views[(k, slot)] = views
        with torch.no_grad():
            for meta, view in zip(bucket.tensors, views, strict=True):
                name, t = next(tensors, (None, None))
                if name != meta.name or t is None or tuple(t.shape) != meta.shape:
                    got = None if t is None else tuple(t.shape)
                    raise ValueError(
                        f"the weights gave {name!r} {got} where the bucket plan has "
                        f"{meta.name!r} {meta.shape}: they changed after their metas were read"
                    )
                view.copy_(t)
                del t  # let a streamed layer go before the next one is gathered
        return buffer


@dataclass(frozen=True)
class _Run:
    """Consecutive tensors of one dtype: one dtype view of their bytes, split in elements."""

    dtype: str
    start: int  # byte offsets in the bucket
    end: int
    sizes: tuple[int, ...]  # in elements, gaps included
    picks: tuple[int, ...]  # which split pieces are the tensors


@functools.lru_cache(maxsize=256)
def _runs(bucket: Bucket) -> tuple[_Run, ...]:
    torch = torch_module()
    runs: list[_Run] = []
    metas = bucket.tensors
    i = 0
    while i < len(metas):
        dtype = metas[i].dtype
        item = getattr(torch, dtype).itemsize
        start = end = metas[i].offset
        sizes: list[int] = []
        picks: list[int] = []
        while i < len(metas) and metas[i].dtype == dtype and (metas[i].offset - end) % item == 0:
            if metas[i].offset > end:
                sizes.append((metas[i].offset - end) // item)
            picks.append(len(sizes))
            sizes.append(metas[i].nbytes // item)
            end = metas[i].offset + metas[i].nbytes
            i += 1
        runs.append(_Run(dtype, start, end, tuple(sizes), tuple(picks)))
    return tuple(runs)


def unflatten_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` as the bucket's named tensors (no copy). Runs for every tensor of
    every update, so it makes one dtype view and one split per run of same-dtype tensors
    (usually the whole bucket) and then one shape view per tensor."""
    torch = torch_module()
    out = []
    metas = iter(bucket.tensors)
    for run in _runs(bucket):
        pieces = buffer[run.start : run.end].view(getattr(torch, run.dtype)).split(run.sizes)
        for i in run.picks:
            meta = next(metas)
            out.append((meta.name, pieces[i].view(meta.shape)))
    return out


def encode_layout(buckets: Sequence[Bucket]) -> bytes:
    """The bucket plan as JSON; sent before every update, but the same bytes every time."""
    body = {
        "format": HEADER_FORMAT,
        "buckets": [
            {
                "nbytes": b.nbytes,
                "tensors": [[m.name, m.shape, m.dtype, m.offset, m.nbytes] for m in b.tensors],
            }
            for b in buckets
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=4)
def decode_layout(raw: bytes) -> tuple[Bucket, ...]:
    """Parse a layout; cached, since a model's layout does not change between updates."""
    body = json.loads(raw)
    if body.get("format") != HEADER_FORMAT:
        raise ValueError(
            f"weight-sync header format {body.get('format')!r} is not {HEADER_FORMAT}: "
            "learner and rollout server run different versions of gspo_trainer"
        )
    return tuple(
        Bucket(
            b["nbytes"],
            tuple(
                TensorMeta(name, tuple(shape), dtype, offset, nbytes)
                for name, shape, dtype, offset, nbytes in b["tensors"]
            ),
        )
        for b in body["buckets"]
    )


def checkpoint_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename a transformers model's parameters to checkpoint names that vLLM loads.

    transformers 5 keeps a MoE layer's experts fused (`experts.gate_up_proj` (E, 2I, H),
    `experts.down_proj` (E, H, I)); checkpoints, and vLLM's loader, name each expert's
    `gate_proj`/`up_proj`/`down_proj` weight. Other names pass through unchanged. The
    pieces are views, no copy.
    """
    for name, t in named_tensors:
        prefix, _, leaf = name.rpartition(".experts.")
        if prefix and t.dim() == 3 and leaf in ("gate_up_proj", "down_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                base = f"{prefix}.experts.{e}"
                if leaf == "gate_up_proj":
                    yield f"{base}.gate_proj.weight", t[e, :half]
                    yield f"{base}.up_proj.weight", t[e, half:]
                else:
                    yield f"{base}.down_proj.weight", t[e]
        else:
            yield name, t
        del t  # not held while the next tensor is asked for (a streamed layer is let go)


# --- what is sent ----------------------------------------------------------------------


class TensorSource(Protocol):
    """Named tensors whose names, shapes and dtypes are known before any is read (the
    bucket plan and its header go first), readable more than once (a sync that lost a
    server re-forms its group and sends again). `ParamStream` is one: it gathers a ZeRO-3
    policy one layer at a time while it is read."""

    def metas(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class InMemory:
    """Tensors already whole in memory (a model's `named_parameters()`, a dict's items)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.items = list(named_tensors)

    def metas(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, tuple(t.shape), t.dtype) for name, t in self.items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.items)


@contextmanager
def reading(source: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Iterator[tuple[str, Any]]]:
    """An iterator over `source`, closed on leaving however the reading ends: a ParamStream
    pass left early (an error mid-way) then gathers what is left at once, as the other
    learner ranks do, not whenever the error and its traceback are let go."""
    tensors = iter(source)
    try:
        yield tensors
    finally:
        close = getattr(tensors, "close", None)
        if close is not None:
            close()


class CheckpointNamed:
    """`source` under the checkpoint names vLLM loads (see checkpoint_named_tensors); its
    metas renamed the same way, from shape-only tensors, without reading a weight."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source

    def metas(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        torch = torch_module()
        shapes = (
            (name, torch.empty(shape, dtype=dtype, device="meta"))
            for name, shape, dtype in self.source.metas()
        )
        return [(name, tuple(t.shape), t.dtype) for name, t in checkpoint_named_tensors(shapes)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with reading(self.source) as inner:
            yield from checkpoint_named_tensors(inner)


def tensor_source(named_tensors: Iterable[tuple[str, torch.Tensor]] | TensorSource) -> TensorSource:
    """`named_tensors` as a TensorSource: itself when it is one, else held in memory."""
    if hasattr(named_tensors, "metas"):
        return named_tensors  # type: ignore[return-value]  # hasattr narrows nothing for mypy
    return InMemory(named_tensors)


# --- the process group ---------------------------------------------------------------


class SyncTimeout(RuntimeError):
    """A collective of the sync group did not complete in time (a peer died or hangs)."""


class SyncCancelled(RuntimeError):
    """A peer refused its part before the collective could finish: waiting out the group's
    timeout for a broadcast it never joins would only delay the same failure."""


POLL_FIRST_S, POLL_MAX_S = 5e-5, 1e-3
PEER_CANCEL_POLL_S = 0.1
CANCEL_KEY = "cancelled"  # in the group's own (prefixed) store: why a rank cancelled it


def _never() -> str | None:
    return None


def wait_bounded(
    work: Any,
    timeout_s: float,
    *,
    clock: Any = time.monotonic,
    sleep: Any = time.sleep,
    cancelled: Callable[[], str | None] = _never,
) -> None:
    """Block this thread until `work` completes, for at most `timeout_s`; then `work.wait()`.

    Under NCCL `wait()` neither blocks the host nor raises: it makes the current CUDA stream
    wait, so a broadcast a dead peer never finishes would stall every later kernel of the
    process, and the host would carry on as if it had been sent. `is_completed()` asks
    without blocking (NCCL: has its end event fired; gloo: has it finished, with or without
    an error), so the host polls it against a deadline and calls `wait()` only on finished
    work (gloo raises its error there; NCCL orders the current stream after it). SyncTimeout
    if it does not finish, SyncCancelled as soon as `cancelled()` names a reason (a peer that
    answered it will not join): the caller aborts the group either way."""
    deadline, delay = clock() + timeout_s, POLL_FIRST_S
    while not work.is_completed():
        if (why := cancelled()) is not None:
            raise SyncCancelled(why)
        if clock() >= deadline:
            raise SyncTimeout(
                f"a weight-sync collective did not complete in {timeout_s:.0f} s "
                "(a peer died or hangs); the group is aborted"
            )
        sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)
    work.wait()


class PeerCancelWatch:
    """Asks a group's store whether another rank cancelled it (CANCEL_KEY), every
    PEER_CANCEL_POLL_S while one of this rank's waits is in progress, on a thread of its own:
    torch's TCPStore client (2.13) bounds neither `check` nor `get` by its timeout, and a
    master that stops answering without closing its socket (a frozen learner) blocks them
    for as long as TCP keeps the connection, so the wait reads only what this thread found
    and keeps its own deadline. After the store's first error (its master is gone) it stops
    asking, logged once: each failed call prints a C++ stack trace, ten a second otherwise."""

    def __init__(self, store: Any) -> None:
        # No reference back to the group: a cycle would leave its process group to the
        # garbage collector, and gloo's destructor joins its threads holding the GIL (30 s
        # with a broadcast left pending, measured: every thread of the process stalls).
        self.store = store
        self.reason: str | None = None  # the cancel another rank wrote
        self.waiting = threading.Event()
        self.stopped = False
        self.failed: str | None = None  # why the store could not be asked (it is not again)
        self.thread: threading.Thread | None = None

    def begin(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="gspo-sync-cancel", daemon=True)
            self.thread.start()
        self.waiting.set()

    def end(self) -> None:
        self.waiting.clear()

    def stop(self) -> None:
        self.stopped = True
        self.waiting.set()  # wakes the thread to return

    def _run(self) -> None:
        while True:
            self.waiting.wait()
            if self.stopped:
                return
            try:
                if self.store.check([CANCEL_KEY]):
                    self.reason = bytes(self.store.get(CANCEL_KEY)).decode(errors="replace")
                    return
            except Exception as exc:
                self.failed = str(exc)
                log.warning(
                    "The weight-sync group's store stopped answering (%s); its waits end at "
                    "their own deadline",
                    self.failed,
                )
                return
            time.sleep(PEER_CANCEL_POLL_S)


class SyncGroup:
    """A standalone process group of learner rank 0 (root) and the rollout workers. Every
    wait on it is bounded by `timeout_s` (wait_bounded); `close` ends it: shut down when it
    is healthy, aborted when a collective failed (NCCL's abort unblocks kernels a dead peer
    left waiting, which a shutdown would wait on)."""

    def __init__(
        self, pg: Any, store: Any, rank: int, world_size: int, device: Any, timeout_s: float = 120.0
    ) -> None:
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.device, self.timeout_s = device, timeout_s
        self.closed = False
        self.clock, self.sleep = time.monotonic, time.sleep  # what bounds the waits
        self.cancelled: str | None = None  # why the collective being waited on cannot finish
        self._watch = PeerCancelWatch(store) if store is not None else None

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.broadcast_async(tensor))

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0; returns the work handle to `wait()` on."""
        torch = torch_module()
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def wait(self, work: Any) -> None:
        """Until `work` completes, at most the group's timeout (SyncTimeout otherwise), or
        until `cancel` here or on another rank (SyncCancelled)."""
        if self._watch is not None:
            self._watch.begin()
        try:
            wait_bounded(
                work,
                self.timeout_s,
                clock=self.clock,
                sleep=self.sleep,
                cancelled=self._cancel_reason,
            )
        finally:
            if self._watch is not None:
                self._watch.end()

    def cancel(self, why: str) -> None:
        """From any thread: the wait in progress, and every later one, ends with
        SyncCancelled(`why`), here and, through the group's store, on every other rank
        within PEER_CANCEL_POLL_S: the receivers of a broadcast the learner stopped sending
        would otherwise each wait out the timeout (aborting the learner's side does not
        free them, under gloo or NCCL). The callers then abort the group. The first reason
        stays: the others follow from it (the servers it freed answer with errors too)."""
        if self.cancelled is not None:
            return
        self.cancelled = why
        if self.store is not None:
            try:  # a TCPStore set only sends: it returns at once even to a master that hangs
                self.store.set(CANCEL_KEY, why)
            except Exception as exc:  # the peers time out instead
                log.warning("Could not tell the weight-sync group's peers it is cancelled: %s", exc)

    def _cancel_reason(self) -> str | None:
        """Why the wait in progress cannot finish: this rank's cancel, else a peer's."""
        if self.cancelled is None and self._watch is not None:
            self.cancelled = self._watch.reason
        return self.cancelled

    def close(self, *, abort: bool) -> None:
        """End the group (once): `abort` after a failed or timed-out collective, or when the
        peers may be gone; else a shutdown, falling back to abort if it fails."""
        if self.closed:
            return
        self.closed = True
        if self._watch is not None:
            self._watch.stop()
        if not abort:
            shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "_shutdown", None)
            try:
                if shutdown is not None:
                    shutdown()
                    return
            except Exception as exc:  # aborted below
                log.warning("Shutting the weight-sync group down failed (%s); aborting it", exc)
        try:
            self.pg.abort()
        except Exception as exc:  # the group is dropped either way
            log.warning("Aborting the weight-sync group failed: %s", exc)


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> Any:
    """The TCPStore rendezvous; rank 0 hosts it, listening on `host` only, and can keep it
    for many groups."""
    if is_master:
        from gspo_trainer.bound_store import serve_store

        return serve_store(host, port, world_size=None, timeout=timedelta(seconds=timeout_s))
    torch = torch_module()
    return torch.distributed.TCPStore(
        host,
        port,
        None,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def open_group(
    store: Any,
    group_name: str,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> SyncGroup:
    """Join group `group_name` on `store`; blocks until all `world_size` ranks have joined."""
    torch = torch_module()
    dist = torch.distributed
    prefixed = dist.PrefixStore(f"gspo-sync/{group_name}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        pg, device = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), "cpu"
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        # The calling thread's GPU (a learner thread enters its rank's: device.to_thread).
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"weight-sync backend {backend!r} is not one of 'gloo', 'nccl'")
    group = SyncGroup(pg, prefixed, rank, world_size, device, timeout_s)
    # One tiny collective so that a rank missing from the group fails here, not mid-update.
    try:
        group.broadcast(torch.zeros(1, dtype=torch.uint8, device=device))
    except BaseException:
        group.close(abort=True)
        raise
    return group


def _broadcast_header(group: SyncGroup, version: int, layout: bytes) -> None:
    torch = torch_module()
    group.broadcast(torch.tensor([version, len(layout)], dtype=torch.int64, device=group.device))
    payload = torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(group.device)
    group.broadcast(payload)


def _receive_header(group: SyncGroup) -> tuple[int, bytes]:
    torch = torch_module()
    head = torch.zeros(2, dtype=torch.int64, device=group.device)
    group.broadcast(head)
    version, length = (int(x) for x in head.tolist())
    payload = torch.empty(length, dtype=torch.uint8, device=group.device)
    group.broadcast(payload)
    return version, payload.cpu().numpy().tobytes()


class WeightSender:
    """Rank 0's side: `send(named_tensors, version)` broadcasts header then buckets."""

    def __init__(self, group: SyncGroup, *, bucket_mb: float = 256.0) -> None:
        if group.rank != 0:
            raise ValueError(f"WeightSender must be rank 0 of the sync group, not {group.rank}")
        self.group = group
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        # (metas, plan, encoded plan, send buffers), computed once per model
        self._layout: tuple[Any, list[Bucket], bytes, SendBuffers] | None = None

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | TensorSource, version: int
    ) -> SyncStats:
        """Header, then the buckets; a tensor is read only when its bucket is filled, so a
        streamed source (ParamStream) needs at most the two send buffers and one layer."""
        start = time.perf_counter()
        source = tensor_source(named_tensors)
        with gc_paused():
            metas = [
                (name, shape, _dtype_name(dtype), math.prod(shape) * dtype.itemsize)
                for name, shape, dtype in source.metas()
            ]
            key = tuple(metas)
            if self._layout is None or self._layout[0] != key:
                self._layout = None  # free the old buffers before making new ones
                buckets = plan_buckets(metas, self.bucket_bytes)
                staging = SendBuffers(buckets, self.group.device)
                self._layout = (key, buckets, encode_layout(buckets), staging)
            _, buckets, layout, staging = self._layout
            _broadcast_header(self.group, version, layout)
            with reading(source) as tensors:
                # Fill bucket k+1 while bucket k is on the wire. Each wait blocks the host
                # until the bucket is sent (bounded), so the time below is the transfer's,
                # not the enqueueing's, and a send buffer is refilled only once it is sent.
                in_flight: Any = None
                for k, bucket in enumerate(buckets):
                    buffer = staging.fill(k, bucket, tensors)
                    if in_flight is not None:
                        self.group.wait(in_flight)
                    in_flight = self.group.broadcast_async(buffer)
                if in_flight is not None:
                    self.group.wait(in_flight)
        return SyncStats(
            version=version,
            bytes_total=sum(m[3] for m in metas),
            buckets=len(buckets),
            tensors=len(metas),
            seconds=time.perf_counter() - start,
        )


def receive_weights(group: SyncGroup) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """A receiver's side: (version, iterator of named tensors, bucket by bucket).

    The iterator must be consumed to the end: each step takes part in a broadcast.
    """
    torch = torch_module()
    version, layout = _receive_header(group)
    buckets = decode_layout(layout)

    def post(bucket: Bucket) -> tuple[Bucket, Tensor, Any]:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        return bucket, buffer, group.broadcast_async(buffer)

    def tensors() -> Iterator[tuple[str, Tensor]]:
        # Receive bucket k+1 while the caller loads bucket k.
        with gc_paused():
            pending = post(buckets[0]) if buckets else None
            for k in range(len(buckets)):
                assert pending is not None
                bucket, buffer, work = pending
                group.wait(work)  # bounded: a learner that died mid-broadcast fails it
                pending = post(buckets[k + 1]) if k + 1 < len(buckets) else None
                yield from unflatten_bucket(bucket, buffer)

    return version, tensors()
