"""One reconcile of one GSPOJob: observe → compute → act, and the one writer of its status.

Driven by a work queue (handlers.py feeds it from watch events), never by a timer per job:
the job, its JobSet, its pods and its other children come from kopf's in-memory indexes of
the watches, so a reconcile makes no API request unless something must change. The learner's
/progress is read only while rank 0 runs, every `interval_s`; a status change that is only
progress (step, reward, versions) is written at most every `progress_write_s`. Finished jobs
are not polled at all (one wake-up at their TTL, if they have one). Secrets and PodMonitors
are not watched (listing Secrets would need far more than this operator's own), so they are
checked by name once after start-up and every `resync_s`.

No finalizer is kept: the children carry ownerReferences, so the garbage collector deletes
them with the job even while the operator is down.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import yaml

from gspo_api import ports
from gspo_api.spec import GSPOJobSpec, Phase
from gspo_api.validation import Problem, SpecError, parse_spec
from gspo_operator import api_errors, names, render, status, views
from gspo_operator.children import (
    ChildKey,
    ChildView,
    contains,
    plan_children,
    repair_patch,
)
from gspo_operator.kube import JOB_API, ApiError, Kube
from gspo_operator.manifest import ClusterPolicy, check_job
from gspo_operator.memory_check import check_memory, overcommit_allowed
from gspo_operator.metrics import OperatorMetrics
from gspo_operator.progress import fetch_progress

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
Obj = dict[str, Any]

DEFAULT_INTERVAL_S = 10.0
DEFAULT_PROGRESS_WRITE_S = 30.0
# Status writes a minute the operator spends on progress, shared by every running job: a few
# jobs see their step refreshed every 30 s, 200 jobs every 400 s, and the API server's load
# stays flat however many jobs run.
DEFAULT_PROGRESS_WRITES_PER_MINUTE = 30.0
DEFAULT_RESYNC_S = 600.0
# Kinds a cluster may lack: the job runs without them, and the operator says so once.
OPTIONAL_KINDS = ("PodMonitor",)
# Children no watch covers; checked by name at start-up and every resync.
UNWATCHED_KINDS = ("Secret", "PodMonitor")
# Status fields that only report training progress: written at most every progress_write_s.
PROGRESS_FIELDS = ("step", "reward", "policyVersion", "serverVersions", "lastCheckpoint")
PROGRESS_CONDITIONS = ("WeightsSynced",)  # their message names the policy version
OWN_WRITE_WAIT_S = 5.0  # how long to wait for the watch to show our own status write


# The checked spec of one job uid, generation, allow-overcommit annotation and queue label.
CheckVersion = tuple[str, int, bool, str | None]
# The rendered children of one job uid, generation and spec in effect (its hash).
RenderVersion = tuple[str, int, str]


@dataclass
class JobMemory:
    """What reconcile remembers of one job between passes. Everything else it reads afresh
    from the watches' indexes; `Context.forget` drops the record whole when the job goes."""

    phase: Phase | None = None  # as last written (metrics, the progress-write budget)
    # The spec in effect, with the uid of the job it is for (a job re-created with the same
    # name is another job).
    accepted: tuple[str, GSPOJobSpec] | None = None
    last_write: float | None = None  # monotonic
    # The job's resourceVersion before this operator's last status write, and until when to
    # wait for the watch to show a newer one (kopf's consistency timeout: 5 s).
    own_write: tuple[str, float] | None = None
    # The unwatched children (Secrets, PodMonitors) as read for a job uid, and when.
    unwatched: tuple[str, float, dict[ChildKey, ChildView]] | None = None
    failures: int = 0  # API errors in a row
    not_before: float | None = None  # monotonic: backing off until then
    # The checked spec and the rendered children, per job uid and generation (and spec in
    # effect): a pod's event re-validates and re-renders nothing.
    check: tuple[CheckVersion, tuple[GSPOJobSpec | None, list[Problem]]] | None = None
    render: tuple[RenderVersion, list[Obj]] | None = None
    # What this operator just created or repaired, until its watch shows it (controller-
    # runtime's "expectations"): a reconcile in between neither creates it twice nor repairs
    # it again.
    expected: dict[ChildKey, tuple[ChildView, float, bool]] = field(default_factory=dict)


@dataclass
class Context:
    """What every reconcile shares: the API adapter, the watches' indexes, per-job memory."""

    kube: Kube
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    interval_s: float = DEFAULT_INTERVAL_S  # /progress of a running learner
    progress_write_s: float = DEFAULT_PROGRESS_WRITE_S  # the shortest, with few jobs
    progress_writes_per_minute: float = DEFAULT_PROGRESS_WRITES_PER_MINUTE  # 0: no budget
    resync_s: float = DEFAULT_RESYNC_S
    policy: ClusterPolicy = field(default_factory=ClusterPolicy.from_env)
    post: Callable[[Mapping[str, Any], status.Event], None] = lambda body, event: None
    indices: Mapping[str, Any] = field(default_factory=dict)  # kopf's, by index name
    watch_jobsets: bool = True  # False: the JobSet API was not served at start-up; GET it
    http: aiohttp.ClientSession | None = None
    jobs: dict[Key, JobMemory] = field(default_factory=dict)  # what each pass leaves the next
    deleted: set[str] = field(default_factory=set)  # uids of jobs this operator deleted (TTL)
    noted: set[str] = field(default_factory=set)  # cluster-wide notes already logged
    # Monotonic time until which Kueue's Workload API counts as not served (asked again then).
    workloads_unserved_until: float = 0.0

    def note_once(self, message: str) -> None:
        if message not in self.noted:
            self.noted.add(message)
            log.warning(message)

    def session(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession()
        return self.http

    def indexed(self, index: str, key: Key) -> list[Any]:
        store = self.indices.get(index)
        if store is None:
            return []
        try:
            return list(store[key])
        except KeyError:
            return []

    def job(self, key: Key) -> JobMemory:
        """The job's record, made on first use."""
        return self.jobs.setdefault(key, JobMemory())

    def phases(self) -> list[Phase]:
        return [m.phase for m in self.jobs.values() if m.phase is not None]

    def forget(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self.metrics.forget_job(*key)
        self.metrics.count_phases(self.phases())


def _now() -> datetime:
    return datetime.now(UTC)


# --- the reconcile --------------------------------------------------------------------------


async def reconcile(ctx: Context, key: Key) -> float | None:
    """Bring one job one step closer to its spec; seconds until it wants looking at again."""
    bodies = ctx.indexed("gspojobs", key)
    if not bodies:
        ctx.forget(key)
        return None
    body: Obj = bodies[0]
    meta = body["metadata"]
    if meta.get("deletionTimestamp") or meta.get("uid") in ctx.deleted:
        return None  # the garbage collector takes the children
    memory = ctx.job(key)
    if memory.not_before is not None and (wait := memory.not_before - time.monotonic()) > 0:
        return wait  # backing off after an API error: events do not hurry it
    memory.not_before = None
    stale = memory.own_write
    if (
        stale is not None
        and stale[0] == meta.get("resourceVersion")
        and time.monotonic() < stale[1]
    ):
        return 0.1  # the watch still shows the job as it was before our own status write
    memory.own_write = None
    with ctx.metrics.reconcile():
        try:
            delay = await _reconcile(ctx, key, body)
        except ApiError as exc:
            delay = _back_off(ctx, key, exc.retry_after_s)
            log.warning("Reconcile of %s/%s failed (retry in %.1f s): %s", *key, delay, exc)
            return delay
    if memory.not_before is None:
        memory.failures = 0  # a reconcile went through: the next error starts afresh
    return delay


def _back_off(ctx: Context, key: Key, retry_after_s: float | None = None) -> float:
    """Seconds until the next try after another failure in a row; events do not hurry it."""
    memory = ctx.job(key)
    memory.failures += 1
    delay = api_errors.backoff_s(memory.failures, retry_after_s=retry_after_s)
    memory.not_before = time.monotonic() + delay
    return delay


async def _reconcile(ctx: Context, key: Key, body: Obj) -> float | None:
    """Observe → compute → act → write: every phase and condition comes from the one pure
    `status.compute`; this function only decides what to look at and what to do."""
    previous: Obj = copy.deepcopy(body.get("status") or {})
    obs = await _observe(ctx, key, body, previous)
    if obs is None:
        return None  # an invalid edit of a job whose accepted spec is not known (yet)
    out = status.compute(obs)
    if out.halt is None or out.delete_job:  # a finished job's TTL passes even while blocked
        denied = await _act(ctx, key, body["metadata"]["uid"], out, obs.observed)
        if denied is not None:  # e.g. no RBAC to patch the Workload: the status says so
            out = status.compute(replace(obs, act_refusal=denied))
    await _write(ctx, key, body, previous, out.status, out.events, force=out.halt is not None)
    if out.halt == "invalid":
        return None  # until the job is edited
    if out.halt == "blocked":
        return _back_off(ctx, key)
    assert obs.spec is not None and obs.observed is not None  # compute halts without them
    _record(ctx, key, previous, out, obs.spec)
    return _next_look(ctx, key, obs.spec, out.status, obs.observed, obs.now)


async def _observe(ctx: Context, key: Key, body: Obj, previous: Obj) -> status.Observation | None:
    """What compute reads, in the order the job needs it: the spec (checked), the spec in
    effect, the children (created, repaired, refused), then the JobSet, pods and progress.
    Stops early where compute would: a spec refused at creation, a refused child."""
    meta = body["metadata"]
    spec, problems = _checked(ctx, key, body)
    obs = status.Observation(
        previous, _now(), problems=tuple(problems), generation=meta.get("generation")
    )
    if spec is None and status.refused_before_creation(previous):
        return obs
    uid = meta.get("uid", "")
    kept = ctx.job(key).accepted
    accepted = (kept[1] if kept and kept[0] == uid else None) or _spec_in_config_map(ctx, key, uid)
    accepted = accepted or spec
    if accepted is None:
        return None
    # An invalid edit keeps the accepted spec; a valid one takes what may change in flight.
    spec, refused = (accepted, []) if spec is None else _effective(accepted, spec)
    ctx.job(key).accepted = (uid, spec)
    obs = replace(obs, spec=spec, refused_fields=tuple(refused))
    terminal = status.finished(previous, valid=not problems)
    children = await _ensure_children(ctx, key, body, spec, terminal)
    obs = replace(obs, children=children)
    if children.refusal is not None:
        return obs
    return replace(obs, observed=await _observe_jobset(ctx, key, spec, previous))


# --- children -------------------------------------------------------------------------------


async def _ensure_children(
    ctx: Context, key: Key, body: Obj, spec: GSPOJobSpec, terminal: bool
) -> status.ChildrenSeen:
    """Create what is missing, repair what was changed by hand, refuse strangers."""
    desired = _rendered(ctx, key, body, spec)
    if terminal:  # a finished job's pods stay stopped
        desired = [o for o in desired if o["kind"] != "JobSet"]
    observed = _children_seen(ctx, key, body["metadata"].get("uid"))
    uid = body["metadata"]["uid"]
    try:
        observed.update(await _unwatched_children(ctx, key, uid, desired))
    except _ReadRefused as refused:  # RBAC without get on Secrets, say: into the status
        ctx.job(key).unwatched = None
        read = _refusal(refused.what, "read", refused.error)  # a transient one raises
        return status.ChildrenSeen(desired=len(desired), refusal=read)
    plan = plan_children(desired, observed, uid)
    made: list[str] = []
    unserved: list[str] = []  # kinds the cluster does not serve
    refusals: list[status.Refusal] = []

    async def create(obj: Obj) -> None:
        what = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] == "Secret":
            earlier = names.token_secret_earlier(key[1])
            try:
                obj = await _with_earlier_token(ctx, key, uid, obj)
            except ApiError as exc:
                refusals.append(_refusal(f"Secret {earlier}", "read", exc))
                return
        try:
            existing = await ctx.kube.create_or_get(obj)
        except ApiError as exc:
            if exc.status == 404 and obj["kind"] in (*OPTIONAL_KINDS, "JobSet"):
                _unserved(ctx, body, obj["kind"], what)
                unserved.append(obj["kind"])
                return
            refusals.append(_refusal(what, "create", exc))
            return
        if existing is None:
            _expect(ctx, key, obj, created=True)
            made.append(what)
            log.info("Created %s in %s", what, key[0])
            return
        view = ChildView.from_object(existing)
        if view.controller_uid != uid:
            refusals.append(status.Refusal("blocked", "Conflict", _foreign(what, view, key[1])))
        else:
            await repair(obj, view)

    async def repair(obj: Obj, view: ChildView) -> None:
        patch = repair_patch(obj, view)
        if patch is None:
            return
        what = f"{obj['kind']} {obj['metadata']['name']}"
        try:
            await ctx.kube.patch(
                obj["apiVersion"], obj["kind"], key[0], obj["metadata"]["name"], patch
            )
        except ApiError as exc:
            if exc.status == 404:
                return  # deleted meanwhile: the watch brings it back to create
            refusals.append(_refusal(what, "update", exc))
            return
        _expect(ctx, key, obj, created=False)
        log.info("Repaired %s in %s (%s changed by hand)", what, key[0], ", ".join(patch))

    # The JobSet last, once everything its pods mount and read exists: a refused claim must
    # not leave pods Pending on it.
    first = [o for o in plan.create if o["kind"] != "JobSet"]
    try:
        await asyncio.gather(
            *(create(o) for o in first),
            *(repair(o, observed[(o["kind"], o["metadata"]["name"])]) for o, _ in plan.repair),
        )
        for what in plan.foreign:
            kind, name = what.split(" ", 1)
            message = _foreign(what, observed[(kind, name)], key[1])
            refusals.append(status.Refusal("blocked", "Conflict", message))
        if not refusals:
            await asyncio.gather(*(create(o) for o in plan.create if o["kind"] == "JobSet"))
    except BaseException:
        # A transient error backs off: the unwatched children it did not create must not
        # count as created (_assume_created) at the next try, or the JobSet goes first.
        ctx.job(key).unwatched = None
        raise
    refusal = min(refusals, key=lambda r: r.verdict != "invalid", default=None)
    if refusal is not None:
        # Read the unwatched children again at the next try, not after resync_s: what
        # refused this one (an earlier job's Secret the garbage collector is deleting) can
        # be gone by then, and no watch event says so.
        ctx.job(key).unwatched = None
    return status.ChildrenSeen(
        desired=len(desired),
        made=len(made),
        jobset_unserved="JobSet" in unserved,
        refusal=refusal,
    )


def _checked(ctx: Context, key: Key, body: Obj) -> tuple[GSPOJobSpec | None, list[Any]]:
    """check_job once per spec generation, allow-overcommit annotation and Kueue queue-name
    label (metadata edits do not bump the generation, and the label can name the queue); a
    skipped memory plan or an allowed overcommit posts an event."""
    meta = body["metadata"]
    allowed = overcommit_allowed(meta.get("annotations"))
    labels = meta.get("labels")
    queue = labels.get(names.QUEUE_LABEL) if isinstance(labels, Mapping) else None
    version = (meta.get("uid", ""), int(meta.get("generation") or 0), allowed, queue)
    job = ctx.job(key)
    cached = job.check
    if cached is None or cached[0] != version:
        cached = job.check = (version, check_job(body, ctx.policy))
        spec = cached[1][0]
        if spec is not None:
            memory = check_memory(spec, allow_overcommit=allowed)
            kind: status.EventType = "Warning" if memory.plan else "Normal"
            reason = "MemoryOvercommit" if memory.plan else "MemoryPlanSkipped"
            for warning in memory.warnings:
                ctx.post(body, status.Event(kind, reason, warning))
    return cached[1]


def _rendered(ctx: Context, key: Key, body: Obj, spec: GSPOJobSpec) -> list[Obj]:
    """The children as `render` makes them (the token is only used when the Secret is
    created, so one rendering serves until the spec in effect changes)."""
    meta = body["metadata"]
    version = (meta.get("uid", ""), int(meta.get("generation") or 0), render.spec_hash(spec))
    memory = ctx.job(key)
    cached = memory.render
    if cached is None or cached[0] != version:
        token = secrets.token_urlsafe(32)
        cached = memory.render = (
            version,
            render.render_job(body, spec, token=token, policy=ctx.policy),
        )
    return list(cached[1])  # read-only: nothing downstream edits them


async def _with_earlier_token(ctx: Context, key: Key, uid: str, secret: Obj) -> Obj:
    """The job's Secret as it is created: with the token of the Secret an earlier release
    named J-sync-token, when this job has one. That job's running pods read that one, so
    `kubectl get secret J-job-token` then gives a token they accept, and a JobSet re-created
    for the job uses the same token as the pods still running from the old one."""
    name = names.token_secret_earlier(key[1])
    found = await ctx.kube.get("v1", "Secret", key[0], name)
    if found is None or ChildView.from_object(found).controller_uid != uid:
        return secret
    try:
        token = base64.b64decode((found.get("data") or {}).get("token") or "").decode()
    except ValueError:  # edited by hand into something that is no token
        token = ""
    if not token:
        log.warning("Secret %s in %s holds no token: a new one is made", name, key[0])
        return secret
    what = secret["metadata"]["name"]
    log.info("Secret %s in %s takes the token of %s (an earlier release's)", what, key[0], name)
    return render.with_token(secret, token)


def _refusal(what: str, verb: str, exc: ApiError) -> status.Refusal:
    verdict = api_errors.classify(exc.status)
    if verdict == "transient":
        raise exc  # throttled or unavailable: back off, change nothing
    reason = {403: "Forbidden", 404: "NotFound", 409: "Conflict"}.get(exc.status, "Invalid")
    return status.Refusal(
        verdict, reason, f"the API server refused to {verb} {what}: {exc.message}"
    )


def _foreign(what: str, view: ChildView, job: str) -> str:
    if view.controller == ("GSPOJob", job):
        # Deleted with background propagation (kubectl's default), a GSPOJob is gone at once
        # and its children follow when the garbage collector gets to them.
        return (
            f"{what} belongs to an earlier GSPOJob of this name (uid {view.controller_uid}), "
            "deleted; the garbage collector deletes its children, and this job goes on once "
            f"{what} is gone (if it stays, delete it)"
        )
    if what.startswith("PersistentVolumeClaim "):
        # Most often the claim an earlier job of this name kept (checkpoint.retainClaim): its
        # checkpoints are reused only when asked for, and deleting it deletes them.
        claim = what.split(" ", 1)[1]
        return (
            f"{what} already exists and is not this GSPOJob's (an earlier GSPOJob of this "
            "name keeps its checkpoint claim when deleted: checkpoint.retainClaim); to resume "
            f"from its checkpoints set spec.checkpoint.claimName: {claim}, to start afresh "
            "give the job another name or delete that claim (its checkpoints go with it)"
        )
    return (
        f"{what} already exists and is not controlled by this GSPOJob (no ownerReference with "
        "its uid); the operator adopts only its own children: delete that object, or give "
        "the job another name"
    )


def _unserved(ctx: Context, body: Obj, kind: str, what: str) -> None:
    if kind == "JobSet":
        ctx.note_once(status.JOBSET_MISSING)
        return
    ctx.note_once(f"{kind} not served: the jobs run without it")
    message = (
        f"{what} not created: the cluster does not serve the {kind} API (install the "
        "Prometheus Operator, or set spec.metrics.podMonitor: false); the job runs without it"
    )
    ctx.post(body, status.Event("Normal", f"{kind}Skipped", message))


def _children_seen(ctx: Context, key: Key, uid: str | None) -> dict[ChildKey, ChildView]:
    """Every watched child of the job, from the indexes, and what this operator has just
    created or repaired that its watch does not show yet (for this job: not for an earlier
    job of this name, whose children the garbage collector may have deleted unseen)."""
    out: dict[ChildKey, ChildView] = {}
    for index in ("jobsets", "children"):
        for view in ctx.indexed(index, key):
            view = view[0] if isinstance(view, tuple) else view
            out[(view.kind, view.name)] = view
    expected = ctx.job(key).expected
    now = time.monotonic()
    for child, (view, until, created) in list(expected.items()):
        seen = out.get(child)
        stale = view.controller_uid not in (None, uid)
        # A child this job created, once the watch shows it as this job's, is as the watch
        # shows it: any difference is a later edit (the watch has no older version of it;
        # one of an earlier job of the name, not yet gone from the watch, is not it). A
        # repaired one is the watch's once it shows the repair: until then the watch may
        # still hold the version before it.
        ours = created and seen is not None and seen.controller_uid == view.controller_uid
        shown = ours or (seen is not None and contains(view.fields, seen.fields))
        if stale or now > until or shown:
            del expected[child]  # the watch shows it (or it is too long ago to trust)
        else:
            out[child] = view
    return out


def child_deleted(ctx: Context, key: Key, child: ChildKey) -> None:
    """The watch showed `child` deleted: nothing this operator created or repaired of it is
    there any more, so the next reconcile creates it again now, not when the memory expires.
    (controller-runtime and kube-controller-manager lower their expectations on a deletion
    they observe the same way: pkg/controller/controller_utils.go, DeletionObserved.) Without
    it, a child repaired and then deleted before a reconcile saw the repair stayed missing
    for 30 s: its remembered repair counted as there."""
    memory = ctx.jobs.get(key)
    if memory is not None:
        memory.expected.pop(child, None)


def _expect(ctx: Context, key: Key, obj: Obj, *, created: bool) -> None:
    if obj["kind"] in UNWATCHED_KINDS:
        return
    view = ChildView.from_object(obj)
    until = time.monotonic() + 30.0
    ctx.job(key).expected[(view.kind, view.name)] = (view, until, created)


class _ReadRefused(Exception):
    """A read of an unwatched child answered with an error: which child, and the error."""

    def __init__(self, what: str, error: ApiError) -> None:
        super().__init__(f"{what}: {error}")
        self.what, self.error = what, error


async def _unwatched_children(
    ctx: Context, key: Key, uid: str, desired: list[Obj]
) -> dict[ChildKey, ChildView]:
    """Secrets and PodMonitors, read by name after start-up and every resync_s, per job uid:
    what an earlier job of this name saw or created (and the garbage collector has deleted
    since, with no watch event) is never this job's."""
    seen = ctx.job(key).unwatched
    if seen is not None and seen[0] == uid and time.monotonic() - seen[1] < ctx.resync_s:
        return seen[2]
    wanted = [o for o in desired if o["kind"] in UNWATCHED_KINDS]

    async def get(obj: Obj) -> ChildView | None:
        try:
            found = await ctx.kube.get(
                obj["apiVersion"], obj["kind"], key[0], obj["metadata"]["name"]
            )
        except ApiError as exc:
            if exc.status == 404:
                return None  # the kind itself is not served
            raise _ReadRefused(f"{obj['kind']} {obj['metadata']['name']}", exc) from exc
        return None if found is None else ChildView.from_object(found)

    views = await asyncio.gather(*(get(o) for o in wanted))
    found = {(v.kind, v.name): v for v in views if v is not None}
    # What is created now is there at the next look: count it as seen until the next resync.
    ctx.job(key).unwatched = (uid, time.monotonic(), _assume_created(found, wanted))
    return found


def _assume_created(
    found: dict[ChildKey, ChildView], wanted: list[Obj]
) -> dict[ChildKey, ChildView]:
    out = dict(found)
    for obj in wanted:
        out.setdefault((obj["kind"], obj["metadata"]["name"]), ChildView.from_object(obj))
    return out


# --- observe, act, write --------------------------------------------------------------------


async def _observe_jobset(
    ctx: Context, key: Key, spec: GSPOJobSpec, previous: Obj
) -> views.Observed:
    """The JobSet and pods from the indexes; rank 0's progress while it runs; a queued
    JobSet's Workload while Kueue may hold it (a running job's once, to see it admitted)."""
    ns, name = key
    js: views.JobSetView | None = None
    if ctx.watch_jobsets:
        found = ctx.indexed("jobsets", key)
        js = found[0][1] if found else None
    else:
        jobset = await ctx.kube.get(render.JOBSET_API, "JobSet", ns, names.jobset(name))
        js = None if jobset is None else views.JobSetView.from_jobset(jobset)
    pods = sorted(ctx.indexed("pods", key), key=lambda p: p.name)
    queued: dict[str, Any] = {}
    if js is not None and spec.run_policy.scheduling.queue:
        admitted = any(
            (c.get("type"), c.get("status"), c.get("reason")) == ("Queued", "False", "Admitted")
            for c in previous.get("conditions") or []
        )
        if js.suspended or spec.run_policy.suspend or not admitted:
            queued = await _observe_workload(ctx, ns, js.uid)
    if js is not None and not js.suspended:
        queued["rollout_failed_create"] = await _rollout_failed_create(ctx, ns, name, spec, pods)
    observed = views.Observed(jobset=js, pods=pods, **queued)
    learners = observed.learners(js.restarts if js else 0)
    rank0 = next((p for p in learners if p.index == 0), None)
    if rank0 is not None and rank0.phase == "Running" and rank0.ip:
        progress = await fetch_progress(ctx.session(), rank0.ip, spec.metrics.port)
        observed = views.Observed(jobset=js, pods=pods, progress=progress, **queued)
    elif js is not None and _starting(js, learners):
        claim = await _observe_claim(ctx, ns, render.checkpoint_claim_name(name, spec))
        refused = ""
        if len(learners) < spec.learner.replicas:
            job = names.child_job(name, names.LEARNER, 0)
            refused = views.failed_create(job, await ctx.kube.events_of(ns, "Job", job))
        observed = views.Observed(
            jobset=js, pods=pods, claim=claim, failed_create=refused, **queued
        )
    return observed


async def _rollout_failed_create(
    ctx: Context, ns: str, name: str, spec: GSPOJobSpec, pods: list[views.PodView]
) -> str:
    """Why rollout servers have no pod, in the Job controller's words: one list of the
    namespace's FailedCreate Events, read only while some server's Job has no pod, and quoted
    only for those Jobs (a refusal a Job got over since stays out)."""
    have = {p.job for p in pods if p.role == names.ROLLOUT and not p.deleting}
    jobs = [names.child_job(name, names.ROLLOUT, i) for i in range(spec.rollout.replicas)]
    if not (missing := [j for j in jobs if j not in have]):
        return ""
    events = await ctx.kube.events_by_reason(ns, "Job", "FailedCreate")
    return views.failed_creates(missing, events)


async def _observe_workload(ctx: Context, ns: str, jobset_uid: str) -> dict[str, Any]:
    """Kueue's Workload for a queued JobSet (found by the job-uid label Kueue puts on it):
    `kueue` False when the cluster serves no Workload API (no Kueue: the JobSet's suspend
    is the operator's), the error when this operator may not read Workloads."""
    if time.monotonic() < ctx.workloads_unserved_until:
        return {"kueue": False}
    selector = f"{names.KUEUE_JOB_UID_LABEL}={jobset_uid}"
    try:
        found = await ctx.kube.list(names.KUEUE_API, "Workload", ns, selector)
    except ApiError as exc:
        if exc.status == 404:
            ctx.workloads_unserved_until = time.monotonic() + ctx.resync_s
            ctx.note_once("Kueue's Workload API is not served: queue labels do nothing here")
            return {"kueue": False}
        if exc.status != 403:
            raise
        message = (
            f"cannot read Kueue's Workloads ({exc.message}); grant the operator list and "
            "patch on workloads.kueue.x-k8s.io (the chart's Role does)"
        )
        ctx.note_once(message)
        return {"kueue": True, "workload_error": message}
    workload = views.WorkloadView.from_workload(found[0]) if found else None
    return {"kueue": True, "workload": workload}


def _starting(js: views.JobSetView, learners: list[views.PodView]) -> bool:
    """The JobSet runs but no learner pod does yet: its claim may be what holds it."""
    finished = js.true("Completed") or js.true("Failed")
    return not (js.suspended or finished or any(p.phase == "Running" for p in learners))


async def _observe_claim(ctx: Context, ns: str, name: str) -> views.ClaimView | None:
    """The checkpoint claim and its Events, read while no learner pod runs (a claim that
    never binds keeps every pod Pending; its Events say why)."""
    claim = await ctx.kube.get("v1", "PersistentVolumeClaim", ns, name)
    if claim is None or (claim.get("status") or {}).get("phase") == "Bound":
        return None
    events = await ctx.kube.events_of(ns, "PersistentVolumeClaim", name)
    return views.ClaimView.from_claim(claim, events)


async def _act(
    ctx: Context, key: Key, uid: str, out: status.Outcome, observed: views.Observed | None
) -> status.Refusal | None:
    """Suspend, resume and delete what `out` asks for; every call tolerates a repeat. A
    refusal an admin must clear (RBAC, a webhook), for the status."""
    ns, name = key
    jobset = names.jobset(name)
    doing = ""
    try:
        if out.suspend_jobset is not None:
            verb = "suspend" if out.suspend_jobset else "resume"
            doing = f"{verb} JobSet {jobset} (patch its spec.suspend)"
            patch = {"spec": {"suspend": out.suspend_jobset}}
            await ctx.kube.patch(render.JOBSET_API, "JobSet", ns, jobset, patch)
            log.info("%sd JobSet %s in %s", verb.capitalize(), jobset, ns)
        wl = observed.workload if observed is not None else None
        if out.activate_workload is not None and wl is not None:
            workload = wl.name
            verb = "activate" if out.activate_workload else "deactivate"
            doing = f"{verb} Kueue's Workload {workload} (patch its spec.active)"
            patch = {"spec": {"active": out.activate_workload}}
            await ctx.kube.patch(names.KUEUE_API, "Workload", ns, workload, patch)
            log.info("%sd Workload %s in %s", verb.capitalize(), workload, ns)
        doing = ""  # the deletes come with a finished job: its phase stays; the log says
        if out.delete_jobset and await ctx.kube.delete(render.JOBSET_API, "JobSet", ns, jobset):
            log.info("Deleted JobSet %s in %s", jobset, ns)
        if out.delete_job:
            await ctx.kube.delete(JOB_API, "GSPOJob", ns, name)
            ctx.deleted.add(uid)
            log.info("Deleted GSPOJob %s in %s: ttlSecondsAfterFinished passed", name, ns)
    except ApiError as exc:
        if not doing or exc.status in (404, 409) or api_errors.classify(exc.status) == "transient":
            raise  # gone since it was read, throttled, unavailable: back off, look again
        reason = "Forbidden" if exc.status == 403 else "Invalid"
        return status.Refusal(
            "blocked", reason, f"the API server refused to {doing}: {exc.message}"
        )
    return None


async def _write(
    ctx: Context,
    key: Key,
    body: Obj,
    original: Obj,
    new: Obj,
    events: list[status.Event],
    *,
    force: bool = False,
) -> None:
    """Post the Events; patch the status if it changed, progress alone at most so often."""
    for event in events:
        ctx.post(body, event)
        log.info("%s/%s %s: %s", *key, event.reason, event.message)
    if new == original:
        return
    memory = ctx.job(key)
    last = memory.last_write
    if (
        not force
        and _shape(new) == _shape(original)
        and last is not None
        and time.monotonic() - last < progress_write_interval_s(ctx)
    ):
        return  # progress only, written recently: the next poll after the window writes it
    done = await ctx.kube.patch(
        JOB_API, "GSPOJob", key[0], key[1], {"status": _diff(original, new)}, subresource="status"
    )
    memory.last_write = time.monotonic()
    before = body["metadata"].get("resourceVersion")
    if before and done.get("metadata", {}).get("resourceVersion") != before:
        memory.own_write = (before, time.monotonic() + OWN_WRITE_WAIT_S)


def progress_write_interval_s(ctx: Context) -> float:
    """Seconds between progress-only status writes of one job: the budget shared by every
    job that is not finished, never more often than progress_write_s."""
    if ctx.progress_writes_per_minute <= 0:
        return ctx.progress_write_s
    active = sum(phase not in status.TERMINAL for phase in ctx.phases())
    return max(ctx.progress_write_s, 60.0 * active / ctx.progress_writes_per_minute)


def _shape(st: Mapping[str, Any]) -> tuple[Any, ...]:
    """A status without its progress: two statuses of equal shape differ in progress only."""
    rest = {k: v for k, v in st.items() if k not in (*PROGRESS_FIELDS, "conditions")}
    conditions = sorted(
        (
            c["type"],
            c["status"],
            c.get("reason"),
            "" if c["type"] in PROGRESS_CONDITIONS else c.get("message"),
        )
        for c in st.get("conditions") or []
    )
    return (sorted(rest.items(), key=lambda kv: kv[0]).__repr__(), conditions)


def _next_look(
    ctx: Context,
    key: Key,
    spec: GSPOJobSpec,
    st: Mapping[str, Any],
    observed: views.Observed,
    now: datetime,
) -> float | None:
    """When this job needs a look without any event: never, once it is finished for good."""
    waits: list[float] = []
    policy = spec.run_policy
    if st.get("phase") in status.TERMINAL:
        done = st.get("completionTime")
        if policy.ttl_seconds_after_finished is not None and done:
            due = status.parse_time(done).timestamp() + policy.ttl_seconds_after_finished
            waits.append(max(due - now.timestamp(), 0.0) + 0.5)
        return min(waits) if waits else None
    if any(
        p.phase == "Running"
        for p in observed.learners(observed.jobset.restarts if observed.jobset else 0)
    ):
        waits.append(ctx.interval_s)
    if not ctx.watch_jobsets:
        waits.append(ctx.interval_s)
    if observed.kueue and observed.jobset is not None and observed.jobset.suspended:
        waits.append(ctx.interval_s)  # Kueue's Workload is not watched: read it again
    deadline = policy.active_deadline_seconds
    if deadline is not None and st.get("startTime") and not policy.suspend:
        due = status.parse_time(st["startTime"]).timestamp() + deadline
        waits.append(max(due - now.timestamp(), 0.0) + 0.5)
    waits.append(ctx.resync_s)
    return min(waits)


def _record(ctx: Context, key: Key, previous: Obj, out: status.Outcome, spec: GSPOJobSpec) -> None:
    new, phase = out.status, out.phase
    ctx.job(key).phase = phase
    ready = int(str(new.get("rolloutReady") or "0/0").split("/")[0])
    ctx.metrics.set_job(*key, phase, ready, spec.rollout.replicas, int(new.get("step") or 0))
    ctx.metrics.count_phases(ctx.phases())
    gained = int(new.get("restarts") or 0) - int(previous.get("restarts") or 0)
    if gained > 0:
        ctx.metrics.learner_restarts.labels(*key).inc(gained)


# --- the spec in effect ---------------------------------------------------------------------


def _spec_in_config_map(ctx: Context, key: Key, uid: str) -> GSPOJobSpec | None:
    """The spec the job runs: the one its ConfigMap holds (written when it was accepted). Not
    the ConfigMap of an earlier job of this name the garbage collector has not deleted yet."""
    for view in ctx.indexed("children", key):
        if (view.kind, view.name, view.controller_uid) == (
            "ConfigMap",
            names.config_map(key[1]),
            uid,
        ):
            data = view.fields.get("data") or {}
            try:
                return parse_spec(yaml.safe_load(data[ports.CONFIG_FILE])["spec"])
            except (KeyError, TypeError, yaml.YAMLError, SpecError):
                return None
    return None


def _effective(accepted: GSPOJobSpec, new: GSPOJobSpec) -> tuple[GSPOJobSpec, list[str]]:
    """The accepted spec with the in-flight-changeable fields taken from `new`."""
    refused = status.refused_fields(accepted, new)
    if not refused:
        return new, []
    merged = accepted.to_manifest_dict()
    current = new.to_manifest_dict()
    for dotted in status.MUTABLE_FIELDS:
        section, key = dotted.split(".")
        merged[section][key] = current[section][key]
    try:
        return parse_spec(merged), refused
    except SpecError:
        return accepted, refused


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> Obj:
    """A merge patch from `old` to `new` (top-level status keys)."""
    out = {k: v for k, v in new.items() if old.get(k) != v}
    out.update({k: None for k in old if k not in new})
    return out
