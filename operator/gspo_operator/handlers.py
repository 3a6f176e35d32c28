"""kopf wiring: the watches, their in-memory indexes, and the work queue they feed.

kopf watches the GSPOJobs and, with a server-side label selector on the job label, their
JobSets, pods, ConfigMaps, Services, claims and NetworkPolicies. Indexing handlers keep what a
reconcile needs from each (kopf fills every index before any other handler runs); event
handlers only queue the job's key. Workers take keys off the queue and run
`reconcile.reconcile` (no kopf there), which says when to look again. No handler here needs
a finalizer, so none is added, and the one older releases put on jobs is removed.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import kopf

from gspo_api.spec import API_GROUP, API_VERSION
from gspo_operator import names, reconcile, status, views
from gspo_operator.children import ChildView
from gspo_operator.crd import PLURAL
from gspo_operator.reconcile import DEFAULT_INTERVAL_S, Context, Key
from gspo_operator.workqueue import WorkQueue

__all__ = ["DEFAULT_INTERVAL_S", "WATCHED_CHILDREN", "Context", "label_selectors", "register"]

WORKERS = 4
# (api version, plural) of the children the operator watches, beside JobSets and pods.
WATCHED_CHILDREN = (
    ("v1", "configmaps"),
    ("v1", "services"),
    ("v1", "persistentvolumeclaims"),
    ("networking.k8s.io/v1", "networkpolicies"),
)
JOBSETS = ("jobset.x-k8s.io/v1alpha2", "jobsets")
PODS = ("v1", "pods")
INDEXES = ("gspojobs", "jobsets", "pods", "children")


def label_selectors(settings: kopf.OperatorSettings) -> None:
    """Watch only the job's own children: the API server filters on the job label."""
    for selector in (JOBSETS, PODS, *WATCHED_CHILDREN):
        settings.watching.label_selectors[selector] = names.JOB_LABEL


def _post(body: Mapping[str, Any], event: status.Event) -> None:
    # kopf.event reads any mapping (its dicts.walk takes mappings as objects); its annotation
    # names kopf's own Body view, which a plain dict is not.
    kopf.event(dict(body), type=event.type, reason=event.reason, message=event.message)  # type: ignore[arg-type]


def _job_of(namespace: str | None, labels: Mapping[str, str]) -> Key:
    return (namespace or "", labels[names.JOB_LABEL])


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    """Add the GSPOJob watches, indexes and the work queue's feeders to `registry`."""
    resource = (API_GROUP, API_VERSION, PLURAL)
    queue: WorkQueue[Key] = WorkQueue()
    ctx.post = _post
    workers: list[asyncio.Task[None]] = []

    def start(indices: Mapping[str, Any]) -> None:
        """Once, from the first event handler: kopf's indexes are full by then, and the
        workers inherit the context kopf posts Events from."""
        if workers:
            return
        ctx.indices = {name: indices[name] for name in INDEXES if name in indices}
        workers.extend(asyncio.create_task(_work(ctx, queue)) for _ in range(WORKERS))

    @kopf.on.cleanup(registry=registry)
    async def stop_workers(**_: Any) -> None:
        """Stop the workers with kopf, or it would wait for them as hung tasks."""
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        workers.clear()

    @kopf.index(*resource, registry=registry, id="gspojobs")
    async def gspojobs(namespace: str | None, name: str, body: Any, **_: Any) -> dict[Key, Any]:
        return {(namespace or "", name): copy.deepcopy(dict(body))}

    @kopf.on.event(*resource, registry=registry)
    async def job_changed(
        namespace: str | None, name: str, type: str | None, **kwargs: Any
    ) -> None:
        start(kwargs)
        key = (namespace or "", name)
        if type == "DELETED":
            queue.forget(key)
        queue.add(key)

    async def jobset_view(
        namespace: str | None, labels: Mapping[str, str], body: Any, **_: Any
    ) -> Any:
        view = (ChildView.from_object(body), views.JobSetView.from_jobset(body))
        return {_job_of(namespace, labels): view}

    async def pod_view(
        namespace: str | None, labels: Mapping[str, str], body: Any, **_: Any
    ) -> Any:
        return {_job_of(namespace, labels): views.PodView.from_pod(body)}

    async def child_view(
        namespace: str | None, labels: Mapping[str, str], body: Any, **_: Any
    ) -> Any:
        return {_job_of(namespace, labels): ChildView.from_object(body)}

    async def child_changed(
        namespace: str | None,
        labels: Mapping[str, str],
        type: str | None,
        body: Any,
        name: str | None,
        **kwargs: Any,
    ) -> None:
        start(kwargs)
        if names.JOB_LABEL in labels:
            key = _job_of(namespace, labels)
            if type == "DELETED":
                reconcile.child_deleted(ctx, key, (body.get("kind", ""), name or ""))
            queue.add(key)

    present = {names.JOB_LABEL: kopf.PRESENT}
    watched = [(PODS, "pods", pod_view), *((c, "children", child_view) for c in WATCHED_CHILDREN)]
    if ctx.watch_jobsets:
        watched.insert(0, (JOBSETS, "jobsets", jobset_view))
    for (api_version, plural), index, view in watched:
        kopf.index(api_version, plural, id=index, labels=present, registry=registry)(view)
        kopf.on.event(api_version, plural, labels=present, registry=registry, id=f"{plural}")(
            child_changed
        )


async def _work(ctx: Context, queue: WorkQueue[Key]) -> None:
    """Take a job's key, reconcile it, queue it again when it asks to be looked at."""
    while True:
        key = await queue.get()
        try:
            delay = await reconcile.reconcile(ctx, key)
        except Exception:  # a bug, not an API error: log it, look again later
            reconcile.log.exception("Reconcile of %s/%s failed", *key)
            delay = ctx.interval_s
        finally:
            queue.done(key)
        if delay is not None:
            queue.add_after(key, delay)
