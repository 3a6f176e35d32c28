"""What a rollout server adds to a vLLM engine, whatever serves its HTTP: the policy version
it holds, the gate that keeps a version from changing under a running generation, and the
weight swap itself (pause and drain, load, bump the version, resume).

A generation is admitted whole under one version (`DrainGate.admit`) and a swap first
closes the gate and waits for every admitted one to finish, so no completion mixes two
versions, and the version a completion reports is the one that produced it. A swap that
fails leaves the server unsynced (not ready) rather than serving half-loaded weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

T = TypeVar("T")
# An engine operation that loads weights and answers what it loaded ({"bytes": ..., ...}).
Loader = Callable[..., Awaitable[dict[str, int]]]

log = logging.getLogger("gspo.rollout")

SYNC_INIT_FIELDS = ("master_addr", "master_port", "rank_offset", "world_size", "group_name")


class ControlError(Exception):
    """A control request that failed, with the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DrainGate:
    """Admits generations unless paused; `pause` waits until the admitted ones finish."""

    def __init__(self) -> None:
        self.active = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @asynccontextmanager
    async def admit(self, timeout_s: float) -> AsyncIterator[None]:
        async with asyncio.timeout(timeout_s):
            await self._open.wait()
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def pause(self, timeout_s: float) -> None:
        self._open.clear()
        async with asyncio.timeout(timeout_s):
            await self._idle.wait()

    def resume(self) -> None:
        self._open.set()


class RolloutState:
    """One server's policy version, gate and sync metrics (gspo_rollout_*, in `registry`)."""

    def __init__(self, version: int | None, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        self.policy_version = version  # None: not synced, not ready
        self.gate = DrainGate()
        self.sync_lock = asyncio.Lock()
        self.version_gauge = Gauge(
            "gspo_rollout_policy_version",
            "Policy version of the weights this server generates with (-1: not synced)",
            registry=self.registry,
        )
        self.sync_seconds = Gauge(
            "gspo_rollout_last_sync_seconds",
            "Wall time of the last weight update, receive and load",
            registry=self.registry,
        )
        self.sync_bytes = Gauge(
            "gspo_rollout_last_sync_bytes",
            "Bytes received by the last weight update",
            registry=self.registry,
        )
        self.requests = Counter(
            "gspo_rollout_requests",
            "Generation requests served, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.set_version(version)

    def set_version(self, version: int | None) -> None:
        self.policy_version = version
        self.version_gauge.set(-1 if version is None else version)

    async def pause(self, timeout_s: float) -> dict[str, Any]:
        try:
            await self.gate.pause(timeout_s)
        except TimeoutError as exc:
            raise ControlError(
                504, f"still {self.gate.active} requests in flight; still paused"
            ) from exc
        return {"paused": True, "policy_version": self.policy_version}

    def resume(self) -> dict[str, Any]:
        self.gate.resume()
        return {"paused": False, "policy_version": self.policy_version}

    async def join(self, body: dict[str, Any], init: Callable[..., Awaitable[T]]) -> T:
        """/control/sync/init: the engine's workers join the learner's sync group
        (`init(**coordinates)`, whose result is returned); 500 naming the cause otherwise."""
        coords = sync_coordinates(body)
        async with self.sync_lock:
            try:
                return await init(**coords)
            except Exception as exc:
                log.exception("joining the sync group failed")
                raise ControlError(500, f"sync/init failed: {exc}") from exc

    async def receive(self, body: dict[str, Any], receive: Loader) -> dict[str, Any]:
        """/control/sync/update: one broadcast received and loaded (`receive(timeout_s)`,
        answering its version and bytes), under the swap's pause."""
        timeout_s = float(body.get("timeout_s", 600))

        async def load() -> tuple[int, dict[str, int]]:
            received = await receive(timeout_s)
            return int(received["version"]), received

        return await self.swap_weights(load, timeout_s, "sync/update")

    async def load_file(
        self, body: dict[str, Any], weights_dir: Any, setting: str, load: Loader
    ) -> dict[str, Any]:
        """/control/sync/load: the version a body names, loaded from `weights_dir` (`load(path,
        timeout_s)`), under the swap's pause; `setting` names what gives the directory."""
        version, path = load_version(body, weights_dir, setting)
        timeout_s = float(body.get("timeout_s", 600))

        async def swap() -> tuple[int, dict[str, int]]:
            return version, await load(str(path), timeout_s)

        return await self.swap_weights(swap, timeout_s, "sync/load")

    async def swap_weights(
        self,
        load: Callable[[], Awaitable[tuple[int, dict[str, int]]]],
        timeout_s: float,
        route: str,
    ) -> dict[str, Any]:
        """Load new weights with generation paused and drained; bump the version after.
        `load` returns (version, {"bytes": ..., ...})."""
        async with self.sync_lock:
            was_paused = self.gate.paused
            try:
                await self.gate.pause(timeout_s)
                start = time.perf_counter()
                version, received = await load()
            except Exception as exc:
                log.exception("weight update failed")
                # Weights may be half loaded: this server must not serve until a full update.
                self.set_version(None)
                raise ControlError(500, f"{route} failed, server marked not synced: {exc}") from exc
            finally:
                if not was_paused:
                    self.gate.resume()
            seconds = time.perf_counter() - start
            self.set_version(version)
            self.sync_seconds.set(seconds)
            self.sync_bytes.set(received["bytes"])
        log.info("Loaded policy version %s (%s bytes, %.2fs)", version, received["bytes"], seconds)
        return {**received, "version": version, "policy_version": version, "seconds": seconds}


def sync_coordinates(body: dict[str, Any]) -> dict[str, Any]:
    """The sync-group coordinates of a /control/sync/init body (400 naming what is missing)."""
    missing = [f for f in SYNC_INIT_FIELDS if f not in body]
    if missing:
        raise ControlError(400, f"sync/init: missing fields {missing}")
    coords = {f: body[f] for f in SYNC_INIT_FIELDS}
    coords["backend"] = body.get("backend", "gloo")
    coords["timeout_s"] = float(body.get("timeout_s", 120))
    return coords


def load_version(body: dict[str, Any], weights_dir: Any, setting: str) -> tuple[int, Any]:
    """(version, its directory) of a /control/sync/load body (weightSync.method filesystem);
    `setting` names what gives a server its weights directory."""
    from gspo_trainer.rollout import weight_files

    if weights_dir is None:
        raise ControlError(
            409,
            f"sync/load: this server was started without {setting}, so "
            "it cannot load weights from files; use the broadcast, or start "
            f"it with {setting} on the learner's volume",
        )
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ControlError(
            400, f"sync/load: version must be a non-negative integer, got {version!r}"
        )
    try:
        return version, weight_files.resolve(weights_dir, body.get("name"))
    except ValueError as exc:
        raise ControlError(400, f"sync/load: {exc}") from exc
