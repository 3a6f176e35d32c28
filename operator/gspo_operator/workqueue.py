"""A keyed work queue with delayed re-adds: controller-runtime's workqueue, reduced.

A key waits in the queue at most once however many events name it, and no two workers
process the same key at once: a key added while it is being processed runs again after.
`add_after` keeps only the earliest pending time per key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._dirty: set[Hashable] = set()  # queued, not yet taken
        self._processing: set[Hashable] = set()
        self._later: dict[Hashable, asyncio.TimerHandle] = {}

    def add(self, key: Hashable) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.put_nowait(key)

    def add_after(self, key: Hashable, delay_s: float) -> None:
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

    def _fire(self, key: Hashable) -> None:
        self._later.pop(key, None)
        self.add(key)

    async def get(self) -> Hashable:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def forget(self, key: Hashable) -> None:
        """Drop a delayed re-add (the object is gone)."""
        pending = self._later.pop(key, None)
        if pending is not None:
            pending.cancel()

    def __len__(self) -> int:
        return self._queue.qsize() + len(self._later)
