"""A keyed work queue with delayed re-adds: controller-runtime's workqueue, reduced.

A key waits in the queue at most once however many events name it, and no two workers
process the same key at once: a key added while it is being processed runs again after.
`add_after` keeps only the earliest pending time per key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self) -> None:
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._dirty: set[K] = set()  # queued, not yet taken
        self._processing: set[K] = set()
        self._later: dict[K, asyncio.TimerHandle] = {}

    def add(self, key: K) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        pending = self._later.get(key)
        if pending is not None and pending.when() <= when:
            return
        if pending is not None:
            pending.cancel()
        self._later[key] = loop.call_at(when, self._fire, key)

    def _fire(self, key: K) -> None:
        self._later.pop(key, None)
        self.add(key)

    async def get(self) -> K:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def forget(self, key: K) -> None:
        """Drop a delayed re-add (the object is gone)."""
        pending = self._later.pop(key, None)
        if pending is not None:
            pending.cancel()

    def __len__(self) -> int:
        return self._queue.qsize() + len(self._later)
