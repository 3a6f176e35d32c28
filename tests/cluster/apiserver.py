"""The API stand-in of the local cluster: kmock plus the kinds a JobSet cluster serves.

`ClusterApiServer` extends the operator tests' `ApiServer` (kmock with kube-apiserver's store
semantics) with what the local cluster needs beyond it:
- kinds: batch/v1 Jobs and jobset.x-k8s.io/v1alpha2 JobSets (status subresource on both);
- graceful pod deletion, as kube-apiserver does it: DELETE of a Pod sets
  `metadata.deletionTimestamp` and `deletionGracePeriodSeconds` (the DeleteOptions'
  gracePeriodSeconds, else the pod's `terminationGracePeriodSeconds`, else 30) and leaves the
  object in place, through updates too (kmock_apiserver: an update removes only an object
  whose deletion is not graceful); the kubelet stops the containers and then removes the pod
  with a grace period of 0 (`remove_pod`), which deletes it at once. A pod that no kubelet
  ever started (`spec.nodeName` unset) is removed at once, as kube-apiserver does for
  unscheduled pods.
- Secrets: `stringData` is merged into base64 `data` on create, as kube-apiserver does;
- JobSet's CRD (jobset_crd.py, from JobSet's published models), so JobSets are pruned,
  defaulted and validated as custom resources (kmock_apiserver.py: every write, the
  request's fieldValidation), before the admission hooks below;
- admission: `admit` hooks (the JobSet webhook, the API server's own pod checks) run on
  every create and may refuse it with a 422 (Invalid), or a 403 (Forbidden) when the message
  is a `Forbidden`, carrying their message;
- the Priority admission plugin (kubernetes plugin/pkg/admission/priority/admission.go, on by
  default): a pod naming a priorityClassName that is neither a system class
  (system-cluster-critical, system-node-critical) nor a stored scheduling.k8s.io/v1
  PriorityClass is refused 403 `pods "<name>" is forbidden: no PriorityClass with name <n> was
  found`, <name> being the generateName when the pod has one (apiserver pkg/admission/errors.go
  extractResourceName: names are generated after admission). Not modelled: spec.priority
  resolution, the global default class, preemptionPolicy.

Not modelled: resourceVersion preconditions on patches (a PUT's are, by ApiServer),
strategic-merge patches, server-side apply, finalizers on pods, field managers, quota.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
from collections.abc import Callable
from typing import Any

import attrs
import kmock
from jobset_crd import render_jobset_crd
from kmock_apiserver import RESOURCES, ApiServer, Key, Obj

CLUSTER_RESOURCES = [
    *RESOURCES,
    ("batch", "v1", "jobs", "Job", True, True, []),
    ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", True, True, ["js"]),
    # Storage (storage.StorageController provisions claims on these).
    ("storage.k8s.io", "v1", "storageclasses", "StorageClass", False, False, ["sc"]),
    ("", "v1", "persistentvolumes", "PersistentVolume", False, True, ["pv"]),
    ("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, False, ["pc"]),
]
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical", "system-node-critical"}
DEFAULT_GRACE_S = 30


class Forbidden(str):
    """An admission hook's message that refuses with 403 Forbidden instead of 422 Invalid."""


# An admission hook: the object being created -> None (admitted) or an error message.
Admit = Callable[[Obj], "str | None"]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ClusterApiServer(ApiServer):
    admission: list[Admit] = attrs.field(factory=list)
    without: set[str] = attrs.field(factory=set)  # kinds this cluster does not serve
    # Kinds an add-on installs beside them (kueue.RESOURCES), in CLUSTER_RESOURCES' form.
    extra_resources: list[tuple[str, str, str, str, bool, bool, list[str]]] = attrs.field(
        factory=list
    )

    def served_resources(self) -> list[tuple[str, str, str, str, bool, bool, list[str]]]:
        served = [*CLUSTER_RESOURCES, *self.extra_resources]
        return [r for r in served if r[3] not in self.without]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if "JobSet" not in self.without:
            self.add(render_jobset_crd())

    def _store_new(self, key: Key, namespace: str, body: Obj) -> Obj:
        obj = copy.deepcopy(body)
        obj.setdefault("kind", self._kinds[key][0])
        obj.setdefault("apiVersion", f"{key[0]}/{key[1]}" if key[0] else key[1])
        if namespace:
            obj.setdefault("metadata", {}).setdefault("namespace", namespace)
        if obj["kind"] == "Secret" and obj.get("stringData"):
            # kube-apiserver merges stringData into data (base64) and never stores it.
            data = dict(obj.get("data") or {})
            for k, v in obj.pop("stringData").items():
                data[k] = base64.b64encode(str(v).encode()).decode()
            obj["data"] = data
        for admit in [*self.admission, self._admit_priority]:
            message = admit(obj)
            if isinstance(message, Forbidden):
                raise kmock.KubernetesError(status=403, reason="Forbidden", message=message)
            if message:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=message)
        return super()._store_new(key, namespace, obj)

    def _admit_priority(self, obj: Obj) -> str | None:
        """The Priority admission plugin's refusal of a pod whose class does not exist."""
        if obj.get("kind") != "Pod" or "PriorityClass" in self.without:
            return None
        wanted = (obj.get("spec") or {}).get("priorityClassName")
        if not wanted or wanted in SYSTEM_PRIORITY_CLASSES:
            return None
        if self.get("PriorityClass", "", wanted) is not None:
            return None
        meta = obj.get("metadata") or {}
        name = meta.get("generateName") or meta.get("name") or "Unknown"
        return Forbidden(
            f'pods "{name}" is forbidden: no PriorityClass with name {wanted} was found'
        )

    def _delete(self, key: Key, namespace: str, name: str, options: Obj | None = None) -> Obj:
        obj = self.objects.get((key, namespace, name))
        if obj is None or self._kinds[key][0] != "Pod":
            return super()._delete(key, namespace, name, options)
        grace = (options or {}).get("gracePeriodSeconds")
        if grace is None:
            grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        meta = obj["metadata"]
        unscheduled = not (obj.get("spec") or {}).get("nodeName")
        if int(grace) == 0 or unscheduled:
            return super()._delete(key, namespace, name, options)
        if meta.get("deletionTimestamp"):
            return obj  # already terminating: the kubelet is on it
        new = copy.deepcopy(obj)
        new["metadata"].update(
            deletionTimestamp=_now(),
            deletionGracePeriodSeconds=int(grace),
            resourceVersion=self._next_rv(),
        )
        self.objects[(key, namespace, name)] = new
        self._emit(key, "MODIFIED", new)
        return new

    def remove_pod(self, namespace: str, name: str) -> None:
        """The kubelet's final delete (grace period 0) once the pod's containers stopped."""
        obj = self.get("Pod", namespace, name)
        if obj is not None:
            super()._delete(self._key_of(obj), namespace, name, {"gracePeriodSeconds": 0})

    async def create(self, obj: Obj) -> Obj:
        """Create as a controller does through the API (admission included)."""
        return self._store_new(self._key_of(obj), obj["metadata"].get("namespace", ""), obj)

    async def patch(self, kind: str, namespace: str, name: str, patch: Any) -> Obj:
        """A merge patch of the object's spec/metadata, as a controller sends it."""
        obj = self.get(kind, namespace, name)
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        return await self._update(self._key_of(obj), namespace, name, patch, None)

    async def delete(
        self, kind: str, namespace: str, name: str, grace_s: int | None = None
    ) -> None:
        """DELETE through the store (graceful for pods); nothing when already gone."""
        obj = self.get(kind, namespace, name)
        if obj is not None:
            options = None if grace_s is None else {"gracePeriodSeconds": grace_s}
            self._delete(self._key_of(obj), namespace, name, options)
