"""kopf handlers: validate, render, create; then a timer that observes and applies `status`.

Each handler is a few lines over the pure modules: `manifest.check_job` validates,
`render.render_job` builds the children (one JobSet runs the pods), `status.compute` decides,
`kube` talks to the API. JobSet and the Job controller create, restart and stop the pods; the
operator only creates the JobSet, suspends or resumes it, and reports.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
import yaml

from gspo_operator import names, render, status
from gspo_operator.crd import PLURAL
from gspo_operator.kube import JOB_API, Created, Kube
from gspo_operator.manifest import ClusterPolicy, check_job
from gspo_operator.metrics import OperatorMetrics
from gspo_operator.progress import fetch_progress
from gspo_trainer import ports
from gspo_trainer.config import API_GROUP, API_VERSION, GSPOJobSpec
from gspo_trainer.validation import SpecError, parse_spec

DEFAULT_INTERVAL_S = 10.0
# Kinds a cluster may lack: the job runs without them, and the operator says so once.
OPTIONAL_KINDS = ("PodMonitor",)
JOBSET_MISSING = (
    "the cluster serves no jobset.x-k8s.io/v1alpha2 JobSet API, which runs this job's pods; "
    "install JobSet v0.10 or later (see the chart's README) and the job starts by itself"
)


@dataclass
class Context:
    """What the handlers share: the API adapter, metrics, and each job's last phase."""

    kube: Kube
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    interval_s: float = DEFAULT_INTERVAL_S
    policy: ClusterPolicy = field(default_factory=ClusterPolicy.from_env)
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    http: aiohttp.ClientSession | None = None
    noted: set[str] = field(default_factory=set)  # cluster-wide notes already logged

    def note_once(self, logger: Any, message: str) -> None:
        if message not in self.noted:
            self.noted.add(message)
            logger.warning(message)

    def session(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession()
        return self.http


def _now() -> datetime:
    return datetime.now(UTC)


def _post(body: Any, event: status.Event) -> None:
    kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _desired(body: Any, spec: GSPOJobSpec, st: Any) -> list[dict[str, Any]]:
    """Children to create now: no JobSet for a finished job."""
    objs = render.render_job(body, spec, token=secrets.token_urlsafe(32))
    if st.get("phase") in status.TERMINAL:
        objs = [o for o in objs if o["kind"] != "JobSet"]
    return objs


async def _create(ctx: Context, body: Any, objs: list[dict[str, Any]], logger: Any) -> Created:
    """Create what is missing; note kinds the cluster lacks instead of failing on them."""
    created = await ctx.kube.create_all(objs, optional_kinds=(*OPTIONAL_KINDS, "JobSet"))
    for what in created.made:
        logger.info("Created %s", what)
    for what in created.unserved:
        kind = what.split()[0]
        if kind == "JobSet":
            ctx.note_once(logger, JOBSET_MISSING)
        else:
            message = (
                f"{what} not created: the cluster does not serve the {kind} API (install the "
                f"Prometheus Operator, or set spec.metrics.podMonitor: false); the job runs "
                "without it"
            )
            ctx.note_once(logger, f"{kind} not served: the jobs run without it")
            _post(body, status.Event("Normal", f"{kind}Skipped", message))
    return created


async def _accepted_spec(ctx: Context, memo: Any, namespace: str, job: str) -> GSPOJobSpec | None:
    """The spec in effect: the one in the job's ConfigMap (cached in memo)."""
    cached = getattr(memo, "accepted", None)
    if cached is not None:
        return cached
    cm = await ctx.kube.get("v1", "ConfigMap", namespace, names.config_map(job))
    if cm is None:
        return None
    manifest = yaml.safe_load(cm["data"][ports.CONFIG_FILE])
    memo.accepted = parse_spec(manifest["spec"])
    return memo.accepted


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


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    """Add the GSPOJob handlers to `registry`."""
    resource = {"group": API_GROUP, "version": API_VERSION, "plural": PLURAL}

    @kopf.on.resume(**resource, registry=registry)
    @kopf.on.create(**resource, registry=registry)
    async def ensure(body, namespace, name, patch, memo, logger, reason, **_: Any) -> None:
        """Validate, then create every missing child (existing ones are left as they are)."""
        with ctx.metrics.reconcile():
            spec, problems = check_job(body, ctx.policy)
            if spec is None:
                new_status, event = status.invalid_spec(body.get("status"), _now(), problems)
                patch.status.update(new_status)
                _post(body, event)
                logger.warning("Invalid spec: %s", event.message)
                return
            # A new job has no spec in effect yet; a resumed one has it in its ConfigMap.
            fresh = reason == kopf.Reason.CREATE
            accepted = spec if fresh else await _accepted_spec(ctx, memo, namespace, name) or spec
            spec, refused = _effective(accepted, spec)
            await _create_children(ctx, body, spec, refused, memo, patch, logger)

    # A failed reconcile is retried at the next tick, not after kopf's default 60 s backoff.
    @kopf.timer(**resource, interval=ctx.interval_s, backoff=ctx.interval_s, registry=registry)
    async def reconcile(body, meta, namespace, name, patch, memo, logger, **_: Any) -> None:
        """Observe the children and the learner, then apply what `status.compute` decides."""
        with ctx.metrics.reconcile():
            spec, _problems = check_job(body, ctx.policy)
            previous = dict(body.get("status") or {})
            if spec is not None and _rejected_at_creation(previous):
                # The manifest was fixed after an InvalidSpec failure: start it now.
                await _create_children(ctx, body, spec, [], memo, patch, logger)
                return
            if spec is None or not _has(previous, "Created"):
                return  # invalid (nothing was created), or the create handler is not done
            accepted = await _accepted_spec(ctx, memo, namespace, name)
            if accepted is None:
                return
            spec, refused = _effective(accepted, spec)
            await _apply_spec_change(ctx, body, memo, accepted, spec, refused, previous, patch)
            observed = await _observe(ctx, spec, namespace, name)
            outcome = status.compute(spec, observed, previous, _now(), meta.get("generation"))
            await _act(ctx, body, spec, outcome, logger)
            for event in outcome.events:
                _post(body, event)
                logger.info("%s: %s", event.reason, event.message)
            original = dict(body.get("status") or {})
            if outcome.status != original:
                patch.status.update(_diff(original, outcome.status))
            _record(ctx, namespace, name, original, outcome.status, spec)

    @kopf.on.delete(**resource, registry=registry, optional=True)
    async def forget(namespace, name, **_: Any) -> None:
        """Children go with the job (ownerReferences); only the metrics remember it."""
        ctx.phases.pop((namespace, name), None)
        ctx.metrics.forget_job(namespace, name)
        ctx.metrics.count_phases(list(ctx.phases.values()))  # type: ignore[arg-type]


async def _create_children(
    ctx: Context,
    body: Any,
    spec: GSPOJobSpec,
    refused: list[str],
    memo: Any,
    patch: Any,
    logger: Any,
) -> None:
    original = dict(body.get("status") or {})
    st = original
    if _rejected_at_creation(original):
        st = status.accepted_change({"conditions": original.get("conditions")}, _now())
        st["conditions"] = [c for c in st["conditions"] if c["type"] == "InvalidSpec"]
    desired = _desired(body, spec, st)
    created = await _create(ctx, body, desired, logger)
    memo.accepted = spec
    if created.made:
        _post(body, status.Event("Normal", "Created", f"Created {len(created.made)} objects"))
    if "Created" in _true(original) and not refused:
        # Resumed after a restart: the status belongs to the timer, which may have moved on
        # since `body` was read; a patch from this stale copy would undo its conditions.
        return
    new_status = status.created(st, _now(), len(desired))
    if any(w.startswith("JobSet ") for w in created.unserved):
        new_status = status.jobset_missing(new_status, _now(), JOBSET_MISSING)
    if refused:
        new_status, event = status.refused_change(new_status, _now(), refused)
        _post(body, event)
    patch.status.update(_diff(original, new_status))


def _rejected_at_creation(st: dict[str, Any]) -> bool:
    """Failed for an invalid spec before any child existed."""
    return st.get("phase") == "Failed" and any(
        c["type"] == "InvalidSpec" and c.get("reason") == "InvalidSpec" and c["status"] == "True"
        for c in st.get("conditions") or []
    )


def _has(st: dict[str, Any], type_: str) -> bool:
    return any(c.get("type") == type_ for c in st.get("conditions") or [])


def _true(st: dict[str, Any]) -> set[str]:
    return {c["type"] for c in st.get("conditions") or [] if c.get("status") == "True"}


async def _apply_spec_change(
    ctx: Context,
    body: Any,
    memo: Any,
    accepted: GSPOJobSpec,
    spec: GSPOJobSpec,
    refused: list[str],
    previous: dict[str, Any],
    patch: Any,
) -> None:
    """Refuse what cannot change in flight; record what can in the ConfigMap."""
    if refused:
        if "InvalidSpec" not in _true(previous):
            new_status, event = status.refused_change(previous, _now(), refused)
            previous.update(new_status)
            _post(body, event)
        return
    if "InvalidSpec" in _true(previous):
        previous.update(status.accepted_change(previous, _now()))
    if spec == accepted:
        return
    cm = render.render_config_map_of(body, spec)
    meta = body["metadata"]
    await ctx.kube.patch(
        "v1",
        "ConfigMap",
        meta["namespace"],
        cm["metadata"]["name"],
        {"data": cm["data"], "metadata": {"annotations": cm["metadata"]["annotations"]}},
    )
    memo.accepted = spec


async def _observe(ctx: Context, spec: GSPOJobSpec, namespace: str, name: str) -> status.Observed:
    """Two API requests: the JobSet and the job's pods; then learner rank 0's progress."""
    jobset = await ctx.kube.get(render.JOBSET_API, "JobSet", namespace, names.jobset(name))
    pods = await ctx.kube.list("v1", "Pod", namespace, names.label_selector(name))
    views = [status.PodView.from_pod(p) for p in pods]
    js = None if jobset is None else status.JobSetView.from_jobset(jobset)
    observed = status.Observed(jobset=js, pods=views)
    rank0 = next((p for p in observed.learners(js.restarts if js else 0) if p.index == 0), None)
    if rank0 is not None and rank0.phase == "Running" and rank0.ip:
        progress = await fetch_progress(ctx.session(), rank0.ip, spec.metrics.port)
        observed = status.Observed(jobset=js, pods=views, progress=progress)
    return observed


async def _act(
    ctx: Context, body: Any, spec: GSPOJobSpec, out: status.Outcome, logger: Any
) -> None:
    """Create, suspend, resume and delete what `out` asks for; every call tolerates a repeat."""
    kube = ctx.kube
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    jobset = names.jobset(name)
    if out.ensure_children:
        created = await _create(ctx, body, render.render_job(body, spec, token=""), logger)
        if any(w.startswith("JobSet ") for w in created.unserved):
            out.status = status.jobset_missing(out.status, _now(), JOBSET_MISSING)
    if out.suspend_jobset is not None:
        await kube.patch(
            render.JOBSET_API, "JobSet", ns, jobset, {"spec": {"suspend": out.suspend_jobset}}
        )
        logger.info("%s JobSet %s", "Suspended" if out.suspend_jobset else "Resumed", jobset)
    if out.delete_jobset and await kube.delete(render.JOBSET_API, "JobSet", ns, jobset):
        logger.info("Deleted JobSet %s", jobset)
    if out.delete_job:
        await kube.delete(JOB_API, "GSPOJob", ns, name)
        logger.info("Deleted GSPOJob %s: ttlSecondsAfterFinished passed", name)


def _diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch from `old` to `new` (top-level status keys)."""
    out = {k: v for k, v in new.items() if old.get(k) != v}
    out.update({k: None for k in old if k not in new})
    return out


def _record(ctx: Context, ns: str, name: str, previous: dict, new: dict, spec: GSPOJobSpec) -> None:
    phase = new.get("phase") or "Pending"
    ctx.phases[(ns, name)] = phase
    ready = int(str(new.get("rolloutReady") or "0/0").split("/")[0])
    ctx.metrics.set_job(ns, name, phase, ready, spec.rollout.replicas, int(new.get("step") or 0))
    ctx.metrics.count_phases(list(ctx.phases.values()))  # type: ignore[arg-type]
    gained = int(new.get("restarts") or 0) - int(previous.get("restarts") or 0)
    if gained > 0:
        ctx.metrics.learner_restarts.labels(ns, name).inc(gained)
