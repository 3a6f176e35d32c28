"""The local cluster: the operator's rendered objects run, not imagined, on one machine.

`local_cluster(workdir)` starts, in this process and event loop:
- the API: kmock with kube-apiserver's store semantics (`apiserver.ClusterApiServer`), with
  JobSet's webhook and the API server's Job checks as admission, served over HTTP so the real
  `kubectl` drives it (`LocalCluster.kubectl`);
- the controllers a JobSet cluster runs: JobSet's (`jobset_controller`) and the Job
  controller (`job_controller`), written from those projects' sources;
- storage (`storage.StorageController`, one default class `local` that provisions every
  access mode): claims bind before the pods that mount them are scheduled;
- one node (`kubelet.ProcessKubelet`): every pod runs its container's command as a real
  process, in its own network namespace (own address and ports, names from a hosts file) and
  mount namespace (its volumes at their mount paths, PVCs as shared directories under
  `workdir/pvc`), probes executed against it, graceful deletion with SIGTERM;
- the operator: the real kopf handlers (`gspo_operator.run.serve`);
- with `kueue=`, Kueue's stand-in (`kueue.py`): its kinds, JobSet webhook and controller.

What each piece models and what it does not is in its own docstring. The image field is
ignored: every container runs this checkout's `gspo` (the venv beside the running Python),
with the environment the project's images set (`IMAGE_ENV`).

By hand: `make cluster` (= `python tests/cluster/run.py examples/local-cluster.yaml`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubectl import Kubectl
from kubelet import ProcessKubelet, awaiting
from operator_harness import NS, _keep_running, api_server, kueue_api_server, operator
from storage import LOCAL_CLASSES, StorageController

from gspo_operator.handlers import Context

# What docker/learner.Dockerfile and docker/rollout.Dockerfile set with ENV, and this
# checkout's sources first on the path: the venv's editable install may point at another
# checkout of the project, and the pods must run the code under test.
REPO = Path(__file__).resolve().parents[2]
IMAGE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "DS_BUILD_OPS": "0",
    "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}",
}


@dataclass
class LocalCluster:
    api: Any  # apiserver.ClusterApiServer
    node: ProcessKubelet
    operator: Context
    kubectl: Kubectl
    workdir: Path
    phases: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds)
    kueue: Any = None  # kueue.KueueController when the cluster runs Kueue
    node_task: asyncio.Task[None] | None = None  # the node's loop (node.run)
    _t0: float = field(default_factory=time.monotonic)

    def mark(self, what: str) -> None:
        """Record (and print) how long the phase that just ended took."""
        now = time.monotonic()
        self.phases.append((what, now - self._t0))
        print(f"[local cluster] {what}: {now - self._t0:.1f} s", flush=True)
        self._t0 = now

    def job(self, name: str) -> dict[str, Any]:
        return self.api.get("GSPOJob", NS, name) or {}

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for c in self.status(name).get("conditions") or []:
            if c["type"] == type_:
                return c
        return {}

    def pods(self, job: str, role: str, *, running: bool = False) -> list[dict[str, Any]]:
        """The job's pods of `role` (not terminating), oldest first."""
        out = [
            p
            for p in self.api.list_kind("Pod", NS)
            if (p["metadata"].get("labels") or {}).get("gspo.dev/job-name") == job
            and p["metadata"]["labels"].get("gspo.dev/role") == role
            and not p["metadata"].get("deletionTimestamp")
            and (not running or (p.get("status") or {}).get("phase") == "Running")
        ]
        return sorted(out, key=lambda p: p["metadata"]["creationTimestamp"])

    def claim_dir(self, claim: str) -> Path:
        """The directory that backs PersistentVolumeClaim `claim` on this node."""
        return self.workdir / "pvc" / NS / claim

    def log(self, pod: str, container: str) -> str:
        path = self.node.log_path(NS, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, job: str, lines: int = 30) -> str:
        """The last lines of every pod's log that ever ran for `job` (for failure messages)."""
        out = []
        for path in sorted((self.workdir / "logs").glob(f"{NS}_{job}-*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def objects(self, job: str, events: int = 25) -> str:
        """The job's JobSet, Jobs and pods as the controllers see them, and its newest Events:
        what a failed wait needs to say which controller stopped (a pod never created, one
        Pending or still terminating, a Job's name held by its predecessor)."""
        lines = []
        for js in self.api.list_kind("JobSet", NS):
            if js["metadata"]["name"] == job:
                st = js.get("status") or {}
                conds = [
                    (c["type"], c["status"], c.get("reason")) for c in st.get("conditions") or []
                ]
                lines.append(f"JobSet restarts={st.get('restarts')} conditions={conds}")
        for kind in ("Job", "Pod"):
            for obj in self.api.list_kind(kind, NS):
                meta, st = obj["metadata"], obj.get("status") or {}
                if not meta["name"].startswith(f"{job}-"):
                    continue
                owner = ",".join(r["uid"][:8] for r in meta.get("ownerReferences") or [])
                attempt = (meta.get("labels") or {}).get("jobset.sigs.k8s.io/restart-attempt")
                if kind == "Job":
                    state = [c["type"] for c in st.get("conditions") or [] if c["status"] == "True"]
                    counts = {
                        k: st[k] for k in ("active", "ready", "failed", "terminating") if st.get(k)
                    }
                    what = f"{counts} {state}"
                else:
                    waiting = [
                        (c.get("state") or {}).get("waiting", {}).get("reason")
                        for c in st.get("containerStatuses") or []
                    ]
                    what = f"{st.get('phase')} node={obj.get('spec', {}).get('nodeName')} {waiting}"
                deleting = " deleting" if meta.get("deletionTimestamp") else ""
                lines.append(
                    f"{kind} {meta['name']} uid={meta['uid'][:8]} owner={owner} "
                    f"attempt={attempt}{deleting} {what}"
                )
        evs = sorted(
            (
                e
                for e in self.api.list_kind("Event", NS)
                if (e.get("involvedObject") or {}).get("name", "").startswith(job)
            ),
            key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "",
        )[-events:]
        for e in evs:
            obj = e.get("involvedObject") or {}
            lines.append(
                f"Event {e.get('lastTimestamp') or e.get('eventTime')} {obj.get('kind')} "
                f"{obj.get('name')} {e.get('type')} {e.get('reason')}: {e.get('message')}"
            )
        return "\n".join(lines)

    async def wait(self, check: Any, timeout_s: float, what: str, job: str = "") -> Any:
        """Poll `check()` until truthy; on timeout, or when `job` failed meanwhile, fail with
        the job's status and its pods' logs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        why = f"timed out after {timeout_s:.0f} s"
        while loop.time() < deadline:
            found = check()
            if found:
                return found
            if job and self.status(job).get("phase") == "Failed":
                why = "the job failed"
                break
            if self.node_task is not None and self.node_task.done():
                why = "the node's loop ended"
                break
            await asyncio.sleep(0.2)
        detail = (
            f"\nstatus: {self.status(job)}\n{self.objects(job)}\n{self.node_state()}\n"
            f"{self.logs_tail(job)}"
            if job
            else ""
        )
        raise AssertionError(f"{why} waiting for {what}{detail}")

    def node_state(self) -> str:
        """The node's loop (ended, and why; or where it waits) and its pods' tasks."""
        lines = [self.node.diagnose()]
        task = self.node_task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception())
            lines.append(f"node loop ended: {why}")
        elif task is not None:
            lines.append(f"node loop at {awaiting(task)}")
        return "\n".join(lines)


@contextlib.asynccontextmanager
async def local_cluster(
    workdir: Path,
    *,
    interval_s: float = 1.0,
    probe_period_scale: float = 0.3,
    kueue: dict[str, Any] | None = None,
) -> AsyncIterator[LocalCluster]:
    """API, controllers, a process node and the operator, until the block ends; with `kueue`
    (KueueController's options, {} for Kueue's defaults) Kueue's stand-in too."""
    workdir.mkdir(parents=True, exist_ok=True)
    serving = api_server() if kueue is None else kueue_api_server(**kueue)
    async with serving as served:
        api, controller = (served, None) if kueue is None else served
        for sc in LOCAL_CLASSES:
            api.add(copy.deepcopy(sc))
        node = ProcessKubelet(
            api,
            workdir,
            image_env=IMAGE_ENV,
            probe_period_scale=probe_period_scale,
            volume_binding=True,
        )
        stop = asyncio.Event()
        node_task = asyncio.create_task(node.run(stop))
        storage_task = asyncio.create_task(_keep_running(StorageController(api), stop))
        try:
            async with operator(api, interval_s=interval_s) as ctx:
                kubectl = Kubectl(api.base_url, workdir)
                yield LocalCluster(
                    api, node, ctx, kubectl, workdir, kueue=controller, node_task=node_task
                )
        finally:
            stop.set()
            await asyncio.wait([node_task, storage_task], timeout=30)
            await node.close()
            if node_task.done() and not node_task.cancelled() and node_task.exception():
                raise node_task.exception()  # type: ignore[misc]
