"""kopf handlers: validate, render, create; then a timer that observes and applies `status`.

Each handler is a few lines over the pure modules: `manifest.check_job` validates,
`render.render_job` builds the children, `status.compute` decides, `kube` talks to the API.
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
from gspo_operator.kube import JOB_API, Kube
from gspo_operator.manifest import check_job
from gspo_operator.metrics import OperatorMetrics
from gspo_operator.progress import fetch_progress
from gspo_trainer import ports
from gspo_trainer.config import API_GROUP, API_VERSION, GSPOJobSpec
from gspo_trainer.validation import SpecError, parse_spec

DEFAULT_INTERVAL_S = 10.0


@dataclass
class Context:
    """What the handlers share: the API adapter, metrics, and each job's last phase."""

    kube: Kube
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    interval_s: float = DEFAULT_INTERVAL_S
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession()
        return self.http


def _now() -> datetime:
    return datetime.now(UTC)


def _post(body: Any, event: status.Event) -> None:
    kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _desired(body: Any, spec: GSPOJobSpec, st: Any) -> list[dict[str, Any]]:
    """Children to create now: no learner pods while suspended or finished."""
    restarts = int(st.get("restarts") or 0)
    objs = render.render_job(body, spec, token=secrets.token_urlsafe(32), restart=restarts)
    if spec.run_policy.suspend or st.get("phase") in status.TERMINAL:
        objs = [o for o in objs if o["kind"] != "Pod"]
        for o in objs:
            if o["kind"] == "Deployment":
                o["spec"]["replicas"] = 0
    return objs


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
            spec, problems = check_job(body)
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
            spec, _problems = check_job(body)
            previous = dict(body.get("status") or {})
            if spec is not None and _rejected_at_creation(previous):
                # The manifest was fixed after an InvalidSpec failure: start it now.
                await _create_children(ctx, body, spec, [], memo, patch, logger)
                return
            if spec is None or "Created" not in _true(previous):
                return  # invalid (nothing was created), or the create handler is not done
            accepted = await _accepted_spec(ctx, memo, namespace, name)
            if accepted is None:
                return
            spec, refused = _effective(accepted, spec)
            await _apply_spec_change(ctx, body, memo, accepted, spec, refused, previous, patch)
            observed = await _observe(ctx, spec, namespace, name)
            outcome = status.compute(spec, observed, previous, _now(), meta.get("generation"))
            await _act(ctx, body, spec, observed, outcome, logger)
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
    made = await ctx.kube.create_all(desired)
    for what in made:
        logger.info("Created %s", what)
    memo.accepted = spec
    if made:
        _post(body, status.Event("Normal", "Created", f"Created {len(made)} objects"))
    if "Created" in _true(original) and not refused:
        # Resumed after a restart: the status belongs to the timer, which may have moved on
        # since `body` was read; a patch from this stale copy would undo its conditions.
        return
    new_status = status.created(st, _now(), len(desired))
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
    cm = render.render_job(body, spec, token="")[0]
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
    """Two API requests: the learner pods and the rollout Deployment; then rank 0's progress."""
    pods = await ctx.kube.list("v1", "Pod", namespace, names.label_selector(name, names.LEARNER))
    views = [status.PodView.from_pod(p) for p in pods]
    dep = await ctx.kube.get("apps/v1", "Deployment", namespace, names.rollout_deployment(name))
    rank0 = next((v for v in views if v.name == names.learner_pod(name, 0)), None)
    progress = None
    if rank0 is not None and rank0.phase == "Running" and rank0.ip:
        progress = await fetch_progress(ctx.session(), rank0.ip, spec.metrics.port)
    return status.Observed(
        learner_pods=views,
        rollout_ready=int(((dep or {}).get("status") or {}).get("readyReplicas") or 0),
        rollout_replicas=None if dep is None else dep["spec"].get("replicas"),
        progress=progress,
    )


async def _act(
    ctx: Context,
    body: Any,
    spec: GSPOJobSpec,
    observed: status.Observed,
    out: status.Outcome,
    logger: Any,
) -> None:
    """Delete, create and scale what `out` asks for; every call tolerates a repeat."""
    kube = ctx.kube
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for pod in out.delete_pods:
        if await kube.delete("v1", "Pod", ns, pod):
            logger.info("Deleted Pod %s", pod)
    if out.ensure_children:
        restarts = int(out.status.get("restarts") or 0)
        have = {v.name for v in observed.learner_pods}
        missing = [
            o
            for o in render.render_job(body, spec, token="", restart=restarts)
            if (o["kind"] == "Pod" and o["metadata"]["name"] not in have)
            or (o["kind"] == "Deployment" and observed.rollout_replicas is None)
        ]
        for what in await kube.create_all(missing):
            logger.info("Created %s", what)
    if out.rollout_replicas is not None and observed.rollout_replicas not in (
        None,
        out.rollout_replicas,
    ):
        dep = names.rollout_deployment(name)
        await kube.patch(
            "apps/v1", "Deployment", ns, dep, {"spec": {"replicas": out.rollout_replicas}}
        )
        logger.info("Scaled Deployment %s to %d", dep, out.rollout_replicas)
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
