"""The loop every controller stand-in runs: level-triggered, one pass over its kind a period.

Real controllers react to watch events from informers; the stand-ins re-read the store every
`period_s` instead (the result is the same level-triggered reconcile, at a short delay). A
failure on one object is logged and kept in `errors` for the tests, and the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from apiserver import ClusterApiServer

Obj = dict[str, Any]
log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, api: ClusterApiServer, period_s: float) -> None:
        self.api = api
        self.period_s = period_s
        self.errors: list[BaseException] = []  # sync failures, kept for tests to inspect

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile every object every `period_s` until `stop` is set."""
        while not stop.is_set():
            await self.sync_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)

    async def sync_all(self) -> None:
        raise NotImplementedError

    async def sync_each(self, kind: str, sync: Callable[[Obj], Awaitable[None]]) -> set[str]:
        """Call `sync` on the current version of every object of `kind`; the uids synced."""
        seen = set()
        for obj in list(self.api.list_kind(kind)):
            meta = obj["metadata"]
            current = self.api.get(kind, meta.get("namespace", ""), meta["name"])
            if current is None or current["metadata"]["uid"] != meta["uid"]:
                continue  # deleted (or replaced) by an earlier sync in this pass
            seen.add(meta["uid"])
            try:
                await sync(current)
            except Exception as exc:  # a stand-in must keep the other objects going
                log.exception("syncing %s %s/%s", kind, meta.get("namespace"), meta["name"])
                self.errors.append(exc)
        return seen
