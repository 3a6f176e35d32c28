"""Harness of the operator tests: the API stand-in with JobSet's and the Job controller's
stand-ins running (tests/cluster), a running operator, and a hand-driven node: pods are
created by the controllers from the operator's JobSet, and a test sets their status the way
a kubelet would (`kubelet`). tests/cluster runs the same with a kubelet that runs the pods."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import kmock
import pytest
import yaml
from apiserver import ClusterApiServer
from checkout import REPO
from job_controller import JobController, admit_job
from jobset_controller import JobSetController
from jobset_webhook import admit

from gspo_api.ports import free_port
from gspo_api.progress import LearnerProgress
from gspo_operator.handlers import Context
from gspo_operator.kube import Kube
from gspo_operator.run import serve

NS = "default"


def flagship_priority_class() -> dict:
    """The PriorityClass examples/gspojob.yaml's pods name, from the prerequisites shipped
    beside it: without it the API server refuses every pod of the flagship job."""
    docs = yaml.safe_load_all((REPO / "examples" / "gspojob-prerequisites.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "PriorityClass")


def tiny_job(name: str = "tiny", progress_port: int = 9090, **sections: dict) -> dict:
    """A small CPU GSPOJob; `sections` update spec sections."""
    spec: dict[str, Any] = {
        "model": {"name": "builtin:tiny-qwen3", "maxModelLen": 64, "dtype": "float32"},
        "data": {"source": "builtin:addition", "maxPromptTokens": 16},
        "reward": {"kind": "arithmetic"},
        "algorithm": {
            "groupSize": 4,
            "promptsPerStep": 4,
            "miniBatches": 1,
            "maxResponseTokens": 8,
            "maxSteps": 20,
        },
        "learner": {"replicas": 2, "gpusPerReplica": 0, "zeroStage": 0},
        "rollout": {"replicas": 2, "gpusPerReplica": 0, "tensorParallelSize": 1},
        "checkpoint": {"size": "1Gi", "everySteps": 5},
        "runPolicy": {"backoffLimit": 1},
        "metrics": {"port": progress_port},
    }
    for section, fields in sections.items():
        spec[section] = {**spec.get(section, {}), **fields}
    return {
        "apiVersion": "gspo.dev/v1alpha1",
        "kind": "GSPOJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


@contextlib.asynccontextmanager
async def api_server(without: tuple[str, ...] = ()) -> AsyncIterator[ClusterApiServer]:
    """The API stand-in over HTTP with JobSet's webhook and the JobSet and Job controllers
    running; `without` names kinds the cluster does not serve (e.g. "PodMonitor"). On exit,
    every request the operator made is checked against rbac.RULES."""
    server = ClusterApiServer(admission=[admit, admit_job], without=set(without))
    async with _serving(server, []):
        yield server


@contextlib.asynccontextmanager
async def kueue_api_server(**options: Any) -> AsyncIterator[tuple[ClusterApiServer, Any]]:
    """`api_server` on a cluster with Kueue installed: its kinds, its JobSet webhook and its
    controller (tests/cluster/kueue.py; `options` go to KueueController)."""
    import kueue

    server = ClusterApiServer(
        admission=[admit, admit_job, kueue.admit], extra_resources=kueue.RESOURCES
    )
    controller = kueue.KueueController(server, **options)
    async with _serving(server, [controller]):
        yield server, controller


@contextlib.asynccontextmanager
async def _serving(server: ClusterApiServer, extra: list[Any]) -> AsyncIterator[None]:
    async with server, kmock.Server(server) as http:
        server.base_url = str(http.url).rstrip("/")
        stop = asyncio.Event()
        controllers = [JobSetController(server), JobController(server), *extra]
        tasks = [asyncio.create_task(_keep_running(c, stop)) for c in controllers]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        for c in controllers:
            assert not c.errors, c.errors
        assert_rbac_covers(server)


async def _keep_running(controller: Any, stop: asyncio.Event) -> None:
    """Run a cluster controller until `stop`. A stopping kopf operator cancels tasks of the
    loop it did not start (here: an operator killed mid-run, tests/operator/operator_restarts);
    a cluster's controllers do not die with an operator, so the loop goes on."""
    while not stop.is_set():
        try:
            await controller.run(stop)
        except asyncio.CancelledError:
            if stop.is_set():
                return
            asyncio.current_task().uncancel()  # type: ignore[union-attr]


@pytest.fixture
async def api() -> AsyncIterator[ClusterApiServer]:
    async with api_server() as server:
        yield server


VERBS = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}


def assert_rbac_covers(server: ClusterApiServer) -> None:
    """Every API request the operator (kopf or kube.py) made is allowed by rbac.RULES."""
    from gspo_operator.kube import USER_AGENT
    from gspo_operator.rbac import RULES, allows

    checked = 0
    for request in server._requests:
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or request.resource.plural is None:
            continue  # discovery: allowed to every authenticated client
        if not agent.startswith((USER_AGENT, "kopf")):
            continue
        method = request.method.value
        if method == "GET":
            watch = request.params.get("watch") in ("true", "1")
            verb = "watch" if watch else "get" if request.name else "list"
        else:
            verb = VERBS[method]
        resource = request.resource.plural
        if request.subresource:
            resource += "/" + request.subresource
        group = request.resource.group or ""
        assert allows(RULES, group, resource, verb), f"rbac.RULES lack {verb} {group}/{resource}"
        for owner in _blocking_owners(request.data if method in ("POST", "PUT") else None):
            assert allows(RULES, *owner, "update"), (
                "cannot set blockOwnerDeletion if an ownerReference refers to a resource you "
                f"can't set finalizers on: rbac.RULES lack update {'/'.join(owner)}"
            )
        checked += 1
    assert checked or not server._requests, "no operator request was recognised"


def _blocking_owners(body: Any) -> list[tuple[str, str]]:
    """(group, plural/finalizers) of each owner a created object's ownerReferences block.

    kube-apiserver's OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift;
    kubernetes plugin/pkg/admission/gc/gc_admission.go) admits an ownerReference with
    blockOwnerDeletion: true only when the requester may update the owner's `finalizers`
    subresource. Only GSPOJob owners are mapped: the operator owns nothing else."""
    from gspo_api.spec import API_GROUP, KIND
    from gspo_operator.crd import PLURAL

    refs = ((body or {}).get("metadata") or {}).get("ownerReferences") or []
    out = []
    for ref in refs:
        if ref.get("blockOwnerDeletion"):
            assert ref.get("kind") == KIND, f"unexpected owner {ref}"
            out.append((API_GROUP, f"{PLURAL}/finalizers"))
    return out


class Progress:
    """Stands in for learner rank 0's GET /progress."""

    def __init__(self) -> None:
        self.value = LearnerProgress()
        self.port = free_port()
        self.polls = 0  # GET /progress answered

    async def handle(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        self.polls += 1
        resp = aiohttp.web.Response(text=self.value.to_json(), content_type="application/json")
        # No keep-alive: an idle connection's handler task would outlive the operator in this
        # event loop, and a stopping kopf waits 5 s for every such task (see `stopped`).
        resp.force_close()
        return resp


@contextlib.asynccontextmanager
async def progress_server() -> AsyncIterator[Progress]:
    """A learner's GET /progress, with whatever the test sets as its value."""
    prog = Progress()
    app = aiohttp.web.Application()
    app.router.add_get("/progress", prog.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", prog.port).start()
    try:
        yield prog
    finally:
        await runner.cleanup()


@pytest.fixture
async def progress() -> AsyncIterator[Progress]:
    async with progress_server() as prog:
        yield prog


@contextlib.asynccontextmanager
async def operator(
    api: ClusterApiServer,
    interval_s: float = 0.2,
    liveness_port: int | None = None,
    progress_write_s: float = 0.0,
    progress_writes_per_minute: float = 0.0,
    resync_s: float = 600.0,
    namespaces: tuple[str, ...] = (NS,),
) -> AsyncIterator[Context]:
    """Run the real operator (kopf tasks) against `api`, watching `namespaces`, until the
    block ends. Progress is written at once by default (tests read it); a cluster writes it
    every minute."""
    import kopf

    url = api.base_url
    ctx = Context(
        kube=Kube.for_host(url),
        interval_s=interval_s,
        progress_write_s=progress_write_s,
        progress_writes_per_minute=progress_writes_per_minute,
        resync_s=resync_s,
    )

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, default_namespace=NS)

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(
            ctx,
            namespaces=list(namespaces),
            login=login,
            scanning=False,
            stop_flag=stop,
            ready_flag=ready,
            liveness_endpoint=liveness_port and f"http://127.0.0.1:{liveness_port}/healthz",
        )
    )
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield ctx
    finally:
        stop.set()
        await stopped(task, ctx, 20)
        ctx.kube.close()
        assert task.done(), "the operator did not stop within 20 s"
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


async def stopped(task: asyncio.Task[None], ctx: Context, timeout_s: float) -> None:
    """Wait for a stopping operator's task, closing its API client's idle connections
    meanwhile.

    Once its own tasks are done, kopf waits up to 5 s for every task born after it started
    (kopf/_core/reactor/running.py, run_tasks: "hung" tasks) before cancelling them. The API
    stand-in serves in this same event loop, so each keep-alive connection of the operator's
    client holds a server task there until the client lets go of it: closing the pool (again,
    as requests made while stopping open new connections) ends them, and the stop takes
    milliseconds instead of 5 s. A connection in use finishes its request first (urllib3
    closes it when returned to a cleared pool)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done() and loop.time() < deadline:
        ctx.kube.close()
        await asyncio.wait([task], timeout=0.05)


@pytest.fixture
def run_operator() -> Callable[..., Any]:
    return operator


async def eventually(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """Poll `check` until it returns a truthy value; fail with `what` after the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while loop.time() < deadline:
        try:
            last = check()
            if last:
                return last
        except (KeyError, TypeError, AssertionError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")


def pods_of(api: ClusterApiServer, role: str, attempt: int | None = None) -> list[dict]:
    """The job's pods of one role (of one JobSet restart attempt), by completion index."""
    out = [
        p
        for p in api.list_kind("Pod", NS)
        if (p["metadata"].get("labels") or {}).get("gspo.dev/role") == role
        and not p["metadata"].get("deletionTimestamp")
        and (
            attempt is None
            or p["metadata"]["labels"].get("jobset.sigs.k8s.io/restart-attempt") == str(attempt)
        )
    ]
    return sorted(out, key=lambda p: p["metadata"]["name"])


async def kubelet(
    api: ClusterApiServer,
    pod: str,
    phase: str,
    *,
    ready: bool | None = None,
    exit_code: int | None = None,
    message: str = "",
) -> None:
    """Patch a pod's status the way the kubelet would (container state, Ready, exit code)."""
    ready = phase == "Running" if ready is None else ready
    obj = api.get("Pod", NS, pod)
    assert obj is not None, f"no pod {pod}"
    container = obj["spec"]["containers"][0]["name"]
    status: dict[str, Any] = {
        "phase": phase,
        "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if exit_code is not None:
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "message": message,
        }
        status["containerStatuses"] = [{"name": container, "state": {"terminated": terminated}}]
    await api.patch_status("Pod", NS, pod, status)


async def run_all(api: ClusterApiServer) -> None:
    """Every pod of the job Running and Ready (the learner's and the servers')."""
    for pod in api.list_kind("Pod", NS):
        if pod["status"].get("phase") != "Running" and not pod["metadata"].get("deletionTimestamp"):
            await kubelet(api, pod["metadata"]["name"], "Running")
