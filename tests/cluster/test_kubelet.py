"""The local cluster's node (`ProcessKubelet`): plain Pods in the store become real processes.

Each test starts a kubelet on a fresh `ClusterApiServer`, creates Pods whose containers are
small Python one-liners, and checks what Kubernetes would show for them: status, DNS names,
env, volumes, probes, exits and deletion. They need root and `ip netns` (network and mount
namespaces) and skip without them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # kmock_apiserver

from apiserver import ClusterApiServer
from backoff import CrashLoopBackOff, go_duration
from kubelet import ProcessKubelet, pod_problems, scheduling_problems
from netns import NETNS_ETC, PodNetwork, unavailable_reason

Obj = dict[str, Any]
NS = "default"
PROBE_SCALE = 0.2  # probe periods of 1 s become 0.2 s
TIME_SCALE = 0.02  # the CrashLoopBackOff: 10 s becomes 0.2 s


@dataclass
class Cluster:
    """The store, the node and its loop, with the waits every test needs (status lags)."""

    api: ClusterApiServer
    kubelet: ProcessKubelet
    task: asyncio.Task[None]

    async def wait(
        self, check: Callable[[], Any], what: str | Callable[[], str], timeout: float = 10.0
    ) -> Any:
        """Poll `check` until it returns something truthy; fail with `what` after `timeout`.

        `what` may be a callable, so the failure shows the state at the timeout.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.task.done():
                self.task.result()  # the kubelet's loop died: show why
                raise AssertionError("the kubelet stopped")
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                said = what() if callable(what) else what
                raise AssertionError(f"timed out waiting for {said}")
            await asyncio.sleep(0.05)

    def pod(self, name: str, ns: str = NS) -> Obj | None:
        return self.api.get("Pod", ns, name)

    def status(self, name: str, ns: str = NS) -> Obj:
        pod = self.pod(name, ns)
        return (pod or {}).get("status") or {}

    async def phase(self, name: str, *phases: str, ns: str = NS, timeout: float = 10.0) -> Obj:
        """Wait for one of `phases`; returns the status."""
        await self.wait(
            lambda: self.status(name, ns).get("phase") in phases,
            lambda: f"pod {name} to reach {phases} (status: {self.status(name, ns)})",
            timeout,
        )
        return self.status(name, ns)

    def log(self, name: str, container: str = "main", ns: str = NS) -> str:
        path = self.kubelet.log_path(ns, name, container)
        return path.read_text() if path.exists() else ""

    def last_seen(self, name: str, ns: str = NS) -> Obj:
        """The pod as the store last had it (its DELETED event once removed)."""
        for _, _, _, obj in reversed(self.api.history):
            meta = obj.get("metadata", {})
            if (
                obj.get("kind") == "Pod"
                and meta.get("name") == name
                and meta.get("namespace") == ns
            ):
                return obj
        raise AssertionError(f"pod {name} never existed")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the local cluster's node needs network namespaces: {reason}")
    async with ClusterApiServer() as api:
        kubelet = ProcessKubelet(
            api, tmp_path / "node", probe_period_scale=PROBE_SCALE, time_scale=TIME_SCALE
        )
        stop = asyncio.Event()
        task = asyncio.create_task(kubelet.run(stop))
        try:
            yield Cluster(api, kubelet, task)
        finally:
            stop.set()
            try:
                await task
            finally:
                await kubelet.close()


def pod(name: str, code: str, ns: str = NS, **spec: Any) -> Obj:
    """A Pod whose container `main` runs `python -c code` (restartPolicy Never by default)."""
    container: Obj = {"name": "main", "image": "ignored", "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, **spec.pop("metadata", {})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bytes(response.read()).decode()


def container_status(status: Obj, name: str = "main") -> Obj:
    return next(c for c in status.get("containerStatuses") or [] if c["name"] == name)


def condition(status: Obj, type_: str) -> Obj:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


# --- network and DNS --------------------------------------------------------------------------

PEER = r"""
import http.server, socket, sys, threading, time, urllib.request
me = socket.gethostname()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = me.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
deadline = time.time() + 15
while True:
    try:
        got = urllib.request.urlopen(f"http://{sys.argv[1]}:8080/", timeout=1).read().decode()
        ips = sorted({a[4][0] for a in socket.getaddrinfo("peers", 8080, socket.AF_INET)})
        if len(ips) == 2:
            break
    except OSError:
        pass
    if time.time() > deadline:
        sys.exit("peer never answered")
    time.sleep(0.1)
print("HOST", me, "GOT", got, "PEERS", ",".join(ips), flush=True)
threading.Event().wait()
"""


async def test_pods_reach_each_other_by_hostname_and_headless_service(cluster: Cluster) -> None:
    api = cluster.api
    await api.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "peers", "namespace": NS},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"app": "peer"},
            },
        }
    )
    for me, other in (("alpha", "beta"), ("beta", "alpha")):
        spec = pod(me, PEER, hostname=me, subdomain="peers", metadata={"labels": {"app": "peer"}})
        spec["spec"]["containers"][0]["args"] = [f"{other}.peers.{NS}.svc"]
        await api.create(spec)
    await cluster.wait(
        lambda: "GOT" in cluster.log("alpha") and "GOT" in cluster.log("beta"),
        lambda: (
            f"pods to reach each other (logs: {cluster.log('alpha')!r} {cluster.log('beta')!r})"
        ),
        timeout=20,
    )
    # Status trails the processes by up to one reconcile period.
    await cluster.wait(
        lambda: all(cluster.status(n).get("podIP") for n in ("alpha", "beta")), "pod IPs"
    )
    ips = {name: cluster.status(name)["podIP"] for name in ("alpha", "beta")}
    assert ips["alpha"] != ips["beta"]
    both = ",".join(sorted(ips.values()))
    assert f"HOST alpha GOT beta PEERS {both}" in cluster.log("alpha")
    assert f"HOST beta GOT alpha PEERS {both}" in cluster.log("beta")
    # The root namespace (the operator's) reaches every pod IP on the same port.
    for name, ip in ips.items():
        body = await asyncio.to_thread(_fetch, f"http://{ip}:8080/")
        assert body == name


# --- env --------------------------------------------------------------------------------------

DUMP_ENV = "import json, os, sys; print(json.dumps(dict(os.environ))); print(sys.argv[1:])"


async def test_env_from_secret_configmap_fieldref_and_envfrom(cluster: Cluster) -> None:
    api = cluster.api
    await api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": NS},
            "stringData": {"token": "s3cret", "user": "ann"},
        }
    )
    await api.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings", "namespace": NS},
            "data": {"mode": "fast", "level": "3"},
        }
    )
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {
            "name": "ABSENT",
            "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}},
        },
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "INDEX",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
        {"name": "ADDR", "value": "$(POD_IP):$(MODE):$$(MODE):$(UNDEFINED)"},
    ]
    env_from = [
        {"prefix": "CM_", "configMapRef": {"name": "settings"}},
        {"secretRef": {"name": "creds"}},
        {"configMapRef": {"name": "missing", "optional": True}},
    ]
    spec = pod(
        "envy",
        DUMP_ENV,
        metadata={"annotations": {"batch.kubernetes.io/job-completion-index": "4"}},
        container={"env": env, "envFrom": env_from, "args": ["$(NAME)-$(INDEX)", "$$(NAME)"]},
    )
    await api.create(spec)
    status = await cluster.phase("envy", "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", cluster.log("envy")
    out, argv = cluster.log("envy").splitlines()[-2:]
    seen = json.loads(out)
    ip = status["podIP"]
    assert seen["TOKEN"] == "s3cret" and seen["MODE"] == "fast"
    assert "ABSENT" not in seen
    assert seen["POD_IP"] == ip and seen["NAME"] == "envy" and seen["INDEX"] == "4"
    assert seen["ADDR"] == f"{ip}:fast:$(MODE):$(UNDEFINED)"
    assert seen["CM_mode"] == "fast" and seen["CM_level"] == "3"
    assert seen["token"] == "s3cret" and seen["user"] == "ann"
    assert seen["HOSTNAME"] == "envy"
    assert argv == "['envy-4', '$(NAME)']"


async def test_missing_secret_key_and_missing_volume_source_block_the_start(
    cluster: Cluster,
) -> None:
    api = cluster.api
    await api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": NS},
            "stringData": {"user": "ann"},
        }
    )
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}]
    keyless = pod("keyless", "print('started')", container={"env": env})
    await api.create(keyless)
    volumes = [{"name": "cfg", "configMap": {"name": "later"}}]
    mounts = [{"name": "cfg", "mountPath": "/gspo-kubelet-test/cfg"}]
    waiting = pod(
        "waiting", "print('started')", volumes=volumes, container={"volumeMounts": mounts}
    )
    await api.create(waiting)

    message = f"couldn't find key token in Secret {NS}/creds"

    def config_error() -> bool:
        state = (container_status(cluster.status("keyless")) or {}).get("state", {})
        return state.get("waiting") == {"reason": "CreateContainerConfigError", "message": message}

    await cluster.wait(
        lambda: cluster.status("keyless").get("containerStatuses") and config_error(),
        lambda: f"CreateContainerConfigError ({cluster.status('keyless')})",
    )
    assert cluster.status("keyless")["phase"] == "Pending"
    assert f'container "main": {message}' in pod_problems(cluster.pod("keyless") or {}, api)
    status = cluster.status("waiting")
    assert container_status(status)["state"] == {"waiting": {"reason": "ContainerCreating"}}
    assert status["phase"] == "Pending" and "podIP" not in status
    assert pod_problems(cluster.pod("waiting") or {}, api) == [
        'MountVolume.SetUp failed for volume "cfg" : configmap "later" not found'
    ]
    # Once the sources exist, both start (the kubelet retries).
    await api.patch("Secret", NS, "creds", {"data": {"token": "dG9rZW4="}})
    await api.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "later", "namespace": NS},
            "data": {"k": "v"},
        }
    )
    for name in ("keyless", "waiting"):
        assert (await cluster.phase(name, "Succeeded", "Failed"))["phase"] == "Succeeded"
        assert "started" in cluster.log(name)


# --- volumes ----------------------------------------------------------------------------------

WRITER = r"""
import errno, os, pathlib
base = pathlib.Path("/gspo-kubelet-test")
print("cfg", (base / "cfg/conf/app.ini").read_text(), sorted(os.listdir(base / "cfg")))
print("sec", (base / "sec/password").read_text())
(base / "scratch/x").write_text("scratch")
(base / "claim/shared.txt").write_text("from writer")
try:
    (base / "cfg/new").write_text("no")
except OSError as e:
    print("cfg-write", errno.errorcode[e.errno])
"""
READER = r"""
import errno, pathlib
base = pathlib.Path("/gspo-kubelet-test")
print("claim", (base / "claim/shared.txt").read_text())
print("scratch-empty", list((base / "scratch").iterdir()) == [])
try:
    (base / "claim/mine.txt").write_text("no")
except OSError as e:
    print("claim-write", errno.errorcode[e.errno])
"""


async def test_configmap_secret_pvc_and_emptydir_volumes(cluster: Cluster) -> None:
    api = cluster.api
    for obj in (
        {"kind": "ConfigMap", "data": {"ini": "[app]\nx=1\n", "other": "o"}, "name": "cfg"},
        {"kind": "Secret", "stringData": {"password": "hunter2"}, "name": "sec"},
        {
            "kind": "PersistentVolumeClaim",
            "spec": {"accessModes": ["ReadWriteMany"]},
            "name": "data",
        },
    ):
        name = obj.pop("name")
        await api.create({"apiVersion": "v1", "metadata": {"name": name, "namespace": NS}, **obj})
    volumes = [
        {
            "name": "cfg",
            "configMap": {"name": "cfg", "items": [{"key": "ini", "path": "conf/app.ini"}]},
        },
        {"name": "sec", "secret": {"secretName": "sec"}},
        {"name": "claim", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
    ]
    base = "/gspo-kubelet-test"
    mounts: list[Obj] = [{"name": v["name"], "mountPath": f"{base}/{v['name']}"} for v in volumes]
    await api.create(pod("writer", WRITER, volumes=volumes, container={"volumeMounts": mounts}))
    status = await cluster.phase("writer", "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", cluster.log("writer")
    log = cluster.log("writer")
    assert "cfg [app]\nx=1\n ['conf']" in log  # items: only the listed key, at its path
    assert "sec hunter2" in log
    assert "cfg-write EROFS" in log  # configMap volumes are read-only
    # A second pod shares the claim (read-only here) and gets its own emptyDir.
    mounts[2]["readOnly"] = True
    await api.create(pod("reader", READER, volumes=volumes, container={"volumeMounts": mounts}))
    status = await cluster.phase("reader", "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", cluster.log("reader")
    log = cluster.log("reader")
    assert "claim from writer" in log
    assert "scratch-empty True" in log
    assert "claim-write EROFS" in log
    # The host's view is untouched: the mount points exist there, empty.
    assert os.listdir(f"{base}/claim") == []


FS_GROUP = r"""
import os, pathlib, sys
print("ids", os.getuid(), os.getgid(), sorted(os.getgroups()))
for d in ("/gspo-kubelet-test/empty", "/gspo-kubelet-test/claim"):
    p = pathlib.Path(d, "f")
    try:
        p.write_text("x")
        print("wrote", d, p.stat().st_gid)
    except OSError as e:
        print("failed", d, e.strerror)
"""


async def test_run_as_user_with_fs_group_writes_emptydir_and_pvc(cluster: Cluster) -> None:
    api = cluster.api
    for claim in ("with-group", "without-group"):
        await api.create(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": NS},
                "spec": {"accessModes": ["ReadWriteOnce"]},
            }
        )
    mounts = [
        {"name": "empty", "mountPath": "/gspo-kubelet-test/empty"},
        {"name": "claim", "mountPath": "/gspo-kubelet-test/claim"},
    ]
    for name, security in (
        ("grouped", {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 2000}),
        ("plain", {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True}),
    ):
        claim = "with-group" if name == "grouped" else "without-group"
        volumes = [
            {"name": "empty", "emptyDir": {}},
            {"name": "claim", "persistentVolumeClaim": {"claimName": claim}},
        ]
        spec = pod(name, FS_GROUP, volumes=volumes, securityContext=security)
        spec["spec"]["containers"][0]["volumeMounts"] = mounts
        spec["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False}
        await api.create(spec)
    for name in ("grouped", "plain"):
        status = await cluster.phase(name, "Succeeded", "Failed")
        assert status["phase"] == "Succeeded", cluster.log(name)
    grouped, plain = cluster.log("grouped"), cluster.log("plain")
    assert "ids 10001 10001 [2000]" in grouped
    assert "wrote /gspo-kubelet-test/empty 2000" in grouped  # setgid dir: files get the fsGroup
    assert "wrote /gspo-kubelet-test/claim 2000" in grouped
    assert "ids 10001 10001 []" in plain
    assert "wrote /gspo-kubelet-test/empty 10001" in plain  # emptyDirs are 0777
    assert "failed /gspo-kubelet-test/claim Permission denied" in plain  # root's claim, no group


# --- probes -----------------------------------------------------------------------------------

SLOW_SERVER = r"""
import http.server, time
time.sleep(1.5)
srv = http.server.HTTPServer(("0.0.0.0", 8081), http.server.SimpleHTTPRequestHandler)
print("LISTENING", flush=True)
srv.serve_forever()
"""


async def test_readiness_probe_gates_ready_until_the_process_answers(cluster: Cluster) -> None:
    probe = {"httpGet": {"path": "/", "port": "web"}, "periodSeconds": 1}
    container = {"ports": [{"name": "web", "containerPort": 8081}], "readinessProbe": probe}
    await cluster.api.create(pod("slow", SLOW_SERVER, container=container))
    seen_unready_running = False

    def ready() -> bool:
        nonlocal seen_unready_running
        status = cluster.status("slow")
        if condition(status, "Ready").get("status") != "True":
            running = "running" in (status.get("containerStatuses") or [{}])[0].get("state", {})
            seen_unready_running |= status.get("phase") == "Running" and running
            return False
        assert "LISTENING" in cluster.log("slow"), "Ready before the server listened"
        return True

    await cluster.wait(ready, "the pod to become Ready")
    assert seen_unready_running, "never seen Running but not Ready"
    status = cluster.status("slow")
    assert container_status(status)["ready"] is True
    assert condition(status, "ContainersReady")["status"] == "True"


LIVENESS_VICTIM = r"""
import pathlib, time
ok = pathlib.Path("/gspo-kubelet-test/state/ok")
ok.write_text("")
time.sleep(1.5)
ok.unlink()
print("removed", flush=True)
time.sleep(60)
"""


async def test_liveness_failure_with_restart_never_fails_the_pod(cluster: Cluster) -> None:
    # The exec probe runs inside the pod (its hostname, its mounts): it passes until the
    # process removes the file, so a probe that ran elsewhere would kill it too early.
    check = "import os, socket, sys; sys.exit(socket.gethostname() != 'victim' or not "
    check += "os.path.exists('/gspo-kubelet-test/state/ok'))"
    probe = {
        "exec": {"command": ["python", "-c", check]},
        "periodSeconds": 1,
        "failureThreshold": 2,
        "timeoutSeconds": 5,
    }
    spec = pod(
        "victim",
        LIVENESS_VICTIM,
        volumes=[{"name": "state", "emptyDir": {}}],
        terminationGracePeriodSeconds=5,
        container={
            "livenessProbe": probe,
            "volumeMounts": [{"name": "state", "mountPath": "/gspo-kubelet-test/state"}],
        },
    )
    await cluster.api.create(spec)
    status = await cluster.phase("victim", "Failed", "Succeeded", timeout=15)
    assert status["phase"] == "Failed"
    assert "removed" in cluster.log("victim")
    term = container_status(status)["state"]["terminated"]
    assert term["exitCode"] == 143 and term["reason"] == "Error"  # SIGTERM, 128+15
    assert container_status(status)["restartCount"] == 0


# --- exits, messages, deletion ----------------------------------------------------------------

NOISY_FAILURE = "import sys\nfor i in range(100): print(f'line {i}')\nsys.exit(3)"
MESSAGE_FILE = "open('/dev/termination-log', 'w').write('custom message')"


async def test_exit_codes_and_termination_messages(cluster: Cluster) -> None:
    spec = pod(
        "exits", NOISY_FAILURE, container={"terminationMessagePolicy": "FallbackToLogsOnError"}
    )
    spec["spec"]["containers"].append(
        {"name": "writer", "image": "ignored", "command": ["python", "-c", MESSAGE_FILE]}
    )
    await cluster.api.create(spec)
    status = await cluster.phase("exits", "Failed", "Succeeded")
    assert status["phase"] == "Failed"  # one container failed, restartPolicy Never
    term = container_status(status)["state"]["terminated"]
    assert term["exitCode"] == 3 and term["reason"] == "Error"
    assert term["message"] == "".join(f"line {i}\n" for i in range(20, 100))  # the last 80
    term = container_status(status, "writer")["state"]["terminated"]
    assert term["exitCode"] == 0 and term["reason"] == "Completed"
    assert term["message"] == "custom message"
    assert condition(status, "Ready")["reason"] == "PodCompleted"


TERM_HANDLER = r"""
import signal, sys, time
def stop(*_):
    print("got SIGTERM", flush=True)
    time.sleep(0.3)
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
print("waiting", flush=True)
while True:
    time.sleep(1)
"""
IGNORE_TERM = r"""
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("waiting", flush=True)
while True:
    time.sleep(1)
"""


async def test_graceful_delete_runs_the_sigterm_handler_then_removes_the_pod(
    cluster: Cluster,
) -> None:
    api = cluster.api
    await api.create(pod("graceful", TERM_HANDLER, restartPolicy="Always"))
    await cluster.phase("graceful", "Running")
    await cluster.wait(lambda: "waiting" in cluster.log("graceful"), "the handler installed")
    started = time.monotonic()
    await api.delete("Pod", NS, "graceful", grace_s=20)
    assert (cluster.pod("graceful") or {})["metadata"]["deletionTimestamp"]  # still there
    await cluster.wait(lambda: cluster.pod("graceful") is None, "the pod removed")
    assert time.monotonic() - started < 10  # the handler's exit, not the 20 s grace
    assert "got SIGTERM" in cluster.log("graceful")
    last = cluster.last_seen("graceful")["status"]
    term = container_status(last)["state"]["terminated"]
    assert term["exitCode"] == 7
    assert last["phase"] == "Failed"  # a deleted pod ends terminal, as kubelets write it


async def test_a_probe_that_loses_its_cancellation_still_lets_the_pod_go(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Python 3.11 asyncio.wait_for drops a cancellation that lands as its inner call
    completes (gh-86296): a readiness probe answered by a server as it exits kept the probe
    loop, the pod's task, and so the pod (holding its Job's name) alive for good. The probes
    now end with the container's process; here every cancellation is lost, to show it."""
    probing = ProcessKubelet._probe_container

    async def deaf(self: ProcessKubelet, *args: Any) -> None:
        task = asyncio.ensure_future(probing(self, *args))
        while True:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                continue  # the cancellation wait_for dropped

    monkeypatch.setattr(ProcessKubelet, "_probe_container", deaf)
    probe = {"httpGet": {"path": "/", "port": 8081}, "periodSeconds": 1}
    container = {"readinessProbe": probe}
    await cluster.api.create(pod("served", SLOW_SERVER, container=container))
    await cluster.wait(
        lambda: condition(cluster.status("served"), "Ready").get("status") == "True",
        "the pod Ready",
    )
    await cluster.api.delete("Pod", NS, "served", grace_s=5)
    await cluster.wait(lambda: cluster.pod("served") is None, "the pod removed", timeout=15)


async def test_grace_period_expiry_sends_sigkill(cluster: Cluster) -> None:
    api = cluster.api
    await api.create(pod("stubborn", IGNORE_TERM, terminationGracePeriodSeconds=1))
    await cluster.phase("stubborn", "Running")
    await cluster.wait(lambda: "waiting" in cluster.log("stubborn"), "SIGTERM ignored")
    started = time.monotonic()
    await api.delete("Pod", NS, "stubborn")
    await cluster.wait(lambda: cluster.pod("stubborn") is None, "the pod removed")
    assert time.monotonic() - started >= 0.9
    term = container_status(cluster.last_seen("stubborn")["status"])["state"]["terminated"]
    assert term["exitCode"] == 137  # 128 + SIGKILL


async def test_crash_restarts_in_place_and_eviction_marks_disruption(cluster: Cluster) -> None:
    spec = pod("crashy", IGNORE_TERM, restartPolicy="Always", terminationGracePeriodSeconds=1)
    await cluster.api.create(spec)
    await cluster.phase("crashy", "Running")
    await cluster.wait(lambda: "waiting" in cluster.log("crashy"), "the container up")
    cluster.kubelet.kill_process(NS, "crashy", signal.SIGKILL)

    def restarted() -> bool:
        cs = (cluster.status("crashy").get("containerStatuses") or [{}])[0]
        return cs.get("restartCount") == 1 and "running" in cs.get("state", {})

    await cluster.wait(restarted, "an in-place restart")
    status = cluster.status("crashy")
    assert container_status(status)["lastState"]["terminated"]["exitCode"] == 137
    await cluster.wait(lambda: cluster.log("crashy").count("waiting") == 2, "the second run")
    await cluster.kubelet.evict(NS, "crashy")
    await cluster.wait(lambda: cluster.pod("crashy") is None, "the evicted pod removed")
    last = cluster.last_seen("crashy")["status"]
    assert condition(last, "DisruptionTarget")["reason"] == "EvictionByEvictionAPI"


def restarts(runs_s: list[float]) -> list[float]:
    """The waits before each restart of a container that runs `runs_s[i]` seconds each time,
    driven as the kubelet drives CrashLoopBackOff (doBackOff: IsInBackOffSince, then Next)."""
    backoff, now, waits = CrashLoopBackOff(), 0.0, []
    for run in runs_s:
        now += run  # it exits
        finished = now
        wait = backoff.delay_s("pod/main", finished, now)
        waits.append(wait)
        now += wait
        backoff.next("pod/main", finished, now)  # and starts again
    return waits


def test_crash_loop_backoff_is_the_kubelets_sequence() -> None:
    """Immediate, then 10 s doubling to 5 min; 10 minutes of running resets it."""
    assert restarts([1.0] * 9) == [0, 10, 20, 40, 80, 160, 300, 300, 300]
    # A run shorter than 2 x 5 min after its restart keeps the back-off; a longer one resets it.
    assert restarts([1.0] * 4 + [590.0, 1.0])[-2:] == [80, 160]
    assert restarts([1.0] * 4 + [610.0, 1.0, 1.0])[-3:] == [0, 10, 20]
    assert go_duration(80) == "1m20s" and go_duration(300) == "5m0s" and go_duration(10) == "10s"


async def test_crash_looping_container_waits_longer_each_time(cluster: Cluster) -> None:
    """The first restart at once, then CrashLoopBackOff with the kubelet's message (10 s, 20 s
    in the message; TIME_SCALE of them here)."""
    started = time.monotonic()
    await cluster.api.create(pod("looping", "raise SystemExit(3)", restartPolicy="Always"))

    def waiting_message() -> str:
        cs = (cluster.status("looping").get("containerStatuses") or [{}])[0]
        waiting = cs.get("state", {}).get("waiting", {})
        return waiting.get("message", "") if waiting.get("reason") == "CrashLoopBackOff" else ""

    first = await cluster.wait(waiting_message, "the first CrashLoopBackOff")
    assert first.startswith("back-off 10s restarting failed container=main pod=looping_default(")
    count = container_status(cluster.status("looping"))["restartCount"]
    assert count == 1  # the first restart did not wait
    second = await cluster.wait(
        lambda: "back-off 20s" in waiting_message() and waiting_message(), "the second back-off"
    )
    assert container_status(cluster.status("looping"))["restartCount"] == 2
    assert second.startswith("back-off 20s")
    assert time.monotonic() - started >= 10 * TIME_SCALE
    await cluster.api.delete("Pod", NS, "looping")


# --- scheduling -------------------------------------------------------------------------------


async def test_gpu_request_stays_pending_unschedulable(cluster: Cluster) -> None:
    api = cluster.api
    resources = {"limits": {"nvidia.com/gpu": "1", "cpu": "100m"}}
    await api.create(pod("gpu", "print('never')", container={"resources": resources}))
    volumes = [{"name": "c", "persistentVolumeClaim": {"claimName": "absent"}}]
    await api.create(pod("claimless", "print('never')", volumes=volumes))

    def unschedulable(name: str) -> Obj:
        cond = condition(cluster.status(name), "PodScheduled")
        return cond if cond.get("status") == "False" else {}

    cond = await cluster.wait(lambda: unschedulable("gpu"), "the GPU pod marked unschedulable")
    assert cond["reason"] == "Unschedulable"
    assert cond["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    cond = await cluster.wait(lambda: unschedulable("claimless"), "the claimless pod")
    assert cond["message"] == '0/1 nodes are available: persistentvolumeclaim "absent" not found.'
    await asyncio.sleep(0.3)
    gpu = cluster.pod("gpu") or {}
    assert "nodeName" not in gpu["spec"] and gpu["status"]["phase"] == "Pending"
    assert not cluster.log("gpu")
    # Nothing but the GPU keeps it from running here.
    assert pod_problems(gpu, api) == []
    assert scheduling_problems(gpu, cluster.kubelet.capacity) == ["Insufficient nvidia.com/gpu"]


# --- teardown ---------------------------------------------------------------------------------


def _leftovers() -> list[str]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [w for w in (links + names).split() if w.startswith("gspo-") and ":" not in w]
    found += [ln.split(":")[1].strip() for ln in links.splitlines() if "gspo-" in ln]
    found += [str(p) for p in NETNS_ETC.glob("gspo-*")]
    return found


async def test_close_removes_namespaces_bridge_and_mount_points(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the local cluster's node needs network namespaces: {reason}")
    # A crashed earlier run's namespace is cleared when the next kubelet starts.
    subprocess.run(["ip", "netns", "add", "gspo-pod-250"], check=True)
    (NETNS_ETC / "gspo-pod-250").mkdir(parents=True, exist_ok=True)
    crashed_mount = Path("/gspo-kubelet-test-crashed")
    crashed_mount.mkdir()
    ledger = PodNetwork().lock_path.with_name("gspo-podnet-mountpoints.txt")
    ledger.write_text(f"{crashed_mount}\n")
    mount_root = Path("/gspo-kubelet-test-teardown")
    assert not mount_root.exists()
    async with ClusterApiServer() as api:
        kubelet = ProcessKubelet(api, tmp_path / "node")
        stop = asyncio.Event()
        task = asyncio.create_task(kubelet.run(stop))
        cluster = Cluster(api, kubelet, task)
        mounts = [{"name": "e", "mountPath": f"{mount_root}/deep/dir"}]
        volumes = [{"name": "e", "emptyDir": {}}]
        code = "import socket, time; print(socket.gethostname(), flush=True); time.sleep(60)"
        await api.create(
            pod("lingering", code, volumes=volumes, container={"volumeMounts": mounts})
        )
        await cluster.phase("lingering", "Running")
        await cluster.wait(lambda: "lingering" in cluster.log("lingering"), "the pod up")
        assert not (NETNS_ETC / "gspo-pod-250").exists()
        assert not crashed_mount.exists()
        assert mount_root.is_dir()
        assert _leftovers()  # the bridge, the pod's namespace and veth exist now
        stop.set()
        await task
        await kubelet.close()
    assert _leftovers() == []
    assert not mount_root.exists() and not ledger.exists()
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert kubelet.network.gateway not in addresses
