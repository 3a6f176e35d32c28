"""A Kubernetes API server stand-in for the operator tests: kmock with its gaps closed.

kmock 0.8 serves discovery and errors well, but its object store sets no uid,
resourceVersion, generation or creationTimestamp, lists with resourceVersion '...', replays
every object as ADDED on each watch whatever ?resourceVersion says, names the core group
"/v1" in discovery and has no PUT, status subresource semantics, field/label selectors,
garbage collection or server-side Table printing. `ApiServer` keeps kmock's HTTP server,
request parsing and discovery, and replaces the store with one that does those things the
way kube-apiserver does (merge patches, no strategic-merge list semantics).

Optimistic concurrency, as kube-apiserver does it for a replace: a PUT whose
metadata.resourceVersion is not the stored one is refused with 409 Conflict (reason Conflict);
a PUT without one is unconditional. Merge and JSON patches carry no precondition here.
coordination.k8s.io/v1 Leases are served, so two operator replicas can elect a leader
(gspo_operator.leader) against this stand-in.

Watches lag as kube-apiserver's can: its watch cache (staging/src/k8s.io/apiserver/pkg/
storage/cacher/cacher.go, v1.31) sends each watcher the events in order but with no bound on
the delay after the write that made them, so a client may read its own write's answer long
before its watch shows it (why client-go's controllers keep "expectations"). `lagging(plural)`
holds every watch of one resource until the block ends, then sends what was held, in order.
Not modelled: the cache's bookmarks and its "too old resource version" (410) answers.

Custom resources are admitted as kube-apiserver admits them, by the stored CRD's schema: every
write (create, PUT, PATCH, /status too) is pruned of the fields the schema does not declare,
under the request's `fieldValidation` (Strict: 400 naming each unknown field; Warn, the
default: a Warning header each; Ignore: silently), gets the schema's defaults and is validated
against it (types, enums, required, bounds); a write of the main resource must also pass the
x-kubernetes-validations CEL rules (oldSelf: the stored object); else 422 Invalid with
kube-apiserver's Status and causes (schema_admission.py and cel_admission.py say what they
model, from which source, and what not). Replace the stored CRD (`add`) to model a cluster
whose CRD predates the rules. `add` itself admits nothing: it stores what a test hands it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp.web
import attrs
import cel_admission
import kmock
import multidict
from kmock._internal import rendering

from gspo_api.spec import API_GROUP, API_VERSION, KIND
from gspo_operator.crd import PLURAL, PRINTER_COLUMNS, SHORT_NAMES, render_crd

Obj = dict[str, Any]
Key = tuple[str, str, str]  # group, version, plural

# (group, version, plural, kind, namespaced, status subresource, short names)
RESOURCES = [
    ("", "v1", "namespaces", "Namespace", False, True, ["ns"]),
    ("", "v1", "pods", "Pod", True, True, ["po"]),
    ("", "v1", "services", "Service", True, True, ["svc"]),
    ("", "v1", "configmaps", "ConfigMap", True, False, ["cm"]),
    ("", "v1", "secrets", "Secret", True, False, []),
    ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, True, ["pvc"]),
    ("", "v1", "events", "Event", True, False, ["ev"]),
    ("apps", "v1", "deployments", "Deployment", True, True, ["deploy"]),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, False, ["netpol"]),
    ("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor", True, False, []),
    ("events.k8s.io", "v1", "events", "Event", True, False, []),
    ("coordination.k8s.io", "v1", "leases", "Lease", True, False, []),
    (
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        True,
        ["crd"],
    ),
    (API_GROUP, API_VERSION, PLURAL, KIND, True, True, SHORT_NAMES),
]
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 JSON patch (add, remove, replace, test); 422 when a test fails."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        leaf = parts[-1]
        index = (len(parent) if leaf == "-" else int(leaf)) if isinstance(parent, list) else leaf
        kind = op["op"]
        if kind == "test":
            have = parent[index] if isinstance(parent, list) else parent.get(leaf)
            if have != op.get("value"):
                raise kmock.KubernetesError(status=422, reason="Invalid", message="test failed")
        elif kind == "remove":
            del parent[index]
        elif kind == "add" and isinstance(parent, list):
            parent.insert(index, op["value"])
        elif kind in ("add", "replace"):
            parent[index] = op["value"]
        else:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"op {kind}")
    return doc


def _dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


_SET_TERM = re.compile(r"\s*([^\s,!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*")


def _label_terms(selector: str) -> list[tuple[str, str, set[str]]]:
    """Kubernetes label selector syntax (apimachinery labels.Parse): `k`, `!k`, `k=v`, `k==v`,
    `k!=v`, `k in (a,b)`, `k notin (a,b)`, joined by commas."""
    terms, rest = [], selector
    while rest.strip():
        match = _SET_TERM.match(rest)
        if match:
            values = {v.strip() for v in match.group(3).split(",") if v.strip()}
            terms.append((match.group(1), match.group(2), values))
            rest = rest[match.end() :].lstrip(",")
            continue
        term, _, rest = rest.partition(",")
        term = term.strip()
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), "notin", {value.strip()}))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append((key.strip(), "in", {value.strip()}))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "absent", set()))
        else:
            terms.append((term, "exists", set()))
    return terms


def _selected(obj: Obj, labels: str | None, fields: str | None) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    for key, op, values in _label_terms(labels or ""):
        if op == "exists" and key not in have:
            return False
        if op == "absent" and key in have:
            return False
        if op == "in" and have.get(key) not in values:
            return False
        if op == "notin" and key in have and have[key] in values:
            return False
    for term in filter(None, (fields or "").split(",")):
        key, _, value = term.partition("=")
        if str(_dig(obj, key.rstrip("!")) or "") != value.lstrip("="):
            return False
    return True


def _age(stamp: str) -> str:
    then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    s = int((dt.datetime.now(dt.UTC) - then).total_seconds())
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def _controllers(obj: Obj) -> list[str]:
    return [
        r["uid"]
        for r in obj.get("metadata", {}).get("ownerReferences") or []
        if r.get("controller") and r.get("uid")
    ]


class Store(dict[tuple[Key, str, str], Obj]):
    """The objects by (resource, namespace, name), also indexed by resource and by controller
    owner uid, as informers' indexers do: a controller stand-in reading one Job's pods or one
    kind must not scan every object of the cluster (at 200 jobs that scan was quadratic)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[Key, dict[tuple[Key, str, str], Obj]] = {}
        self.by_owner: dict[str, dict[tuple[Key, str, str], Obj]] = {}

    def __setitem__(self, k: tuple[Key, str, str], v: Obj) -> None:
        if k in self:
            self._unindex(k, dict.__getitem__(self, k))
        super().__setitem__(k, v)
        self.by_key.setdefault(k[0], {})[k] = v
        for uid in _controllers(v):
            self.by_owner.setdefault(uid, {})[k] = v

    def __delitem__(self, k: tuple[Key, str, str]) -> None:
        self._unindex(k, dict.__getitem__(self, k))
        super().__delitem__(k)

    def _unindex(self, k: tuple[Key, str, str], v: Obj) -> None:
        self.by_key.get(k[0], {}).pop(k, None)
        for uid in _controllers(v):
            self.by_owner.get(uid, {}).pop(k, None)


@attrs.define
class Fault:
    """An error answer a test makes the API server give, `times` times, to requests of one verb
    on one resource (plural), or on one object of it by `name`, the way kube-apiserver words
    it: a Status body with the code, reason and message, and Retry-After on 429 as its
    priority-and-fairness filter sends it."""

    method: str  # POST, GET, PATCH, PUT, DELETE
    plural: str
    status: int
    reason: str
    message: str
    times: int = 1_000_000
    retry_after_s: int | None = None
    name: str | None = None  # only requests naming this object (RBAC's resourceNames)

    def response(self) -> aiohttp.web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.status,
        }
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return aiohttp.web.json_response(body, status=self.status, headers=headers)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    objects: Store = attrs.field(factory=Store, init=False)
    history: list[tuple[int, Key, str, Obj]] = attrs.field(factory=list, init=False)
    served: int = attrs.field(default=0, init=False)  # resource requests answered
    base_url: str = attrs.field(default="", init=False)  # set once an HTTP server serves it
    _rv: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    # Set, and replaced by a fresh one, at every change: what watches wait on. (A Condition
    # whose waiters are cancelled mid-reacquire can stay locked on Python 3.11, and then every
    # notifier queues behind it.)
    _changed: asyncio.Event | None = attrs.field(default=None, init=False)
    _kinds: dict[Key, tuple[str, bool, bool]] = attrs.field(factory=dict, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)  # tests add error answers
    _uids: set[str] = attrs.field(factory=set, init=False)  # seen uids (garbage collection)
    _lagging: set[str] = attrs.field(factory=set, init=False)  # plurals whose watches wait
    # Warning headers of the request being answered (admission runs without an await point
    # between the request's start and its answer, so one list serves every request in turn).
    _warnings: list[str] = attrs.field(factory=list, init=False)

    def served_resources(self) -> list[tuple[str, str, str, str, bool, bool, list[str]]]:
        """The kinds this API server serves (a subclass adds its own)."""
        return RESOURCES

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for group, version, plural, kind, namespaced, status, short in self.served_resources():
            self._kinds[(group, version, plural)] = (kind, namespaced, status)
            self.resources[f"{group}/{version}/{plural}" if group else f"v1/{plural}"] = (
                kmock.ResourceInfo(
                    kind=kind,
                    namespaced=namespaced,
                    singular=kind.lower(),
                    verbs=VERBS,
                    shortnames=short,
                    subresources=["status"] if status else [],
                )
            )
        self.add(render_crd())
        self.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}})

    # --- discovery fix: the core group's version is "v1", not "/v1" ---------------------------

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":
            payload["groupVersion"] = "v1"
        for entry in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in entry["name"]:  # subresources carry no short names (kubectl warns)
                entry.update(shortNames=[], categories=[], singularName="")
        return payload

    # --- direct access for tests ----------------------------------------------------------------

    def add(self, obj: Obj) -> Obj:
        """Store `obj` as if created through the API (no event loop needed)."""
        key = self._key_of(obj)
        return self._store_new(key, obj.get("metadata", {}).get("namespace", ""), obj)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        for key in self._keys_of(kind):
            obj = self.objects.get((key, namespace or "", name))
            if obj is not None:
                return obj
        return None

    def list_kind(self, kind: str, namespace: str | None = None) -> list[Obj]:
        return [
            o
            for key in self._keys_of(kind)
            for (_, ns, _), o in self.objects.by_key.get(key, {}).items()
            if namespace is None or ns == namespace
        ]

    def owned(self, uid: str, kind: str | None = None) -> list[Obj]:
        """Objects whose controller ownerReference is `uid` (of `kind`, if given)."""
        found = self.objects.by_owner.get(uid, {})
        return [
            o for (key, _, _), o in found.items() if kind is None or self._kinds[key][0] == kind
        ]

    def _keys_of(self, kind: str) -> list[Key]:
        return [key for key, (k, _, _) in self._kinds.items() if k == kind]

    async def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        """What a kubelet or a controller does: merge into an object's status."""
        obj = self.get(kind, namespace, name)
        assert obj is not None, f"{kind} {namespace}/{name} does not exist"
        key = self._key_of(obj)
        return await self._update(key, namespace, name, {"status": status}, "status")

    def _key_of(self, obj: Obj) -> Key:
        group, _, version = obj["apiVersion"].rpartition("/")
        for key, (kind, _, _) in self._kinds.items():
            if key[0] == group and key[1] == version and kind == obj["kind"]:
                return key
        raise KeyError(f"unknown kind {obj['apiVersion']} {obj['kind']}")

    @contextlib.asynccontextmanager
    async def lagging(self, plural: str) -> AsyncIterator[None]:
        """Every watch of `plural` shows nothing new until the block ends, then all it held."""
        self._lagging.add(plural)
        try:
            yield
        finally:
            self._lagging.discard(plural)
            if self._changed is not None:
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()

    # --- the store ----------------------------------------------------------------------------

    def _next_rv(self) -> str:
        return str(next(self._rv))

    def _emit(self, key: Key, type_: str, obj: Obj) -> None:
        self.history.append((int(obj["metadata"]["resourceVersion"]), key, type_, obj))
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def _store_new(self, key: Key, namespace: str, body: Obj) -> Obj:
        kind, namespaced, _ = self._kinds[key]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_rv(),
            creationTimestamp=_now(),
            generation=1,
        )
        obj.setdefault("apiVersion", f"{key[0]}/{key[1]}" if key[0] else key[1])
        obj.setdefault("kind", kind)
        if kind == "Pod":
            obj.setdefault("status", {"phase": "Pending"})
        self.objects[(key, meta.get("namespace", ""), meta["name"])] = obj
        self._uids.add(meta["uid"])
        self._emit(key, "ADDED", obj)
        owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
        if owners and not any(self._uid_exists(uid) for uid in owners):
            # The garbage collector deletes a dependent whose every owner is gone.
            self._delete(key, meta.get("namespace", ""), meta["name"])
        return obj

    async def _update(
        self,
        key: Key,
        namespace: str,
        name: str,
        patch: Any,
        sub: str | None,
        replace: bool = False,
        params: Any = None,
    ) -> Obj:
        old = self.objects.get((key, namespace, name))
        if old is None:
            raise kmock.KubernetesObjectNotFoundError()
        has_status = self._kinds[key][2]
        if isinstance(patch, list):
            new = json_patch(old, patch)
        elif replace:
            expected = (patch.get("metadata") or {}).get("resourceVersion")
            if expected and expected != old["metadata"]["resourceVersion"]:
                resource = f"{key[2]}.{key[0]}" if key[0] else key[2]
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=f'Operation cannot be fulfilled on {resource} "{name}": the object'
                    " has been modified; please apply your changes to the latest version and"
                    " try again",
                )
            new = copy.deepcopy(patch)
            new["metadata"] = {
                **new.get("metadata", {}),
                **{k: old["metadata"][k] for k in ("uid", "creationTimestamp", "generation")},
            }
        else:
            new = merge_patch(old, patch)
        if has_status and sub == "status":
            new = {**old, "status": new.get("status")}
        elif has_status:
            new["status"] = old.get("status")
        if new.get("status") is None:
            new.pop("status", None)
        new["metadata"]["uid"] = old["metadata"]["uid"]
        new = self._admit(key, old, new, params, status=sub == "status", patch=not replace)
        strip = ("metadata", "status")
        if {k: v for k, v in new.items() if k not in strip} != {
            k: v for k, v in old.items() if k not in strip
        }:
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new == old:
            return old
        new["metadata"]["resourceVersion"] = self._next_rv()
        meta = new["metadata"]
        # kube-apiserver's Store.shouldDeleteDuringUpdate (staging/src/k8s.io/apiserver/pkg/
        # registry/generic/registry/store.go): an update deletes an object being deleted once
        # it has no finalizers left, unless its deletion is graceful (a pod's
        # deletionGracePeriodSeconds > 0): that one goes only when its final DELETE comes.
        graceful = bool(old["metadata"].get("deletionGracePeriodSeconds"))
        deleting = old["metadata"].get("deletionTimestamp")  # a patch cannot undo it
        if deleting:
            meta["deletionTimestamp"] = deleting
        if deleting and not meta.get("finalizers") and not graceful:
            self._remove(key, namespace, name, new)
            return new
        self.objects[(key, namespace, name)] = new
        self._emit(key, "MODIFIED", new)
        return new

    def _admit(
        self,
        key: Key,
        old: Obj | None,
        new: Obj,
        params: Any = None,
        status: bool = False,
        patch: bool = False,
    ) -> Obj:
        """A custom resource as its CRD admits it (pruned, defaulted), or the API server's
        400/422. The answer's Warning headers are kept in `_warnings` for `_handle`."""
        crds = self.list_kind("CustomResourceDefinition")
        admitted, said = cel_admission.admit(
            crds, key, old, new, params=params, status=status, patch=patch
        )
        self._warnings += said
        return admitted

    def _delete(self, key: Key, namespace: str, name: str, options: Obj | None = None) -> Obj:
        """DELETE with `options` (a DeleteOptions body; a subclass reads gracePeriodSeconds)."""
        obj = self.objects.get((key, namespace, name))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        if obj["metadata"].get("finalizers"):
            immediate = (options or {}).get("gracePeriodSeconds") == 0
            if not obj["metadata"].get("deletionTimestamp") or (
                immediate and obj["metadata"].get("deletionGracePeriodSeconds")
            ):
                # A DELETE with grace 0 of an object held by finalizers lowers its grace
                # period to 0: the update that clears the last finalizer then deletes it.
                obj = copy.deepcopy(obj)
                obj["metadata"].setdefault("deletionTimestamp", _now())
                if immediate:
                    obj["metadata"]["deletionGracePeriodSeconds"] = 0
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[(key, namespace, name)] = obj
                self._emit(key, "MODIFIED", obj)
            return obj
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._remove(key, namespace, name, gone)
        return gone

    def _uid_exists(self, uid: str | None) -> bool:
        return uid in self._uids

    def _remove(self, key: Key, namespace: str, name: str, last: Obj) -> None:
        del self.objects[(key, namespace, name)]
        self._uids.discard(last["metadata"]["uid"])
        self._emit(key, "DELETED", last)
        # The garbage collector: children owned by the deleted object go too (background).
        uid = last["metadata"]["uid"]
        for (ckey, cns, cname), child in list(self.objects.items()):
            owners = child["metadata"].get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners) and (ckey, cns, cname) in self.objects:
                self._delete(ckey, cns, cname)

    # --- HTTP -----------------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if self._changed is None:
            self._changed = asyncio.Event()
        if request.url.path.startswith("/openapi/v3"):
            return self._openapi_v3(request.url.path.removeprefix("/openapi/v3").strip("/"))
        res = request.resource
        key = None if res is None else (res.group or "", res.version or "", res.plural or "")
        if key not in self._kinds:
            return await super()._handle(request)
        self.served += 1
        method = request.method.value if request.method else "GET"
        for fault in self.faults:
            if (
                fault.times > 0
                and fault.method == method
                and fault.plural == key[2]
                and fault.name in (None, request.name)
            ):
                fault.times -= 1
                return fault.response()
        ns = request.namespace or ""
        params = request.params
        self._warnings = []
        if params.get("watch") in ("true", "1"):
            return await self._watch(request, key, ns)
        if request.name is None:
            if method == "GET":
                return self._list(request, key, ns)
            if method == "POST":
                body = request.data or {}
                name = body.get("metadata", {}).get("name")
                if name and (key, ns if self._kinds[key][1] else "", name) in self.objects:
                    raise kmock.KubernetesError(
                        status=409,
                        reason="AlreadyExists",
                        message=f'{key[2]} "{name}" already exists',
                    )
                body = self._admit(key, None, body, params)
                said = self._said()
                if params.get("dryRun"):
                    return aiohttp.web.json_response(body, status=201, headers=said)
                stored = self._store_new(key, ns, body)
                return aiohttp.web.json_response(stored, status=201, headers=said)
        else:
            scope = (key, ns if self._kinds[key][1] else "", request.name)
            if method == "GET":
                obj = self.objects.get(scope)
                if obj is None:
                    raise kmock.KubernetesError(
                        status=404,
                        reason="NotFound",
                        message=f'{key[2]} "{request.name}" not found',
                    )
                if "as=Table" in request.headers.get("Accept", ""):  # kubectl get KIND NAME
                    rv = obj["metadata"]["resourceVersion"]
                    return aiohttp.web.json_response(self._table(key, [obj], rv))
                return aiohttp.web.json_response(obj)
            if method in ("PATCH", "PUT"):
                if scope not in self.objects:
                    raise kmock.KubernetesError(
                        status=404,
                        reason="NotFound",
                        message=f'{key[2]} "{request.name}" not found',
                    )
                data = request.data
                obj = await self._update(
                    *scope, data or {}, request.subresource, method == "PUT", params
                )
                return aiohttp.web.json_response(obj, headers=self._said())
            if method == "DELETE":
                if scope not in self.objects:
                    raise kmock.KubernetesError(
                        status=404,
                        reason="NotFound",
                        message=f'{key[2]} "{request.name}" not found',
                    )
                return aiohttp.web.json_response(self._delete(*scope, request.data or None))
        raise kmock.KubernetesError(status=405, reason="MethodNotAllowed")

    def _openapi_v3(self, group_version: str) -> aiohttp.web.Response:
        """OpenAPI v3 discovery (`/openapi/v3`) and one document per group-version, holding
        what kubectl reads from them: each resource's PATCH operation, tagged with its
        x-kubernetes-group-version-kind, takes the `fieldValidation` query parameter; so
        kubectl's --validate=strict (its default) and =warn leave field validation to this
        server (kubectl's QueryParamVerifierV3) instead of needing OpenAPI v2 schemas. No
        schemas are served (components are empty): kubectl explain and client-side
        validation are not modelled."""
        served: dict[str, list[tuple[Key, str, bool]]] = {}
        for key, (kind, namespaced, _) in self._kinds.items():
            prefix = f"apis/{key[0]}/{key[1]}" if key[0] else f"api/{key[1]}"
            served.setdefault(prefix, []).append((key, kind, namespaced))
        if not group_version:
            paths = {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash=0"} for gv in served}
            return aiohttp.web.json_response({"paths": paths})
        if group_version not in served:
            raise kmock.KubernetesError(status=404, reason="NotFound", message="not found")
        paths = {}
        for key, kind, namespaced in served[group_version]:
            scope = "/namespaces/{namespace}" if namespaced else ""
            gvk = {"group": key[0], "version": key[1], "kind": kind}
            patch = {
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "OK"}},
            }
            paths[f"/{group_version}{scope}/{key[2]}/{{name}}"] = {"patch": patch}
        document = {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "unversioned"},
            "paths": paths,
            "components": {"schemas": {}},
        }
        return aiohttp.web.json_response(document)

    def _said(self) -> multidict.CIMultiDict[str] | None:
        """The Warning headers admission gave this request (one header per warning)."""
        if not self._warnings:
            return None
        return multidict.CIMultiDict(("Warning", w) for w in self._warnings)

    def _matching(self, key: Key, ns: str, params: Any) -> list[Obj]:
        return [
            o
            for (k, ons, _), o in self.objects.items()
            if k == key
            and (not ns or ons == ns)
            and _selected(o, params.get("labelSelector"), params.get("fieldSelector"))
        ]

    def _list(self, request: rendering.Request, key: Key, ns: str) -> aiohttp.web.Response:
        items = self._matching(key, ns, request.params)
        rv = str(self.history[-1][0] if self.history else 0)
        kind = self._kinds[key][0]
        if "as=Table" in request.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(key, items, rv))
        api_version = f"{key[0]}/{key[1]}" if key[0] else key[1]
        return aiohttp.web.json_response(
            {
                "apiVersion": api_version,
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": rv},
                "items": items,
            }
        )

    def _table(self, key: Key, items: Iterable[Obj], rv: str) -> Obj:
        """Server-side printing, as kubectl get asks for it (the CRD's printer columns)."""
        columns = [{"name": "Name", "type": "string", "jsonPath": ".metadata.name"}]
        if key[2] == PLURAL:
            columns += PRINTER_COLUMNS
        elif key[2] == "pods":
            columns += [
                {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ]
        else:
            columns += [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]

        def cell(obj: Obj, col: Obj) -> Any:
            value = _dig(obj, col["jsonPath"].lstrip("."))
            if col["type"] == "date" and value:
                return _age(value)
            return value

        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": rv},
            "columnDefinitions": [
                {
                    "name": c["name"],
                    "type": "string" if c["type"] == "date" else c["type"],
                    "format": "name" if c["name"] == "Name" else "",
                    "description": "",
                    "priority": 0,
                }
                for c in columns
            ],
            "rows": [
                {
                    "cells": [cell(o, c) for c in columns],
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": o["metadata"],
                    },
                }
                for o in items
            ],
        }

    async def _watch(
        self, request: rendering.Request, key: Key, ns: str
    ) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        params = request.params
        since = params.get("resourceVersion") or "0"
        timeout_s = float(params.get("timeoutSeconds") or 3600)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        name = request.name

        def wanted(obj: Obj) -> bool:
            meta = obj["metadata"]
            return (
                (not ns or meta.get("namespace") == ns)
                and (name is None or meta["name"] == name)
                and _selected(obj, params.get("labelSelector"), params.get("fieldSelector"))
            )

        async def send(type_: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

        if since == "0":  # "any": synthetic ADDED for what exists now, then changes
            cursor = self.history[-1][0] if self.history else 0
            for obj in self._matching(key, ns, params):
                if wanted(obj):
                    await send("ADDED", obj)
        else:
            cursor = int(since)
        assert self._changed is not None
        try:
            while loop.time() < deadline:
                changed = self._changed  # taken before the scan: a change after it sets this
                held = key[2] in self._lagging
                for rv, k, type_, obj in [] if held else self.history[self._index_after(cursor) :]:
                    cursor = rv
                    if k == key and wanted(obj):
                        await send(type_, obj)
                try:  # a second at a time, to see whether the client is still there
                    await asyncio.wait_for(changed.wait(), min(1.0, deadline - loop.time()))
                except TimeoutError:
                    # A client gone (a process killed): the watch ends, as kube-apiserver's
                    # does when its request's context is cancelled. Else its handler would
                    # wait out timeoutSeconds, and the server's shutdown wait for it 60 s.
                    if raw.transport is None or raw.transport.is_closing():
                        break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    def _index_after(self, rv: int) -> int:
        lo, hi = 0, len(self.history)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.history[mid][0] <= rv:
                lo = mid + 1
            else:
                hi = mid
        return lo
