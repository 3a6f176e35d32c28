"""One job's life with the operator stopped and restarted at random moments (seeded).

The real operator (kopf tasks, `gspo_operator.run.serve`) runs against the API stand-in, with
JobSet's and the Job controller's stand-ins making the pods, while a simulated kubelet runs
them, advances the learner's /progress and finally exits every learner pod 0. The operator
is stopped and started again `restarts` times along the way. `check_children` then says what
went wrong, if anything: duplicate or missing children, children without the job as owner, a
wrong terminal status, or learner restarts that the operator restarts alone caused. Used by
tests/operator/test_operator_restarts.py and bench/faults.py's `operator-restarts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from apiserver import ClusterApiServer as ApiServer
from operator_harness import NS, Progress, api_server, kubelet, progress_server, tiny_job

from gspo_api.progress import LearnerProgress
from gspo_operator import names
from gspo_operator.handlers import Context
from gspo_operator.kube import Kube
from gspo_operator.manifest import check_job
from gspo_operator.render import render_job
from gspo_operator.run import serve

JOB = "restarts"
TICK_S = 0.05
CHILD_KINDS = (
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
    "Service",
    "JobSet",
    "NetworkPolicy",
    "PodMonitor",
)


@dataclass
class Trial:
    """What one trial saw; `problems` is empty when the job survived every restart."""

    restarts: int = 0
    duplicates: int = 0
    orphans: int = 0
    missing: int = 0
    learner_restarts: int = 0
    phase: str = ""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def crashing_operator(api: ApiServer, interval_s: float = 0.2) -> AsyncIterator[Context]:
    """The real operator until the block ends, then killed at once (as by SIGKILL or a lost
    node): whatever handler runs is cut off, kopf writes no progress and posts nothing more."""
    import kopf

    url = api.base_url
    ctx = Context(kube=Kube.for_host(url), interval_s=interval_s)

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, default_namespace=NS)

    ready = asyncio.Event()
    task = asyncio.create_task(
        serve(ctx, namespaces=[NS], login=login, scanning=False, ready_flag=ready)
    )
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield ctx
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=20)
        ctx.kube.close()
        assert task.done(), "the operator did not stop within 20 s"


async def simulate_kubelet(api: ApiServer, prog: Progress, steps: int, done: asyncio.Event) -> None:
    """Pods start, servers turn ready, the learner advances one step a tick, then exits 0."""
    replicas = 2
    while not done.is_set():
        for pod in api.list_kind("Pod", NS):
            if pod["status"].get("phase") == "Pending" and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                await kubelet(api, pod["metadata"]["name"], "Running")
        pods = [p for p in api.list_kind("Pod", NS) if _is_learner(p)]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        if len(running) == replicas:
            step = prog.value.step + 1
            prog.value = LearnerProgress(phase="Running", step=step, policy_version=step)
            if step >= steps:
                for pod in running:
                    await kubelet(api, pod["metadata"]["name"], "Succeeded", exit_code=0)
        await asyncio.sleep(TICK_S)


def _is_learner(obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return labels.get(names.JOB_LABEL) == JOB and labels.get(names.ROLE_LABEL) == names.LEARNER


def job_status(api: ApiServer) -> dict[str, Any]:
    return (api.get("GSPOJob", NS, JOB) or {}).get("status") or {}


async def run_trial(rng: random.Random, restarts: int = 10, life_s: float = 6.0) -> Trial:
    """Create a job, restart the operator `restarts` times within `life_s`, await its end."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    trial = Trial()
    # Moments (seconds after the job is created) at which the operator is stopped, and for
    # how long it stays away; some land in creation, some while running, some after the end.
    moments = sorted(rng.uniform(0.0, life_s) for _ in range(restarts))
    downtimes = [rng.uniform(0.0, 0.4) for _ in range(restarts)]
    steps = int(life_s * 0.6 / TICK_S)
    async with api_server() as api, progress_server() as prog:
        done = asyncio.Event()
        doc = tiny_job(JOB, progress_port=prog.port)
        # Started before any operator: kopf cancels the tasks born while it runs when it stops.
        kube_task = asyncio.create_task(simulate_kubelet(api, prog, steps, done))
        try:
            created_at = None
            for moment, down in [*zip(moments, downtimes, strict=True), (None, 0.0)]:
                async with crashing_operator(api):
                    if created_at is None:
                        await _create(api, doc)
                        created_at = loop.time()
                    if moment is None:
                        await _until_terminal(api, timeout_s=60)
                    else:
                        await asyncio.sleep(max(0.0, created_at + moment - loop.time()))
                        trial.restarts += 1
                await asyncio.sleep(down)
        finally:
            done.set()
            await asyncio.wait([kube_task], timeout=5)
            if kube_task.done() and kube_task.exception() is not None:
                raise kube_task.exception()  # type: ignore[misc]
        check_children(api, doc, trial)
    trial.seconds = loop.time() - began
    return trial


async def _create(api: ApiServer, doc: dict[str, Any]) -> None:
    import aiohttp

    url = f"{api.base_url}/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs"
    async with aiohttp.ClientSession() as session, session.post(url, json=doc) as resp:
        assert resp.status < 300, await resp.text()


async def _until_terminal(api: ApiServer, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if job_status(api).get("phase") in ("Succeeded", "Failed"):
            return
        await asyncio.sleep(TICK_S)


def check_children(api: ApiServer, doc: dict[str, Any], trial: Trial) -> None:
    """Fill `trial` from what the API server holds now."""
    job = api.get("GSPOJob", NS, JOB)
    if job is None:
        trial.problems.append("the GSPOJob is gone")
        return
    st = job.get("status") or {}
    trial.phase = st.get("phase") or ""
    trial.learner_restarts = int(st.get("restarts") or 0)
    spec, problems = check_job(job)
    assert spec is not None, problems
    expected = {(o["kind"], o["metadata"]["name"]) for o in render_job(job, spec, token="")}
    labelled = [
        (kind, o)
        for kind in CHILD_KINDS
        for o in api.list_kind(kind, NS)
        if (o["metadata"].get("labels") or {}).get(names.JOB_LABEL) == JOB
    ]
    seen: dict[tuple[str, str], int] = {}
    for kind, obj in labelled:
        key = (kind, obj["metadata"]["name"])
        seen[key] = seen.get(key, 0) + 1
        owners = obj["metadata"].get("ownerReferences") or []
        kept = (obj["metadata"].get("annotations") or {}).get(names.JOB_UID_ANNOTATION)
        if kind == "PersistentVolumeClaim" and kept == job["metadata"]["uid"]:
            continue  # the checkpoint claim outlives the job (retainClaim): marked, not owned
        if not any(o.get("uid") == job["metadata"]["uid"] and o.get("controller") for o in owners):
            trial.orphans += 1
            trial.problems.append(f"{kind} {key[1]} has no ownerReference to the GSPOJob")
    extra = set(seen) - expected
    trial.duplicates = len(extra) + sum(n - 1 for n in seen.values())
    trial.problems += [f"unexpected {k} {n}" for k, n in sorted(extra)]
    missing = expected - set(seen)
    trial.missing = len(missing)
    trial.problems += [f"missing {k} {n}" for k, n in sorted(missing)]
    deleted_pods = [
        o["metadata"]["name"]
        for _, key, type_, o in api.history
        if type_ == "DELETED" and key[2] == "pods" and _is_learner(o)
    ]
    if deleted_pods:
        trial.problems.append(f"learner pods deleted: {sorted(set(deleted_pods))}")
    if trial.phase != "Succeeded":
        trial.problems.append(f"phase {trial.phase or 'none'}, not Succeeded")
    conditions = {c["type"]: c for c in st.get("conditions") or []}
    if (conditions.get("Succeeded") or {}).get("status") != "True":
        trial.problems.append("no Succeeded=True condition")
    if (conditions.get("Running") or {}).get("status") != "False":
        trial.problems.append("Running is not False after the end")
    if not st.get("completionTime"):
        trial.problems.append("no completionTime")
    if trial.learner_restarts:
        trial.problems.append(f"{trial.learner_restarts} learner restarts")
    servers = [
        o["metadata"]["name"]
        for o in api.list_kind("Pod", NS)
        if (o["metadata"].get("labels") or {}).get(names.ROLE_LABEL) == names.ROLLOUT
    ]
    if servers:
        trial.problems.append(f"rollout pods left after the end: {servers}")
