"""The one module that talks to the Kubernetes API (children of a GSPOJob).

A thin async adapter over the official `kubernetes` client: its configuration, auth and TLS,
with requests run in threads. Objects stay plain dicts, as `render` makes them. Creating an
object that exists is success: names are deterministic, so a restarted operator re-creates
nothing twice.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client, config

from gspo_api.spec import API_GROUP, API_VERSION

Obj = dict[str, Any]
log = logging.getLogger(__name__)

# kind -> plural, for every kind the operator touches.
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Service": "services",
    "Pod": "pods",
    "Job": "jobs",
    "JobSet": "jobsets",
    "NetworkPolicy": "networkpolicies",
    "PodMonitor": "podmonitors",
    "Workload": "workloads",
    "Event": "events",
    "GSPOJob": "gspojobs",
}
JOB_API = f"{API_GROUP}/{API_VERSION}"
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "gspo-operator"


class ApiError(Exception):
    """An error answer (or none: status 0) from the API server; `message` is the server's."""

    def __init__(
        self, status: int, method: str, path: str, body: str, retry_after_s: float | None = None
    ) -> None:
        self.status = status
        self.retry_after_s = retry_after_s
        try:
            detail = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            detail = body
        self.message = str(detail)[:600]
        super().__init__(f"{method} {path}: HTTP {status}: {detail}"[:500])


def _retry_after(headers: Any) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def path_of(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{PLURALS[kind]}"
    if name:
        base += f"/{name}"
    return f"{base}/{subresource}" if subresource else base


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the local kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client
        self.api.user_agent = USER_AGENT
        self.requests_total = 0  # every API request made (the benchmark reads it)

    @classmethod
    def for_host(cls, host: str) -> Kube:
        """A client of an API server at `host` without auth (the test stand-in)."""
        conf = client.Configuration(host=host)
        conf.connection_pool_maxsize = 32
        return cls(client.ApiClient(conf))

    def close(self) -> None:
        self.api.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        return await asyncio.to_thread(self._request, method, path, body, query, content_type)

    def _request(
        self, method: str, path: str, body: Any, query: Mapping[str, str] | None, ctype: str
    ) -> Obj:
        self.requests_total += 1
        headers = {"Accept": "application/json", "Content-Type": ctype}
        serialized = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*serialized)
            response.read()
        except client.ApiException as exc:
            retry_after = _retry_after(exc.headers)
            raise ApiError(
                exc.status or 0, method, path, exc.body or str(exc), retry_after
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # no answer: refused, reset
            raise ApiError(0, method, path, str(exc)) from exc
        text = response.data.decode() if isinstance(response.data, bytes) else response.data
        if response.status >= 400:
            raise ApiError(response.status, method, path, text or "")
        return json.loads(text) if text else {}

    # --- children ---------------------------------------------------------------------------

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create `obj`; False when it already exists (success: nothing is replaced)."""
        meta = obj["metadata"]
        path = path_of(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        try:
            await self.request("POST", path, body=dict(obj))
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def create_or_get(self, obj: Mapping[str, Any]) -> Obj | None:
        """Create `obj`: None when made; the object already there when the name is taken (the
        caller decides whether it is its own: names alone never prove ownership)."""
        meta = obj["metadata"]
        if await self.create(obj):
            return None
        found = await self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if found is None:  # deleted between the two requests: try once more
            return None if await self.create(obj) else await self.create_or_get(obj)
        return found

    async def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves `kind` (discovery of its group version)."""
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        try:
            found = await self.request("GET", base)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("kind") == kind for r in found.get("resources") or [])

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        try:
            return await self.request("GET", path_of(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[Obj]:
        path = path_of(api_version, kind, namespace)
        found = await self.request("GET", path, query={"labelSelector": label_selector})
        return list(found.get("items") or [])

    async def events_of(self, namespace: str, kind: str, name: str) -> builtins.list[Obj]:
        """The core/v1 Events about one object (the way `kubectl describe` finds them)."""
        return await self._events(
            namespace, f"involvedObject.kind={kind},involvedObject.name={name}"
        )

    async def events_by_reason(self, namespace: str, kind: str, reason: str) -> builtins.list[Obj]:
        """The namespace's core/v1 Events of one reason about objects of one kind, in one
        list (`reason` is among the Event field selectors the API server serves:
        kubernetes pkg/apis/core/v1/conversion.go, AddFieldLabelConversionFuncForEvent)."""
        return await self._events(namespace, f"involvedObject.kind={kind},reason={reason}")

    async def _events(self, namespace: str, selector: str) -> builtins.list[Obj]:
        path = path_of("v1", "Event", namespace)
        found = await self.request("GET", path, query={"fieldSelector": selector})
        return list(found.get("items") or [])

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> Obj:
        path = path_of(api_version, kind, namespace, name, subresource)
        return await self.request("PATCH", path, body=dict(patch), content_type=MERGE_PATCH)

    async def delete(
        self, api_version: str, kind: str, namespace: str, name: str, *, grace_s: int | None = None
    ) -> bool:
        """Delete (gracefully); False when it was already gone."""
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_s is not None:
            body["gracePeriodSeconds"] = grace_s
        try:
            await self.request("DELETE", path_of(api_version, kind, namespace, name), body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
