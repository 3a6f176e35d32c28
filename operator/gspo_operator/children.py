"""A job's children as the API server holds them, against what `render` wants. Pure.

`plan_children` decides, per child, whether to create it (missing), repair it (a field the
operator sets was changed by hand) or refuse it (an object of that name is controlled by
something else: it is never adopted). Only the fields the operator sets are compared, so
what the API server fills in (a Service's clusterIP, defaults) never counts as a change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gspo_operator.names import JOB_UID_ANNOTATION

Obj = dict[str, Any]
ChildKey = tuple[str, str]  # (kind, name)

# The fields the operator owns beside labels and ownerReferences, per kind. A Secret's token
# is random and never re-rendered; a claim's and a JobSet's spec are immutable once created
# (the JobSet's suspend is set by the reconcile itself): those are only re-created if deleted.
OWNED_FIELDS: dict[str, tuple[str, ...]] = {
    "ConfigMap": ("data",),
    "Service": ("spec",),
    "NetworkPolicy": ("spec",),
    "PodMonitor": ("spec",),
}


@dataclass(frozen=True)
class ChildView:
    """One existing child: who controls it and the fields the operator would compare."""

    kind: str
    name: str
    controller_uid: str | None
    fields: Obj = field(default_factory=dict)  # metadata.labels plus the kind's owned fields
    controller: tuple[str, str] | None = None  # the controller's (kind, name), when it has one

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ChildView:
        meta = obj.get("metadata") or {}
        controller = next(
            (o for o in meta.get("ownerReferences") or [] if o.get("controller")), None
        )
        if controller is None and (uid := (meta.get("annotations") or {}).get(JOB_UID_ANNOTATION)):
            controller = {"uid": uid}  # kept without an owner (a retained claim): whose it is
        fields: Obj = {"labels": dict(meta.get("labels") or {})}
        for name in OWNED_FIELDS.get(obj.get("kind", ""), ()):
            fields[name] = obj.get(name)
        return cls(
            kind=obj.get("kind", ""),
            name=meta.get("name", ""),
            controller_uid=controller.get("uid") if controller else None,
            fields=fields,
            controller=(controller["kind"], controller["name"])
            if controller and "kind" in controller and "name" in controller
            else None,
        )


@dataclass
class Plan:
    create: list[Obj] = field(default_factory=list)
    repair: list[tuple[Obj, Obj]] = field(default_factory=list)  # (desired, merge patch)
    foreign: list[str] = field(default_factory=list)  # "Kind name" controlled by another owner


def contains(want: Any, have: Any) -> bool:
    """Whether `have` holds everything `want` says: dicts key by key (extra keys in `have` are
    the API server's defaults), lists element by element, scalars equal."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(contains(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(contains(w, h) for w, h in zip(want, have, strict=True))
        )
    return bool(want == have)


def repair_patch(desired: Mapping[str, Any], view: ChildView) -> Obj | None:
    """A merge patch putting back what the operator set, or None when nothing drifted."""
    patch: Obj = {}
    labels = desired["metadata"].get("labels") or {}
    if not contains(labels, view.fields.get("labels")):
        patch["metadata"] = {"labels": labels}
    for name in OWNED_FIELDS.get(desired["kind"], ()):
        want, have = desired.get(name), view.fields.get(name)
        if name == "data" and want != have:  # a ConfigMap's data is all the operator's
            patch[name] = {**{k: None for k in have or {}}, **(want or {})}
        elif name in desired and not contains(want, have):
            patch[name] = want
    annotations = desired["metadata"].get("annotations")
    if "data" in patch and annotations:  # the ConfigMap's spec hash goes with its data
        patch.setdefault("metadata", {})["annotations"] = annotations
    return patch or None


def plan_children(desired: list[Obj], observed: Mapping[ChildKey, ChildView], job_uid: str) -> Plan:
    """What to do so that every desired child exists, is this job's and is as rendered."""
    plan = Plan()
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        view = observed.get(key)
        if view is None:
            plan.create.append(obj)
        elif view.controller_uid != job_uid:
            plan.foreign.append(f"{key[0]} {key[1]}")
        elif (patch := repair_patch(obj, view)) is not None:
            plan.repair.append((obj, patch))
    return plan
