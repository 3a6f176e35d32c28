"""The node of the local cluster: kube-scheduler and kubelet for one machine, with processes.

Why: the operator's end-to-end tests need pods that really run (the trainer's `gspo`
commands), talk over real sockets by the DNS names the operator renders, read the Secrets
and ConfigMaps it creates, share its checkpoint volume, and go through the states the
operator reacts to (Pending for GPUs, CreateContainerConfigError, Ready, graceful deletion,
crashes). `ProcessKubelet` watches the `ClusterApiServer` store (polling every `poll_s`) and
does for its pods what kube-scheduler and a kubelet with a container runtime would.

Modelled:
- scheduling: binding (spec.nodeName) when the pod's requests fit the free capacity (cpu and
  memory of this machine unless given, ephemeral-storage = the disk, 110 pods, extended
  resources such as nvidia.com/gpu 0 unless `extended` says otherwise; limits without
  requests count as requests; init containers as max, overhead added), nodeSelector and
  required node affinity against the node's labels (kubernetes.io/hostname, os, arch and
  `node_labels`), schedulingGates (SchedulingGated), a missing or terminating
  PersistentVolumeClaim, and with `volume_binding` one not Bound yet ("pod has unbound
  immediate PersistentVolumeClaims"); otherwise PodScheduled=False, reason Unschedulable with
  kube-scheduler's message ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu."; the
  " preemption: ..." suffix newer versions append is left out). Pods naming another
  schedulerName are left alone.
- admission checks of the kubelet: env (value with $(VAR) expansion and $$ escape; valueFrom
  secretKeyRef/configMapKeyRef honouring `optional`, fieldRef, resourceFieldRef; envFrom with
  prefix), runAsNonRoot, volumes (emptyDir, configMap, secret, downwardAPI, projected
  secret/configMap/downwardAPI sources, persistentVolumeClaim). A failing env source leaves
  the container Waiting/CreateContainerConfigError with the kubelet's message; a missing
  volume source leaves the pod ContainerCreating (events FailedMount say why); kinds this node
  cannot provide (hostPath, csi, nfs, serviceAccountToken projections, ...) are reported
  by `pod_problems` and keep the pod ContainerCreating.
- containers as processes: `ip netns exec <pod ns> unshare --mount --propagation private
  --uts python pod_init.py SPEC`, which bind-mounts the volumes (readOnly remounted
  read-only; configMap/secret/downwardAPI/projected always read-only as in Kubernetes),
  sets the hostname, switches to runAsUser/runAsGroup with fsGroup and supplementalGroups
  as supplementary groups (no_new_privs when allowPrivilegeEscalation is false), chdirs to
  workingDir (default "/", as an image without WORKDIR) and execs command+args
  ($(VAR)-expanded from the container env). command[0] is looked up in `command_map` (by
  default gspo/python/python3 of the venv beside sys.executable), else in the container's
  PATH. Environment: PATH (the venv's bin first, as an image's ENV would) and `image_env`,
  HOSTNAME and HOME (as the runtime sets them), then the container's env. stdout and stderr
  go to `log_path(ns, pod, container)` (appended across restarts).
- volumes: emptyDir a fresh 0777 directory per pod (medium Memory is a plain directory too,
  sizeLimit not enforced), configMap/secret/downwardAPI files written once at pod start
  (items, path, mode, defaultMode honoured; no ..data symlink updates), one directory per
  PVC under workdir/pvc/<ns>/<claim>, created 0755 root (as a provisioner whose volumes root
  owns: a non-root pod needs fsGroup to write) and shared by every pod that mounts it, subPath
  and subPathExpr; fsGroup ownership as the kubelet's volume ownership management does it
  (chgrp, g+rwX, setgid directories). Mount points missing on the host are created and, when
  still empty, removed by `close()` (or by the next kubelet's start after a crash: they are
  listed in /run/lock/gspo-podnet-mountpoints.txt, guarded by the network's lock).
- status as the kubelet writes it: phase (the kubelet's getPhase rules), conditions
  PodScheduled, PodReadyToStartContainers, Initialized, ContainersReady, Ready (readiness
  gates honoured; foreign conditions such as DisruptionTarget kept), podIP(s), hostIP(s) (the
  bridge gateway, the node's address as pods see it), startTime, qosClass,
  (init)containerStatuses with state running/waiting/terminated, lastState, restartCount,
  ready, started; termination messages from terminationMessagePath (a per-container file
  bind-mounted there) or FallbackToLogsOnError (the last 80 lines / 2048 bytes of the log).
- probes (startup gating readiness and liveness; httpGet HTTP/HTTPS with headers and named
  ports, tcpSocket, exec inside the container's namespaces) run from the root namespace with
  initialDelaySeconds/periodSeconds multiplied by `probe_period_scale`, timeoutSeconds,
  success/failureThreshold; a failed liveness/startup probe kills the container (SIGTERM, the
  grace period, SIGKILL) and restartPolicy decides; a container's probes stop when its
  process exits (as the prober's workers do), not only when their task is cancelled.
- restartPolicy Always/OnFailure: in-place restarts with the kubelet's CrashLoopBackOff
  (backoff.py: the first restart at once, then 10 s doubling to 5 min, back to 10 s after 10
  minutes of running; every duration times `time_scale`, TIME_SCALE by default, on `clock`),
  waiting reason CrashLoopBackOff with the kubelet's message (the unscaled duration, "back-off
  20s restarting failed container=...") in between; Never ends the container. Init
  containers run in order before the others (a failure under Never fails the pod).
- graceful deletion: SIGTERM to each container's main process (what the runtime sends to
  PID 1), deletionGracePeriodSeconds x `grace_scale`, then SIGKILL to its process group; exit
  codes as runtimes report them (128+signal); the final status (terminal phase, as kubelets
  with PodDisruptionConditions write it) goes into the store, then the pod is removed with
  a grace period of 0 (the DELETED event carries that status). While a pod terminates this
  kubelet writes no other status (a real one does: containers' states as they stop).
  `evict()` is the Eviction API (DisruptionTarget condition, then a graceful delete);
  `kill_process()` is a crash.
- DNS (CoreDNS stand-in, through each pod's /etc/hosts): `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc`
  and `<svc>.<ns>.svc.cluster.local` for every Service with a selector, resolving to the IPs
  of the selected pods that are Ready (or all when publishNotReadyAddresses); for headless
  Services also `<hostname>.<subdomain>` (same namespace), `<hostname>.<subdomain>.<ns>`,
  `.svc` and `.svc.cluster.local` of selected pods whose subdomain names the Service (as
  CoreDNS serves them from the EndpointSlices); each pod's own hostname (and FQDN with a
  subdomain) and hostAliases, as the kubelet's hosts file has them. Names appear from every
  namespace as a pod's search path would make them resolve.
- NetworkPolicy (netpol.py): the policies in the store as nftables rules in each pod's network
  namespace (ingress and egress, default deny for selected pods, pod/namespace/ipBlock peers,
  ports, named ports, endPort), loaded before a pod's first container starts and reloaded when
  pods, labels or policies change; traffic from the node (probes) always passes.
- Events (best effort, deduplicated): Scheduled, FailedScheduling, FailedMount,
  FailedCreatePodSandBox, Failed, Started, Killing, Unhealthy, BackOff.

Not modelled: cgroups (no cpu/memory limit enforcement, no OOMKilled), images (the image
field is ignored: the host's filesystem is every container's root and is writable;
readOnlyRootFilesystem, capabilities and seccomp are not applied), a PID namespace (the
main process is not PID 1; once it exits, the container's other processes are killed: its
process group, and those that called setsid, found by an environment variable every process
of the container inherits), kube-proxy (a ClusterIP Service
name resolves straight to the ready pods' IPs and port/targetPort mapping does not happen),
service-link and KUBERNETES_SERVICE_* variables, a service-account token mount,
hostNetwork/hostPID/hostIPC, hostPort, runtimeClassName, sidecar (restartPolicy Always) init
containers, ephemeral containers, lifecycle hooks (postStart/preStop), grpc probes,
activeDeadlineSeconds, image pull states, node conditions or pressure eviction, PDBs,
taints, more than one node, ConfigMap/Secret updates reaching running pods. A non-root
container could not even run the venv's interpreter when it lives under a directory others
cannot traverse (/root/.pyenv here): such a directory is covered, in that container only,
by a tmpfs holding just the needed subtrees, as an image would ship them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import math
import os
import platform
import pwd
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backoff import (
    CRASH_LOOP_BACKOFF_MAX_S,
    CRASH_LOOP_BACKOFF_S,
    TIME_SCALE,
    CrashLoopBackOff,
    go_duration,
)
from netns import Endpoint, PodNetwork
from netpol import NO_RULES, PodAddress, apply_ruleset, pod_ruleset

if TYPE_CHECKING:
    from apiserver import ClusterApiServer

Obj = dict[str, Any]

POD_INIT = Path(__file__).with_name("pod_init.py")
CHECKOUT = Path(__file__).resolve().parents[2]  # the source an editable install imports


def image_paths(argv: list[str]) -> list[str]:
    """What stands in for the container image: the interpreter, the venv and this checkout.

    A pod's volume mounted over one of their parents (an emptyDir at /tmp, with the checkout
    under /tmp) must not hide them, as volumes never hide an image's own files: pod_init
    binds each back where a mount covered it."""
    paths = {sys.prefix, sys.base_prefix, str(CHECKOUT), os.path.dirname(os.path.realpath(argv[0]))}
    return sorted(p for p in paths if p and os.path.isdir(p))


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
DEFAULT_GRACE_S = 30.0
MAX_PODS = 110
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048
MANAGED_CONDITIONS = (
    "PodScheduled",
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
)
TERMINAL = ("Succeeded", "Failed")
UNSUPPORTED_VOLUMES = "cannot be provided by this node"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- quantities and scheduling ---------------------------------------------------------------

_SUFFIXES = {
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}
_QUANTITY = re.compile(
    r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?"
)


def parse_quantity(value: str | float) -> float:
    """A Kubernetes resource quantity ("500m", "4Gi", "1e3", 2) as a float."""
    if isinstance(value, int | float):
        return float(value)
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None:
        raise ValueError(f"not a quantity: {value!r}")
    return float(m.group(1)) * _SUFFIXES[m.group(2) or ""]


def _container_requests(container: Obj) -> dict[str, float]:
    resources = container.get("resources") or {}
    # The API server defaults an unset request to its limit.
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {k: parse_quantity(v) for k, v in merged.items()}


def pod_requests(pod: Obj) -> dict[str, float]:
    """What kube-scheduler counts for a pod: containers summed, init containers as max."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = defaultdict(float)
    for c in spec.get("containers") or []:
        for k, v in _container_requests(c).items():
            total[k] += v
    for c in spec.get("initContainers") or []:
        for k, v in _container_requests(c).items():
            total[k] = max(total[k], v)
    for k, v in (spec.get("overhead") or {}).items():
        total[k] += parse_quantity(v)
    total["pods"] = 1
    return dict(total)


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where a pending task waits: its coroutines' chain of awaits, outermost first (a
    task's get_stack() gives only the outermost frame of a suspended coroutine)."""
    parts, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        parts.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(parts)


def node_capacity(
    extended: dict[str, int] | None = None,
    cpu: float | None = None,
    memory: float | None = None,
    disk: Path = Path("/"),
) -> dict[str, float]:
    """This machine as a node: cpus, memory, disk, 110 pods, `extended` resources."""
    if memory is None:
        memory = 0.0
        with contextlib.suppress(OSError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = float(line.split()[1]) * 1024
    cap = {
        "cpu": float(cpu if cpu is not None else os.cpu_count() or 1),
        "memory": float(memory),
        "ephemeral-storage": float(shutil.disk_usage(disk).total),
        "pods": float(MAX_PODS),
    }
    cap.update({k: float(v) for k, v in (extended or {}).items()})
    return cap


def scheduling_problems(pod: Obj, capacity: dict[str, float]) -> list[str]:
    """Resources the pod requests beyond `capacity` (free capacity), as kube-scheduler says.

    Any resource missing from `capacity` (nvidia.com/gpu on this machine) has none.
    """
    out = []
    for name, amount in pod_requests(pod).items():
        if amount > 0 and amount > capacity.get(name, 0.0) + 1e-9:
            out.append("Too many pods" if name == "pods" else f"Insufficient {name}")
    return sorted(out)


def _match_expression(expr: Obj, values: dict[str, str]) -> bool:
    key, op, want = expr.get("key", ""), expr.get("operator", "In"), expr.get("values") or []
    have = values.get(key)
    if op == "In":
        return have in want
    if op == "NotIn":
        return have not in want
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and want:
        try:
            a, b = int(have), int(want[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def node_selection_problems(pod: Obj, labels: dict[str, str], node_name: str) -> list[str]:
    """nodeSelector and required node affinity against this node's labels."""
    spec = pod.get("spec") or {}
    ok = all(labels.get(k) == v for k, v in (spec.get("nodeSelector") or {}).items())
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = affinity.get("nodeSelectorTerms") or []
    if terms:
        fields = {"metadata.name": node_name}
        ok = ok and any(
            all(_match_expression(e, labels) for e in t.get("matchExpressions") or [])
            and all(_match_expression(e, fields) for e in t.get("matchFields") or [])
            for t in terms
        )
    return [] if ok else ["node(s) didn't match Pod's node affinity/selector"]


def unschedulable_message(problems: Iterable[str]) -> str:
    """kube-scheduler's FailedScheduling text for a one-node cluster."""
    return "0/1 nodes are available: " + ", ".join(f"1 {p}" for p in sorted(problems)) + "."


# --- env, volumes and the kubelet's admission checks -----------------------------------------


class ConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError."""


class StartFailure(Exception):
    """What a container runtime reports as StartError (exit code 128)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names replaced, `$$` -> `$`, the rest kept."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end == -1:
                    out.append(text[i:])
                    break
                name = text[i + 2 : end]
                out.append(env[name] if name in env else text[i : end + 1])
                i = end + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _decode(data: str) -> str:
    return base64.b64decode(data).decode(errors="replace")


def _pod_ips(pod: Obj) -> tuple[str, str]:
    status = pod.get("status") or {}
    return status.get("podIP", ""), status.get("hostIP", "")


_SUBSCRIPT = re.compile(r"metadata\.(labels|annotations)\['(.*)'\]")


def field_value(pod: Obj, path: str, pod_ip: str = "", host_ip: str = "") -> str:
    """A downward-API fieldRef value, as the kubelet resolves it."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = _SUBSCRIPT.fullmatch(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        values = meta.get(path.split(".")[1]) or {}
        return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))
    raise ConfigError(f"unsupported fieldPath: {path}")


def resource_value(
    pod: Obj, container: Obj, ref: Obj, capacity: dict[str, float] | None = None
) -> str:
    """A resourceFieldRef value: limits default to the node's allocatable, rounded up."""
    name = ref.get("containerName")
    if name:
        found = [c for c in (pod.get("spec") or {}).get("containers") or [] if c["name"] == name]
        if not found:
            raise ConfigError(f"container {name} not found")
        container = found[0]
    section, _, resource = ref.get("resource", "").partition(".")
    resources = container.get("resources") or {}
    raw = (resources.get(section) or {}).get(resource)
    if raw is None and section == "requests":
        raw = (resources.get("limits") or {}).get(resource)  # defaulted from the limit
    if raw is not None:
        value = parse_quantity(raw)
    else:  # an unset limit is the node's allocatable; an unset request is 0
        value = (capacity or {}).get(resource, 0.0) if section == "limits" else 0.0
    divisor = parse_quantity(ref.get("divisor") or "1") or 1.0
    return str(math.ceil(value / divisor - 1e-9))


def _key_source(api: ClusterApiServer, ns: str, ref: Obj, kind: str) -> str | None:
    """A secretKeyRef/configMapKeyRef value; None when optional and absent."""
    name, key = ref.get("name", ""), ref.get("key", "")
    obj = api.get(kind, ns, name)
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind.lower()} "{name}" not found')
    if kind == "Secret":
        data = obj.get("data") or {}
        if key in data:
            return _decode(data[key])
    else:
        if key in (obj.get("data") or {}):
            return obj["data"][key]
        if key in (obj.get("binaryData") or {}):
            return _decode(obj["binaryData"][key])
    if ref.get("optional"):
        return None
    raise ConfigError(f"couldn't find key {key} in {kind} {ns}/{name}")


def container_env(
    pod: Obj,
    container: Obj,
    api: ClusterApiServer,
    pod_ip: str = "",
    host_ip: str = "",
    capacity: dict[str, float] | None = None,
) -> dict[str, str]:
    """The container's env as the kubelet builds it (envFrom, then env, in order).

    Raises ConfigError with the kubelet's message when a source is missing.
    """
    ns = (pod.get("metadata") or {}).get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, ref in (
            ("ConfigMap", source.get("configMapRef")),
            ("Secret", source.get("secretRef")),
        ):
            if ref is None:
                continue
            obj = api.get(kind, ns, ref.get("name", ""))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind.lower()} "{ref.get("name", "")}" not found')
            data = obj.get("data") or {}
            for k, v in data.items():
                if "=" not in k:  # invalid names are skipped (with an event) by the kubelet
                    env[prefix + k] = _decode(v) if kind == "Secret" else v
    for var in container.get("env") or []:
        name = var["name"]
        source = var.get("valueFrom")
        if source is None:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"].get("fieldPath", ""), pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            value = resource_value(pod, container, source["resourceFieldRef"], capacity)
        elif "secretKeyRef" in source:
            value = _key_source(api, ns, source["secretKeyRef"], "Secret")
        elif "configMapKeyRef" in source:
            value = _key_source(api, ns, source["configMapKeyRef"], "ConfigMap")
        else:
            raise ConfigError(f"unsupported valueFrom for env {name}: {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def security(pod: Obj, container: Obj) -> tuple[int | None, int | None, list[int], bool]:
    """(uid, gid, supplementary groups, no_new_privs) for a container; checks runAsNonRoot."""
    psc = (pod.get("spec") or {}).get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    groups = [int(g) for g in psc.get("supplementalGroups") or []]
    if psc.get("fsGroup") is not None:
        groups.insert(0, int(psc["fsGroup"]))
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")):
        meta = pod.get("metadata") or {}
        where = (
            f'(pod: "{meta.get("name")}_{meta.get("namespace")}({meta.get("uid")})", '
            f"container: {container['name']})"
        )
        if uid is None:
            raise ConfigError(f"container has runAsNonRoot and image will run as root {where}")
        if int(uid) == 0:
            raise ConfigError(f"container's runAsUser breaks non-root policy {where}")
    no_new_privs = csc.get("allowPrivilegeEscalation") is False
    if uid is not None and gid is None:
        gid = 0  # a numeric user unknown to the image runs with group 0, as containerd does
    return (
        None if uid is None else int(uid),
        None if gid is None else int(gid),
        groups,
        no_new_privs,
    )


def default_command_map() -> dict[str, str]:
    """gspo and python resolve to the venv this test runs in (the pods' "image")."""
    bindir = Path(sys.executable).parent
    return {
        "gspo": str(bindir / "gspo"),
        "python": str(bindir / "python"),
        "python3": str(bindir / "python"),
    }


def resolve_argv(container: Obj, env: dict[str, str], command_map: dict[str, str]) -> list[str]:
    """command + args, expanded, with argv[0] an absolute path (StartFailure otherwise)."""
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    argv = [expand(str(w), env) for w in words]
    if not argv:
        raise StartFailure(
            "no command: images are not modelled, so a container needs command (or args)"
        )
    exe = argv[0]
    if exe in command_map:
        path: str | None = command_map[exe]
    elif "/" in exe:
        path = exe if os.access(exe, os.X_OK) else None
    else:
        path = shutil.which(exe, path=env.get("PATH", DEFAULT_PATH))
    if not path:
        raise StartFailure(f'exec: "{exe}": executable file not found in $PATH')
    return [path, *argv[1:]]


def _volume_kind(volume: Obj) -> str:
    return next((k for k in volume if k != "name"), "unknown")


def _projection_problems(name: str, source: Obj, api: ClusterApiServer, ns: str) -> list[str]:
    out = []
    for kind, ref, ref_name, what in (
        (
            "ConfigMap",
            source.get("configMap"),
            "name",
            "configmap references non-existent config key",
        ),
        ("Secret", source.get("secret"), "secretName", "references non-existent secret key"),
    ):
        if ref is None:
            continue
        obj_name = ref.get(ref_name) or ref.get("name", "")
        obj = api.get(kind, ns, obj_name)
        prefix = f'MountVolume.SetUp failed for volume "{name}" : '
        if obj is None:
            if not ref.get("optional"):
                out.append(prefix + f'{kind.lower()} "{obj_name}" not found')
            continue
        keys = set(obj.get("data") or {}) | set(obj.get("binaryData") or {})
        for item in ref.get("items") or []:
            if item["key"] not in keys and not ref.get("optional"):
                out.append(prefix + f"{what}: {item['key']}")
    return out


def volume_problems(pod: Obj, api: ClusterApiServer) -> list[str]:
    """Why the kubelet could not set up this pod's volumes (empty when it can)."""
    ns = (pod.get("metadata") or {}).get("namespace", "default")
    out: list[str] = []
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        name = vol["name"]
        if "emptyDir" in vol or "downwardAPI" in vol:
            continue
        if "configMap" in vol:
            out += _projection_problems(name, {"configMap": vol["configMap"]}, api, ns)
        elif "secret" in vol:
            out += _projection_problems(name, {"secret": vol["secret"]}, api, ns)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"].get("claimName", "")
            obj = api.get("PersistentVolumeClaim", ns, claim)
            if obj is None:
                out.append(f'persistentvolumeclaim "{claim}" not found')
            elif (obj.get("metadata") or {}).get("deletionTimestamp"):
                out.append(f'persistentvolumeclaim "{claim}" is being deleted')
        elif "projected" in vol:
            for source in vol["projected"].get("sources") or []:
                if "configMap" in source or "secret" in source:
                    out += _projection_problems(name, source, api, ns)
                elif "downwardAPI" not in source:
                    kind = next(iter(source), "unknown")
                    out.append(f'volume "{name}" (projected {kind}) {UNSUPPORTED_VOLUMES}')
        else:
            out.append(f'volume "{name}" ({_volume_kind(vol)}) {UNSUPPORTED_VOLUMES}')
    return out


# kube-scheduler's VolumeBinding PreFilter (pkg/scheduler/framework/plugins/volumebinding,
# ErrReasonUnboundImmediatePVC). WaitForFirstConsumer claims wait the same way here, where
# the real scheduler picks a node first and waits in PreBind for the provisioner.
UNBOUND_CLAIMS = "pod has unbound immediate PersistentVolumeClaims"


def _unbound_claims(pod: Obj, api: ClusterApiServer) -> list[str]:
    ns = pod["metadata"].get("namespace", "default")
    out = []
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        name = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        claim = api.get("PersistentVolumeClaim", ns, name) if name else None
        if claim is not None and (claim.get("status") or {}).get("phase") != "Bound":
            out.append(name)
    return out


def pod_problems(
    pod: Obj, api: ClusterApiServer, command_map: dict[str, str] | None = None
) -> list[str]:
    """Every reason this pod could not start on this node, resources aside.

    Why: a test of rendered pods that cannot run here (they want GPUs) checks that nothing
    but the resources (`scheduling_problems`) stands in the way: Secrets, ConfigMaps and
    claims exist, keys resolve, commands map to executables, volume kinds are supported.
    """
    spec = pod.get("spec") or {}
    cmap = {**default_command_map(), **(command_map or {})}
    out: list[str] = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            out.append(f"{flag} is not modelled by this node")
    if spec.get("ephemeralContainers"):
        out.append("ephemeral containers are not modelled by this node")
    out += volume_problems(pod, api)
    volumes = {v["name"] for v in spec.get("volumes") or []}
    pod_ip, host_ip = _pod_ips(pod)
    inits = [(c, True) for c in spec.get("initContainers") or []]
    for c, init in [*inits, *((c, False) for c in spec.get("containers") or [])]:
        where = f'container "{c["name"]}": '
        if init and c.get("restartPolicy") == "Always":
            out.append(where + "sidecar init containers are not modelled by this node")
        for mount in c.get("volumeMounts") or []:
            if mount["name"] not in volumes:
                out.append(where + f'volumeMount "{mount["name"]}" names no volume')
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "grpc" in (c.get(kind) or {}):
                out.append(where + f"{kind} grpc is not modelled by this node")
        try:
            security(pod, c)
            env = container_env(pod, c, api, pod_ip or "0.0.0.0", host_ip or "0.0.0.0")
        except ConfigError as e:
            out.append(where + str(e))
            continue
        try:
            resolve_argv(c, {"PATH": _image_path(), **env}, cmap)
        except StartFailure as e:
            out.append(where + str(e))
    return out


def _image_path() -> str:
    return f"{Path(sys.executable).parent}:{DEFAULT_PATH}"


def _hostname(pod: Obj) -> str:
    spec, name = pod.get("spec") or {}, pod["metadata"]["name"]
    return spec.get("hostname") or name[:63].rstrip("-.")


def _qualified(name: str, namespace: str) -> tuple[str, str, str]:
    """The names other namespaces resolve `name` of `namespace` by, as CoreDNS serves them."""
    return (
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
    )


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _apply_fs_group(root: Path, gid: int, read_only: bool = False) -> None:
    """The kubelet's volume ownership management: chgrp, g+rw(x), setgid directories.

    Read-only volumes (configMap, secret, ...) get g+r only, as the kubelet's mask for them.
    """
    file_bits = 0o040 if read_only else 0o060
    dir_bits = 0o2050 if read_only else 0o2070
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, None]:
            path = dirpath if name is None else os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            os.chown(path, -1, gid)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(path, mode | dir_bits)
            else:
                os.chmod(path, mode | file_bits | (0o010 if mode & 0o100 else 0))


def _blocked_ancestor(path: str) -> tuple[str, str] | None:
    """(a directory others cannot traverse, its child on the way to `path`) or None."""
    parts = Path(path).parts
    for i in range(1, len(parts) - 1):
        parent = Path(*parts[: i + 1])
        with contextlib.suppress(OSError):
            if not os.stat(parent).st_mode & 0o001:
                return str(parent), str(parent / parts[i + 1])
    return None


# --- the runtime's view of a pod --------------------------------------------------------------


# Every process of a container carries this variable (inherited by its children), so the
# container's processes are found and killed when its main process ends, as a container
# runtime's PID namespace would have them die, even those that started a session of their own.
CONTAINER_MARKER = "GSPO_LOCAL_CLUSTER_CONTAINER"


def _kill_rest(marker: str) -> int:
    """SIGKILL every process whose environment carries `marker`; how many there were."""
    needle = f"{CONTAINER_MARKER}={marker}".encode()
    killed = 0
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc_dir / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


@dataclass
class _Container:
    spec: Obj
    init: bool
    state: Obj = field(default_factory=dict)
    last_state: Obj = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    proc: asyncio.subprocess.Process | None = None
    container_id: str = ""
    env: dict[str, str] = field(default_factory=dict)
    user: tuple[int | None, int | None, list[int], bool] = (None, None, [], False)
    probe_runs: int = 0
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)  # see CONTAINER_MARKER

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self) -> Obj:
        out: Obj = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


class _PodRuntime:
    """One pod on this node: its containers, sandbox and what the status is made of."""

    def __init__(self, pod: Obj, workdir: Path) -> None:
        meta = pod["metadata"]
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta.get("namespace", "default")
        self.name: str = meta["name"]
        self.dir = workdir / "pods" / self.uid
        spec = pod.get("spec") or {}
        waiting = {"waiting": {"reason": "PodInitializing"}}
        creating = {"waiting": {"reason": "ContainerCreating"}}
        self.init = [_Container(c, True, dict(waiting)) for c in spec.get("initContainers") or []]
        main_state = waiting if self.init else creating
        self.main = [_Container(c, False, dict(main_state)) for c in spec.get("containers") or []]
        self.endpoint: Endpoint | None = None
        self.ip = ""
        self.start_time = _now()
        self.terminating = False
        self.removed = False
        self.done = False
        self.final_phase: str | None = None
        self.wake = asyncio.Event()
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.volumes: dict[str, tuple[Path, bool]] = {}
        self.last_status: Obj | None = None
        self.hosts = ""
        self.ruleset: str | None = None  # the nft script loaded into its netns (netpol.py)
        self.task: asyncio.Task[None] | None = None
        self.stoppers: list[asyncio.Task[None]] = []

    @property
    def spec(self) -> Obj:
        return self.pod.get("spec") or {}

    @property
    def restart_policy(self) -> str:
        return str(self.spec.get("restartPolicy", "Always"))

    @property
    def hostname(self) -> str:
        return _hostname(self.pod)

    def containers(self) -> list[_Container]:
        return [*self.init, *self.main]

    async def sleep(self, seconds: float) -> None:
        """Sleep, cut short when the pod starts terminating."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)

    def initialized(self) -> bool:
        return all(c.state.get("terminated", {}).get("exitCode") == 0 for c in self.init)

    def phase(self) -> str:
        """The kubelet's getPhase (pkg/kubelet/kubelet_pods.go)."""
        if self.final_phase:
            return self.final_phase
        policy = self.restart_policy
        for c in self.init:
            term = c.state.get("terminated")
            if term and term["exitCode"] == 0:
                continue
            if term and (policy == "Never" or self.done):
                return "Failed"
            return "Pending"
        running = stopped = succeeded = waiting = 0
        for c in self.main:
            if "running" in c.state:
                running += 1
            elif "terminated" in c.state:
                stopped += 1
                succeeded += c.state["terminated"]["exitCode"] == 0
            elif c.last_state.get("terminated"):
                stopped += 1
            else:
                waiting += 1
        if self.done and self.terminating:
            return "Succeeded" if stopped and stopped == succeeded and not waiting else "Failed"
        if waiting:
            return "Pending"
        if running:
            return "Running"
        if policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if policy == "Never" else "Running"

    def ready(self) -> bool:
        """Ready as Endpoints see it: containers ready, gates true, not going away."""
        if self.terminating or self.done or not self.main:
            return False
        if not all(c.ready for c in self.main):
            return False
        conds = {
            c["type"]: c["status"] for c in (self.pod.get("status") or {}).get("conditions") or []
        }
        gates = [g["conditionType"] for g in self.spec.get("readinessGates") or []]
        return all(conds.get(g) == "True" for g in gates)


# --- the kubelet ------------------------------------------------------------------------------


class ProcessKubelet:
    """kube-scheduler and kubelet of a one-node cluster whose containers are processes.

    api: the store; workdir: logs, pod and PVC directories; command_map: command[0] ->
    executable, over `default_command_map()`; extended: extended resources of the node
    (nvidia.com/gpu, ...; 0 when absent); cpu/memory: capacity instead of this machine's;
    node_labels: labels beyond kubernetes.io/hostname, os and arch; probe_period_scale:
    multiplies probes' initialDelaySeconds and periodSeconds (timeouts stay real) so tests need
    not wait 10 s periods; grace_scale: multiplies termination grace periods;
    time_scale: multiplies the CrashLoopBackOff's durations; clock: seconds, what those are
    measured with; image_env: variables an image would set;
    network: the pod network (default: 10.244.77.0/24 on bridge gspo-br0); events: write
    Events; poll_s: the reconcile period.
    """

    def __init__(
        self,
        api: ClusterApiServer,
        workdir: Path,
        command_map: dict[str, str] | None = None,
        node_name: str = "local",
        *,
        extended: dict[str, int] | None = None,
        cpu: float | None = None,
        memory: float | None = None,
        node_labels: dict[str, str] | None = None,
        probe_period_scale: float = 1.0,
        grace_scale: float = 1.0,
        time_scale: float = TIME_SCALE,
        clock: Callable[[], float] = time.monotonic,
        image_env: dict[str, str] | None = None,
        network: PodNetwork | None = None,
        events: bool = True,
        poll_s: float = 0.1,
        volume_binding: bool = False,
    ) -> None:
        self.api = api
        # kube-scheduler's VolumeBinding: a pod waits while a claim it mounts is not Bound.
        # On only where something binds claims (storage.StorageController); off, any claim
        # that exists will do, as before a PV controller was modelled.
        self.volume_binding = volume_binding
        self.workdir = Path(workdir)
        self.node_name = node_name
        self.command_map = {**default_command_map(), **(command_map or {})}
        disk = next(p for p in [self.workdir, *self.workdir.parents] if p.exists())
        self.capacity = node_capacity(extended, cpu, memory, disk)
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        self.labels = {
            "kubernetes.io/hostname": node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": arch,
            **(node_labels or {}),
        }
        self.probe_period_scale = probe_period_scale
        self.grace_scale = grace_scale
        self.time_scale = time_scale
        self.clock = clock
        self._crash_loop = CrashLoopBackOff(
            CRASH_LOOP_BACKOFF_S * time_scale, CRASH_LOOP_BACKOFF_MAX_S * time_scale
        )
        self.image_env = dict(image_env or {})
        self.network = network or PodNetwork()
        self.events = events
        self.poll_s = poll_s
        self._pods: dict[str, _PodRuntime] = {}
        self._created: list[Path] = []
        self._events_seen: set[tuple[str, str, str]] = set()
        self._started = False
        self._closed = False
        self.last_pass = time.monotonic()  # when the loop last finished a pass (diagnose())
        self._failures: list[asyncio.Task[None]] = []
        self._policy_lock = asyncio.Lock()
        # Mount points made on the host, listed beside the network's lock (which guards it).
        self._ledger = self.network.lock_path.with_name(
            self.network.lock_path.name.replace(".lock", "-mountpoints.txt")
        )

    # --- public API --------------------------------------------------------------------------

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """Where a container's stdout and stderr go (all its runs, appended)."""
        return self.workdir / "logs" / f"{namespace}_{pod}_{container}.log"

    async def run(self, stop: asyncio.Event) -> None:
        """Schedule and run pods until `stop` is set (then call `close()`)."""
        if not self._started:
            for sub in ("logs", "pods", "pvc"):
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            await self.network.setup()
            self._started = True
            _remove_empty(_read_ledger(self._ledger))  # what a crashed run left
            self._ledger.unlink(missing_ok=True)
        while not stop.is_set():
            await self._reconcile()
            self.last_pass = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    def diagnose(self) -> str:
        """How long since the loop's last pass, and where each pod's task waits: what a test
        that timed out needs to tell a stalled node from a slow pod."""
        lines = [f"kubelet: last pass {time.monotonic() - self.last_pass:.1f} s ago"]
        for rt in self._pods.values():
            state = f"done={rt.done} terminating={rt.terminating} removed={rt.removed}"
            where = ""
            if rt.task is not None and not rt.task.done():
                where = " at " + awaiting(rt.task)
            lines.append(f"pod {rt.ns}/{rt.name}: {state}{where}")
        return "\n".join(lines)

    async def close(self) -> None:
        """Kill every pod's processes (SIGKILL), then remove namespaces, bridge, mount points."""
        if self._closed:
            return
        self._closed = True
        for rt in list(self._pods.values()):
            rt.removed = True
            self._terminate(rt, 0.0)
        tasks = [rt.task for rt in self._pods.values() if rt.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=15)
        for rt in list(self._pods.values()):
            self._forget(rt)
        if self._started:
            await self.network.teardown()
        _remove_empty(self._created)
        self._created.clear()
        self._ledger.unlink(missing_ok=True)

    async def evict(self, namespace: str, name: str) -> None:
        """The Eviction API: a DisruptionTarget condition, then a graceful delete (no PDBs)."""
        pod = self.api.get("Pod", namespace, name)
        if pod is None:
            raise LookupError(f"pod {namespace}/{name} does not exist")
        conditions = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") != "DisruptionTarget"
        ]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": _now(),
            }
        )
        await self.api.patch_status("Pod", namespace, name, {"conditions": conditions})
        await self.api.delete("Pod", namespace, name)

    def kill_process(
        self, namespace: str, name: str, sig: int = signal.SIGKILL, container: str | None = None
    ) -> None:
        """Signal a container's main process directly (a crash); the first container by default.

        The kubelet then sees an ordinary exit (128+signal unless the process handles it).
        """
        for rt in self._pods.values():
            if rt.ns == namespace and rt.name == name and not rt.done:
                for c in rt.containers():
                    if c.proc is not None and (container is None or c.name == container):
                        os.kill(c.proc.pid, sig)
                        return
        raise LookupError(f"no running container in pod {namespace}/{name}")

    def netns_of(self, namespace: str, name: str) -> str:
        """The network namespace a running pod's containers are in (to act as that pod)."""
        for rt in self._pods.values():
            if rt.ns == namespace and rt.name == name and rt.endpoint is not None:
                return rt.endpoint.netns
        raise LookupError(f"pod {namespace}/{name} has no network namespace")

    # --- the loop ----------------------------------------------------------------------------

    def _pod_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failures.append(task)

    async def _reconcile(self) -> None:
        if self._failures:  # a bug here, not a pod's fault: stop loudly
            task = self._failures[0]
            raise RuntimeError(f"the kubelet's {task.get_name()} failed") from task.exception()
        live: set[str] = set()
        pending: list[Obj] = []
        for pod in list(self.api.list_kind("Pod")):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            uid = meta["uid"]
            live.add(uid)
            node = spec.get("nodeName")
            if not node:
                if not meta.get("deletionTimestamp"):
                    pending.append(pod)
                continue
            if node != self.node_name:
                continue
            rt = self._pods.get(uid)
            if rt is not None:
                rt.pod = pod
            if meta.get("deletionTimestamp"):
                if rt is None or (rt.done and not rt.terminating):
                    self.api.remove_pod(meta.get("namespace", ""), meta["name"])
                    if rt is not None:
                        self._forget(rt)
                elif not rt.terminating:
                    grace = float(meta.get("deletionGracePeriodSeconds", DEFAULT_GRACE_S))
                    self._event(rt.pod, "Normal", "Killing", "Stopping container")
                    self._terminate(rt, grace * self.grace_scale)
                continue
            if rt is None and (pod.get("status") or {}).get("phase") not in TERMINAL:
                rt = _PodRuntime(pod, self.workdir)
                self._pods[uid] = rt
                rt.task = asyncio.create_task(self._run_pod(rt), name=f"pod {rt.ns}/{rt.name}")
                rt.task.add_done_callback(self._pod_task_done)
        for uid, rt in list(self._pods.items()):
            if uid not in live and not rt.removed:
                rt.removed = True  # force-deleted: nobody waits for a graceful stop
                self._terminate(rt, 0.0)
                if rt.done:
                    self._forget(rt)
        await self._schedule(pending)
        await self._sync_statuses()
        self._sync_dns()
        await self._sync_policies()

    # --- scheduling --------------------------------------------------------------------------

    def _free_capacity(self) -> dict[str, float]:
        free = dict(self.capacity)
        for pod in self.api.list_kind("Pod"):
            spec = pod.get("spec") or {}
            if spec.get("nodeName") != self.node_name:
                continue
            if (pod.get("status") or {}).get("phase") in TERMINAL:
                continue
            for k, v in pod_requests(pod).items():
                free[k] = free.get(k, 0.0) - v
        return free

    async def _schedule(self, pending: list[Obj]) -> None:
        if not pending:
            return
        free = self._free_capacity()
        for pod in pending:
            meta, spec = pod["metadata"], pod.get("spec") or {}
            ns, name = meta.get("namespace", "default"), meta["name"]
            if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            if spec.get("schedulingGates"):
                await self._set_unscheduled(
                    pod,
                    "SchedulingGated",
                    "Scheduling is blocked due to non-empty scheduling gates",
                )
                continue
            claims = [
                p for p in volume_problems(pod, self.api) if p.startswith("persistentvolumeclaim ")
            ]
            if not claims and self.volume_binding and _unbound_claims(pod, self.api):
                claims = [UNBOUND_CLAIMS]
            if claims:
                await self._set_unscheduled(
                    pod, "Unschedulable", f"0/1 nodes are available: {claims[0]}."
                )
                continue
            problems = node_selection_problems(pod, self.labels, self.node_name)
            problems = problems or scheduling_problems(pod, free)
            if problems:
                await self._set_unscheduled(pod, "Unschedulable", unschedulable_message(problems))
                continue
            try:
                await self.api.patch("Pod", ns, name, {"spec": {"nodeName": self.node_name}})
            except Exception:  # deleted meanwhile
                continue
            for k, v in pod_requests(pod).items():
                free[k] = free.get(k, 0.0) - v
            cond = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
            await self._patch_conditions(ns, name, [cond])
            self._event(
                pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {ns}/{name} to {self.node_name}",
                "default-scheduler",
            )

    async def _set_unscheduled(self, pod: Obj, reason: str, message: str) -> None:
        meta = pod["metadata"]
        have = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled"
        ]
        if have and have[0].get("reason") == reason and have[0].get("message") == message:
            return
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now(),
        }
        await self._patch_conditions(meta.get("namespace", "default"), meta["name"], [cond])
        if reason == "Unschedulable":
            self._event(pod, "Warning", "FailedScheduling", message, "default-scheduler")

    async def _patch_conditions(self, ns: str, name: str, conds: list[Obj]) -> None:
        pod = self.api.get("Pod", ns, name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return
        types = {c["type"] for c in conds}
        keep = [
            c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] not in types
        ]
        with contextlib.suppress(AssertionError):
            await self.api.patch_status("Pod", ns, name, {"conditions": [*keep, *conds]})

    # --- a pod's life ------------------------------------------------------------------------

    async def _run_pod(self, rt: _PodRuntime) -> None:
        try:
            if not await self._await_volumes(rt):
                return
            self._prepare_volumes(rt)
            while rt.endpoint is None:
                try:
                    rt.endpoint = await self.network.add()
                except RuntimeError as e:  # an `ip` command failed: retried, as sandboxes are
                    message = f"Failed to create pod sandbox: {e}"
                    self._event(rt.pod, "Warning", "FailedCreatePodSandBox", message)
                    await rt.sleep(1.0)
                if rt.terminating:
                    return
            rt.ip = rt.endpoint.ip
            self._sync_dns()
            # Its rules, and its address in every other pod's, before its first process runs.
            await self._sync_policies()
            for c in rt.init:
                if not await self._run_container(rt, c):
                    return
            for c in rt.main:
                c.state = {"waiting": {"reason": "ContainerCreating"}}
            await asyncio.gather(*(self._run_container(rt, c) for c in rt.main))
        finally:
            await self._finish_pod(rt)

    async def _await_volumes(self, rt: _PodRuntime) -> bool:
        while not rt.terminating:
            problems = volume_problems(rt.pod, self.api)
            if not problems:
                return True
            for p in problems:
                self._event(rt.pod, "Warning", "FailedMount", p)
            await rt.sleep(0.5)
        return False

    async def _finish_pod(self, rt: _PodRuntime) -> None:
        """All containers stopped: release the sandbox; a deleted pod's last status, removal."""
        for task in rt.stoppers:
            with contextlib.suppress(Exception):
                await task
        if rt.endpoint is not None:
            # Detached before the namespace goes: a policy pass whose `nft -f` fails on it while
            # it is being deleted sees the pod gone and skips it (_sync_policies).
            endpoint, rt.endpoint = rt.endpoint, None
            await self.network.remove(endpoint)
        rt.done = True
        rt.final_phase = rt.phase()
        if rt.final_phase not in TERMINAL:
            rt.final_phase = "Failed"
        if rt.removed:
            if not self._closed:
                self._forget(rt)
            return
        if rt.terminating:
            pod = self.api.get("Pod", rt.ns, rt.name)
            if pod is not None and pod["metadata"]["uid"] == rt.uid:
                # The final status, then the removal (the kubelet's DELETE with grace 0),
                # whose DELETED event carries it.
                with contextlib.suppress(AssertionError):
                    await self.api.patch_status("Pod", rt.ns, rt.name, self._pod_status(rt, pod))
                pod = self.api.get("Pod", rt.ns, rt.name)
                if pod is not None and pod["metadata"]["uid"] == rt.uid:
                    self.api.remove_pod(rt.ns, rt.name)
            self._forget(rt)
        self._sync_dns()

    def _terminate(self, rt: _PodRuntime, grace: float) -> None:
        """Start stopping every container: SIGTERM, `grace` seconds, SIGKILL."""
        rt.terminating = True
        rt.wake.set()
        for c in rt.containers():
            if c.proc is not None and c.proc.returncode is None:
                rt.stoppers.append(asyncio.create_task(self._stop_process(c.proc, grace)))

    def _forget(self, rt: _PodRuntime) -> None:
        if self._pods.get(rt.uid) is rt:
            del self._pods[rt.uid]
        self._crash_loop.forget(f"{rt.uid}/")
        shutil.rmtree(rt.dir, ignore_errors=True)

    async def _stop_process(self, proc: asyncio.subprocess.Process, grace: float) -> None:
        if proc.returncode is not None:
            return
        if grace > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    # --- containers --------------------------------------------------------------------------

    async def _run_container(self, rt: _PodRuntime, c: _Container) -> bool:
        """Run (and restart) one container; True when it ended with exit code 0."""
        policy = rt.restart_policy
        while not rt.terminating:
            try:
                c.user = security(rt.pod, c.spec)
                env = container_env(
                    rt.pod, c.spec, self.api, rt.ip, self.network.gateway, self.capacity
                )
            except ConfigError as e:
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self._event(rt.pod, "Warning", "Failed", f"Error: {e}")
                await rt.sleep(1.0)
                continue
            c.env = self._process_env(rt, c, env)
            exit_code, terminated = await self._start_and_wait(rt, c)
            c.state = {"terminated": terminated}
            if rt.terminating:
                return False
            if c.init:
                restart = policy != "Never" and exit_code != 0
            else:
                restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
            if not restart:
                return exit_code == 0
            c.last_state = {"terminated": terminated}
            key, finished = f"{rt.uid}/{c.name}", self.clock()
            delay = self._crash_loop.delay_s(key, finished, finished)
            if delay > 0:
                shown = go_duration(self._crash_loop.current_s(key) / self.time_scale)
                message = (
                    f"back-off {shown} restarting failed container={c.name} "
                    f"pod={rt.name}_{rt.ns}({rt.uid})"
                )
                c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
                self._event(rt.pod, "Warning", "BackOff", "Back-off restarting failed container")
                await rt.sleep(delay)
                if rt.terminating:
                    return False
            self._crash_loop.next(key, finished, self.clock())
            c.restart_count += 1
        return False

    def _process_env(self, rt: _PodRuntime, c: _Container, env: dict[str, str]) -> dict[str, str]:
        uid = c.user[0]
        home = "/root" if not uid else "/"
        if uid:
            with contextlib.suppress(KeyError):
                home = pwd.getpwuid(uid).pw_dir
        base = {"PATH": _image_path(), **self.image_env, "HOSTNAME": rt.hostname, "HOME": home}
        return {**base, **env}

    def _mount_point(self, target: str, is_dir: bool, outer: list[tuple[str, Path]]) -> None:
        """Make `target` exist: inside an outer volume, or on the host (remembered)."""
        for mount_path, source in reversed(outer):
            if target.startswith(mount_path.rstrip("/") + "/"):
                host = source / os.path.relpath(target, mount_path)
                if not host.exists():
                    if is_dir:
                        host.mkdir(parents=True, exist_ok=True)
                    else:
                        host.parent.mkdir(parents=True, exist_ok=True)
                        host.touch()
                return
        path = Path(target)
        if path.exists() or path.is_symlink():
            return
        missing = [p for p in [*reversed(path.parents), path] if not p.exists()]
        for p in missing:
            with open(self._ledger, "a") as ledger:  # written first: a crash still knows it
                ledger.write(f"{p}\n")
            if p == path and not is_dir:
                p.touch()
            else:
                p.mkdir()
            self._created.append(p)

    def _launch_spec(self, rt: _PodRuntime, c: _Container, argv: list[str], cdir: Path) -> Obj:
        mounts: list[Obj] = []
        outer: list[tuple[str, Path]] = []
        entries: list[tuple[str, Path, bool]] = []
        for vm in c.spec.get("volumeMounts") or []:
            source, force_ro = rt.volumes[vm["name"]]
            sub = vm.get("subPath") or expand(vm.get("subPathExpr", ""), c.env)
            if sub:
                source = source / sub
                if not source.exists():
                    source.mkdir(parents=True)
            entries.append((vm["mountPath"], source, bool(vm.get("readOnly")) or force_ro))
        term_path = c.spec.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
        entries.append((term_path, cdir / "termination-log", False))
        for target, source, read_only in sorted(entries, key=lambda e: len(Path(e[0]).parts)):
            self._mount_point(target, source.is_dir(), outer)
            outer.append((target, source))
            mounts.append({"source": str(source), "target": target, "readOnly": read_only})
        uid, gid, groups, no_new_privs = c.user
        return {
            "mode": "run",
            "mounts": mounts,
            "expose": self._exposure(argv, uid, cdir),
            "image": image_paths(argv),
            "hostname": rt.hostname,
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "noNewPrivs": no_new_privs,
            "workingDir": c.spec.get("workingDir") or "/",
            "argv": argv,
            # The marker names the container's processes, which die with it (see _kill_rest).
            "env": {**c.env, CONTAINER_MARKER: c.marker},
            "errorFile": str(cdir / "start-error"),
        }

    def _exposure(self, argv: list[str], uid: int | None, cdir: Path) -> Obj | None:
        """What a non-root container needs from under a directory it cannot traverse."""
        if not uid:
            return None
        blocked: dict[str, set[str]] = defaultdict(set)
        for path in {argv[0], os.path.realpath(argv[0]), sys.prefix, sys.base_prefix}:
            hit = _blocked_ancestor(os.path.realpath(path)) or _blocked_ancestor(path)
            if hit:
                blocked[hit[0]].add(hit[1])
        if not blocked:
            return None
        top = sorted(blocked)[0]  # one directory is what this machine needs (/root)
        return {"blocked": top, "children": sorted(blocked[top]), "staging": str(cdir / "stage")}

    async def _start_and_wait(self, rt: _PodRuntime, c: _Container) -> tuple[int, Obj]:
        """Start the container's process, run its probes, wait for its exit."""
        cdir = rt.dir / "containers" / c.name
        cdir.mkdir(parents=True, exist_ok=True)
        started_at = _now()
        assert rt.endpoint is not None
        term_log = cdir / "termination-log"
        error_file = cdir / "start-error"
        spec_path = cdir / "spec.json"
        log = self.log_path(rt.ns, rt.name, c.name)
        try:
            argv = resolve_argv(c.spec, c.env, self.command_map)
            term_log.write_bytes(b"")
            os.chmod(term_log, 0o666)  # the container's user writes it, as with the kubelet's
            error_file.unlink(missing_ok=True)
            spec_path.write_text(json.dumps(self._launch_spec(rt, c, argv, cdir)))
            with open(log, "ab") as logf:
                offset = logf.tell()
                proc = await asyncio.create_subprocess_exec(
                    *("ip", "netns", "exec", rt.endpoint.netns),
                    *("unshare", "--mount", "--propagation", "private", "--uts"),
                    *(sys.executable, str(POD_INIT), str(spec_path)),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=logf,
                    start_new_session=True,
                )
        except (StartFailure, OSError) as e:  # e.g. a mount point that cannot be made
            self._event(rt.pod, "Warning", "Failed", f"Error: {e}")
            failed = {"exitCode": 128, "reason": "StartError", "message": str(e)}
            return 128, {**failed, "startedAt": started_at, "finishedAt": _now()}
        c.proc = proc
        c.container_id = f"process://{proc.pid}"
        c.state = {"running": {"startedAt": started_at}}
        c.started = c.spec.get("startupProbe") is None
        c.ready = c.started and c.spec.get("readinessProbe") is None
        self._event(rt.pod, "Normal", "Started", f"Started container {c.name}")
        probes = asyncio.create_task(self._probe_container(rt, c, proc))
        if rt.terminating:  # a delete arrived while this container started
            rt.stoppers.append(asyncio.create_task(self._stop_process(proc, 0.0)))
        rc = await proc.wait()
        # The container's other processes die with it (a PID namespace would see to that),
        # those that left its process group (setsid) too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_rest(c.marker)
        probes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probes
        c.proc = None
        c.ready = c.started = False
        exit_code = rc if rc >= 0 else 128 - rc
        term: Obj = {"exitCode": exit_code, "startedAt": started_at, "finishedAt": _now()}
        term["containerID"] = c.container_id
        start_error = error_file.read_text() if error_file.exists() else ""
        if start_error and exit_code == 128:
            term.update(reason="StartError", message=start_error)
            return exit_code, term
        term["reason"] = "Completed" if exit_code == 0 else "Error"
        message = self._termination_message(c, term_log, log, offset, exit_code)
        if message:
            term["message"] = message
        return exit_code, term

    @staticmethod
    def _termination_message(
        c: _Container, term_log: Path, log: Path, offset: int, exit_code: int
    ) -> str:
        """terminationMessagePath's content, or the log tail for FallbackToLogsOnError."""
        with contextlib.suppress(OSError):
            data = term_log.read_bytes()[:MAX_TERMINATION_MESSAGE]
            if data:
                return data.decode(errors="replace")
        policy = c.spec.get("terminationMessagePolicy", "File")
        if policy != "FallbackToLogsOnError" or exit_code == 0:
            return ""
        with open(log, "rb") as f:
            f.seek(offset)
            tail = f.read()
        lines = tail.splitlines(keepends=True)[-FALLBACK_LINES:]
        return b"".join(lines)[-FALLBACK_BYTES:].decode(errors="replace")

    # --- probes ------------------------------------------------------------------------------

    async def _probe_container(
        self, rt: _PodRuntime, c: _Container, proc: asyncio.subprocess.Process
    ) -> None:
        t0 = asyncio.get_running_loop().time()
        startup = c.spec.get("startupProbe")
        if startup is not None:
            failures = 0
            async for ok, _ in self._probe_results(rt, c, startup, "Startup", t0):
                if ok:
                    break
                failures += 1
                if failures >= int(startup.get("failureThreshold", 3)):
                    await self._probe_kill(rt, c, proc, startup, "startup")
                    return
            else:
                return  # the process ended before its startup probe passed: never started
        c.started = True
        readiness, liveness = c.spec.get("readinessProbe"), c.spec.get("livenessProbe")
        if readiness is None:
            c.ready = True
        jobs = []
        if readiness is not None:
            jobs.append(self._readiness(rt, c, readiness, t0))
        if liveness is not None:
            jobs.append(self._liveness(rt, c, proc, liveness, t0))
        await asyncio.gather(*jobs)

    async def _readiness(self, rt: _PodRuntime, c: _Container, probe: Obj, t0: float) -> None:
        successes = failures = 0
        async for ok, _ in self._probe_results(rt, c, probe, "Readiness", t0):
            if ok:
                successes, failures = successes + 1, 0
                if successes >= int(probe.get("successThreshold", 1)):
                    c.ready = True
            else:
                successes, failures = 0, failures + 1
                if failures >= int(probe.get("failureThreshold", 3)):
                    c.ready = False

    async def _liveness(
        self,
        rt: _PodRuntime,
        c: _Container,
        proc: asyncio.subprocess.Process,
        probe: Obj,
        t0: float,
    ) -> None:
        failures = 0
        async for ok, _ in self._probe_results(rt, c, probe, "Liveness", t0):
            failures = 0 if ok else failures + 1
            if failures >= int(probe.get("failureThreshold", 3)):
                await self._probe_kill(rt, c, proc, probe, "liveness")
                return

    async def _probe_kill(
        self,
        rt: _PodRuntime,
        c: _Container,
        proc: asyncio.subprocess.Process,
        probe: Obj,
        kind: str,
    ) -> None:
        message = f"Container {c.name} failed {kind} probe, will be restarted"
        self._event(rt.pod, "Normal", "Killing", message)
        grace = probe.get("terminationGracePeriodSeconds")
        if grace is None:
            grace = rt.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        await self._stop_process(proc, float(grace) * self.grace_scale)

    async def _probe_results(
        self, rt: _PodRuntime, c: _Container, probe: Obj, kind: str, t0: float
    ) -> AsyncIterator[tuple[bool, str]]:
        loop = asyncio.get_running_loop()
        scale = self.probe_period_scale
        delay = float(probe.get("initialDelaySeconds", 0)) * scale
        period = max(float(probe.get("periodSeconds", 10)) * scale, 0.01)
        await asyncio.sleep(max(0.0, t0 + delay - loop.time()))
        # Probes end with the container's process, as the kubelet's prober workers stop with
        # the container, not only when cancelled: on Python 3.11, asyncio.wait_for drops a
        # cancellation that arrives as its inner call completes (gh-86296, fixed in 3.12), so
        # a probe answered by a dying server could keep this loop, and the pod, alive.
        proc = c.proc
        while proc is not None and proc.returncode is None:
            ok, message = await self._probe_once(rt, c, probe)
            if not ok:
                self._event(rt.pod, "Warning", "Unhealthy", f"{kind} probe failed: {message}")
            yield ok, message
            await asyncio.sleep(period)

    def _probe_port(self, c: _Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f'unable to find port "{port}"')

    async def _probe_once(self, rt: _PodRuntime, c: _Container, probe: Obj) -> tuple[bool, str]:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                return await asyncio.wait_for(self._http_probe(rt, c, probe["httpGet"]), timeout)
            if "tcpSocket" in probe:
                ts = probe["tcpSocket"]
                host, port = ts.get("host") or rt.ip, self._probe_port(c, ts["port"])
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
                except OSError as e:
                    return False, f"dial tcp {host}:{port}: connect: {_dial_error(e)}"
                writer.close()
                return True, ""
            if "exec" in probe:
                return await self._exec_probe(rt, c, probe["exec"], timeout)
        except TimeoutError:
            return False, "context deadline exceeded (Client.Timeout exceeded)"
        except ValueError as e:
            return False, str(e)
        return False, f"probe kind not modelled: {sorted(probe)}"

    async def _http_probe(self, rt: _PodRuntime, c: _Container, hg: Obj) -> tuple[bool, str]:
        scheme = str(hg.get("scheme", "HTTP")).upper()
        host, port = hg.get("host") or rt.ip, self._probe_port(c, hg.get("port", 80))
        path = hg.get("path") or "/"
        url = f"{scheme.lower()}://{host}:{port}{path}"
        ctx = None
        if scheme == "HTTPS":
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # the kubelet does not verify probe certificates
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
        except OSError as e:
            return False, f'Get "{url}": dial tcp {host}:{port}: connect: {_dial_error(e)}'
        headers = {
            "Host": f"{host}:{port}",
            "User-Agent": "kube-probe/1.31",
            "Accept": "*/*",
            "Connection": "close",
        }
        for h in hg.get("httpHeaders") or []:
            headers[h["name"]] = h["value"]
        request = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        try:
            writer.write((request + "\r\n").encode())
            await writer.drain()
            head = await reader.readline()
            left = 65536  # drain the body (the kubelet reads up to 10 KiB of it)
            while left > 0:
                chunk = await reader.read(left)
                if not chunk:
                    break
                left -= len(chunk)
        except OSError as e:
            return False, f'Get "{url}": {e}'
        finally:
            writer.close()
        parts = head.decode(errors="replace").split()
        if len(parts) < 2 or not parts[1].isdigit():
            return False, f'Get "{url}": malformed HTTP response {head!r}'
        code = int(parts[1])
        if 200 <= code < 400:
            return True, ""
        return False, f"HTTP probe failed with statuscode: {code}"

    async def _exec_probe(
        self, rt: _PodRuntime, c: _Container, ex: Obj, timeout: float
    ) -> tuple[bool, str]:
        proc = c.proc
        if proc is None or proc.returncode is not None:
            return False, "container is not running"
        try:
            argv = resolve_argv({"command": ex.get("command") or []}, c.env, self.command_map)
        except StartFailure as e:
            return False, str(e)
        uid, gid, groups, no_new_privs = c.user
        spec = {
            "mode": "exec",
            "argv": argv,
            # The marker names the container's processes, which die with it (see _kill_rest).
            "env": {**c.env, CONTAINER_MARKER: c.marker},
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "noNewPrivs": no_new_privs,
            "workingDir": c.spec.get("workingDir") or "/",
        }
        c.probe_runs += 1
        spec_path = rt.dir / "containers" / c.name / f"exec-{c.probe_runs % 4}.json"
        spec_path.write_text(json.dumps(spec))
        runner = await asyncio.create_subprocess_exec(
            *("nsenter", "--target", str(proc.pid), "--net", "--mount", "--uts", "--"),
            *(sys.executable, str(POD_INIT), str(spec_path)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(runner.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runner.pid, signal.SIGKILL)
            await runner.wait()
            return False, f"command {ex.get('command')} timed out after {timeout:g}s"
        text = out.decode(errors="replace")[-1024:]
        return runner.returncode == 0, text

    # --- status ------------------------------------------------------------------------------

    async def _sync_statuses(self) -> None:
        for rt in list(self._pods.values()):
            if rt.terminating or rt.removed:
                continue
            pod = self.api.get("Pod", rt.ns, rt.name)
            if pod is None or pod["metadata"]["uid"] != rt.uid:
                continue
            if pod["metadata"].get("deletionTimestamp"):
                continue  # terminating: only the final status (see the module docstring)
            status = self._pod_status(rt, pod)
            if status != rt.last_status:
                with contextlib.suppress(AssertionError):
                    await self.api.patch_status("Pod", rt.ns, rt.name, status)
                rt.last_status = status

    def _condition(
        self, rt: _PodRuntime, type_: str, ok: bool, reason: str = "", message: str = ""
    ) -> Obj:
        value = "True" if ok else "False"
        seen = rt.cond_times.get(type_)
        if seen is None or seen[0] != value:
            rt.cond_times[type_] = (value, _now())
        cond: Obj = {"type": type_, "status": value, "lastTransitionTime": rt.cond_times[type_][1]}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond

    def _pod_status(self, rt: _PodRuntime, pod: Obj) -> Obj:
        phase = rt.final_phase or rt.phase()
        terminal = phase in TERMINAL
        unready = [c.name for c in rt.main if not c.ready]
        incomplete = [c.name for c in rt.init if c.state.get("terminated", {}).get("exitCode") != 0]
        have = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
        scheduled = have.get("PodScheduled")
        if scheduled is None or scheduled.get("status") != "True":
            scheduled = self._condition(rt, "PodScheduled", True)
        conds = [scheduled]
        conds.append(self._condition(rt, "PodReadyToStartContainers", rt.endpoint is not None))
        if incomplete and not terminal:
            message = f"containers with incomplete status: [{' '.join(incomplete)}]"
            conds.append(
                self._condition(rt, "Initialized", False, "ContainersNotInitialized", message)
            )
        else:
            conds.append(
                self._condition(rt, "Initialized", True, "PodCompleted" if terminal else "")
            )
        if terminal:
            conds.append(self._condition(rt, "ContainersReady", False, "PodCompleted"))
            conds.append(self._condition(rt, "Ready", False, "PodCompleted"))
        elif unready:
            message = f"containers with unready status: [{' '.join(unready)}]"
            conds.append(
                self._condition(rt, "ContainersReady", False, "ContainersNotReady", message)
            )
            conds.append(self._condition(rt, "Ready", False, "ContainersNotReady", message))
        else:
            conds.append(self._condition(rt, "ContainersReady", True))
            gates = [g["conditionType"] for g in rt.spec.get("readinessGates") or []]
            closed = [g for g in gates if (have.get(g) or {}).get("status") != "True"]
            if closed:
                message = f'the status of pod readiness gate "{closed[0]}" is not "True"'
                conds.append(self._condition(rt, "Ready", False, "ReadinessGatesNotReady", message))
            else:
                conds.append(self._condition(rt, "Ready", True))
        foreign = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") not in MANAGED_CONDITIONS
        ]
        gateway = self.network.gateway
        status: Obj = {
            "phase": phase,
            "conditions": [*conds, *foreign],
            "hostIP": gateway,
            "hostIPs": [{"ip": gateway}],
            "startTime": rt.start_time,
            "qosClass": _qos_class(pod),
            "containerStatuses": [c.status() for c in rt.main],
        }
        if rt.init:
            status["initContainerStatuses"] = [c.status() for c in rt.init]
        if rt.ip:
            status["podIP"] = rt.ip
            status["podIPs"] = [{"ip": rt.ip}]
        return status

    # --- NetworkPolicy -----------------------------------------------------------------------

    async def _sync_policies(self) -> None:
        """Load into each pod's netns the nftables rules its NetworkPolicies make (netpol.py),
        where they changed. One pass at a time: a pod starting and the reconcile loop both call."""
        async with self._policy_lock:
            running = [rt for rt in self._pods.values() if rt.endpoint is not None and not rt.done]
            if not running:
                return
            policies = self.api.list_kind("NetworkPolicy")
            if not policies and all(rt.ruleset is None for rt in running):
                return
            namespaces = {
                ns["metadata"]["name"]: dict(ns["metadata"].get("labels") or {})
                for ns in self.api.list_kind("Namespace")
            }
            pods = [PodAddress.of(rt.pod, rt.ip) for rt in running]
            for rt, address in zip(running, pods, strict=True):
                script = pod_ruleset(address, policies, pods, namespaces, self.network.gateway)
                if script is None:  # isolated by nothing: no table (dropped if it had one)
                    script = NO_RULES if rt.ruleset is not None else None
                if script is None or script == rt.ruleset or rt.endpoint is None:
                    continue
                try:
                    await apply_ruleset(rt.endpoint.netns, script)
                except RuntimeError:
                    if rt.endpoint is None or rt.done:
                        continue  # the pod's namespace went away meanwhile
                    raise
                rt.ruleset = script

    # --- DNS ---------------------------------------------------------------------------------

    def _sync_dns(self) -> None:
        """Rewrite every pod's /etc/hosts where the cluster's names changed."""
        running = [rt for rt in self._pods.values() if rt.endpoint is not None]
        if not running:
            return
        shared: set[tuple[str, str]] = set()
        local: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for svc in self.api.list_kind("Service"):
            sns, sname = svc["metadata"].get("namespace", "default"), svc["metadata"]["name"]
            spec = svc.get("spec") or {}
            selector = spec.get("selector") or {}
            headless = spec.get("clusterIP") == "None"
            publish = bool(spec.get("publishNotReadyAddresses"))
            for rt in running:
                labels = (rt.pod.get("metadata") or {}).get("labels") or {}
                if rt.ns != sns or not _labels_match(selector, labels):
                    continue
                if not (publish or rt.ready()):
                    continue
                shared.update((rt.ip, name) for name in _qualified(sname, sns))
                local[sns].add((rt.ip, sname))
                if headless and rt.spec.get("hostname") and rt.spec.get("subdomain") == sname:
                    host = f"{rt.spec['hostname']}.{sname}"
                    shared.update((rt.ip, name) for name in _qualified(host, sns))
                    local[sns].add((rt.ip, host))
        for rt in running:
            assert rt.endpoint is not None
            text = self._hosts_file(rt, shared | local[rt.ns])
            if text != rt.hosts:
                self.network.write_hosts(rt.endpoint, text)
                rt.hosts = text

    def _hosts_file(self, rt: _PodRuntime, records: set[tuple[str, str]]) -> str:
        lines = [
            "# Kubernetes-managed hosts file (tests/cluster/kubelet.py: kubelet + CoreDNS).",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            "fe00::0\tip6-localnet",
            "fe00::1\tip6-allnodes",
            "fe00::2\tip6-allrouters",
        ]
        own = [rt.hostname]
        subdomain = rt.spec.get("subdomain")
        if subdomain:
            own.insert(0, f"{rt.hostname}.{subdomain}.{rt.ns}.svc.cluster.local")
        lines.append(f"{rt.ip}\t" + "\t".join(own))
        for alias in rt.spec.get("hostAliases") or []:
            lines.append(f"{alias['ip']}\t" + "\t".join(alias.get("hostnames") or []))
        lines.append("# cluster DNS")
        for ip, name in sorted(records, key=lambda r: (r[1], r[0])):
            if not (ip == rt.ip and name in own):
                lines.append(f"{ip}\t{name}")
        return "\n".join(lines) + "\n"

    # --- events ------------------------------------------------------------------------------

    def _event(
        self, pod: Obj, type_: str, reason: str, message: str, component: str = "kubelet"
    ) -> None:
        """Record an Event once per (pod, reason, message); best effort, as in Kubernetes."""
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        if not self.events or key in self._events_seen:
            return
        self._events_seen.add(key)
        now = _now()
        ns = meta.get("namespace", "default")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": ns},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": ns,
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": component, "host": self.node_name},
            "reportingComponent": component,
            "reportingInstance": self.node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(Exception):
            self.api.add(event)

    # --- volumes -----------------------------------------------------------------------------

    def _prepare_volumes(self, rt: _PodRuntime) -> None:
        fs_group = (rt.spec.get("securityContext") or {}).get("fsGroup")
        for vol in rt.spec.get("volumes") or []:
            name = vol["name"]
            path = rt.dir / "volumes" / name
            read_only = False
            if "emptyDir" in vol:
                path.mkdir(parents=True, exist_ok=True)
                os.chmod(path, 0o777)  # as the kubelet makes emptyDirs
            elif "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]
                path = self.workdir / "pvc" / rt.ns / claim["claimName"]
                path.mkdir(parents=True, exist_ok=True, mode=0o755)
                read_only = bool(claim.get("readOnly"))
            else:
                path.mkdir(parents=True, exist_ok=True)
                self._write_projection(rt, vol, path)
                read_only = True
            is_claim = "persistentVolumeClaim" in vol
            if fs_group is not None and not (is_claim and read_only):
                _apply_fs_group(path, int(fs_group), read_only=read_only)
            rt.volumes[name] = (path, read_only)

    def _write_projection(self, rt: _PodRuntime, vol: Obj, root: Path) -> None:
        """configMap/secret/downwardAPI/projected volumes as files (keys as names)."""
        if "projected" in vol:
            sources = vol["projected"].get("sources") or []
            default_mode = vol["projected"].get("defaultMode", 0o644)
        else:
            sources = [{k: v for k, v in vol.items() if k != "name"}]
            inner = next(iter(sources[0].values()))
            default_mode = inner.get("defaultMode", 0o644)
        for source in sources:
            files: dict[str, tuple[bytes, int | None]] = {}
            if "configMap" in source or "secret" in source:
                kind = "ConfigMap" if "configMap" in source else "Secret"
                ref = source.get("configMap") or source.get("secret") or {}
                obj = self.api.get(kind, rt.ns, ref.get("name") or ref.get("secretName", ""))
                data: dict[str, bytes] = {}
                if obj is not None and kind == "Secret":
                    data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
                elif obj is not None:
                    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
                    for k, v in (obj.get("binaryData") or {}).items():
                        data[k] = base64.b64decode(v)
                items = ref.get("items")
                if items:
                    for item in items:
                        if item["key"] in data:
                            files[item["path"]] = (data[item["key"]], item.get("mode"))
                else:
                    files = {k: (v, None) for k, v in data.items()}
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    if "fieldRef" in item:
                        value = field_value(
                            rt.pod, item["fieldRef"]["fieldPath"], rt.ip, self.network.gateway
                        )
                    else:
                        container = (rt.spec.get("containers") or [{}])[0]
                        value = resource_value(
                            rt.pod, container, item["resourceFieldRef"], self.capacity
                        )
                    files[item["path"]] = (value.encode(), item.get("mode"))
            for rel, (content, mode) in files.items():
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                os.chmod(target, default_mode if mode is None else mode)


def _read_ledger(path: Path) -> list[Path]:
    try:
        return [Path(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _remove_empty(paths: list[Path]) -> None:
    """Remove mount points this kubelet made on the host, deepest first, if still empty."""
    for path in reversed(paths):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.is_file() and path.stat().st_size == 0:
                path.unlink()


def _dial_error(e: OSError) -> str:
    """Go's wording for a failed connect ("connection refused"), as probe messages carry it."""
    return os.strerror(e.errno).lower() if e.errno else str(e)


def _qos_class(pod: Obj) -> str:
    """BestEffort, Guaranteed or Burstable, as the API server sets status.qosClass."""
    containers = (pod.get("spec") or {}).get("containers") or []
    requests = [((c.get("resources") or {}).get("requests") or {}) for c in containers]
    limits = [((c.get("resources") or {}).get("limits") or {}) for c in containers]
    if not any(
        r.get(k) or lim.get(k)
        for r, lim in zip(requests, limits, strict=True)
        for k in ("cpu", "memory")
    ):
        return "BestEffort"
    for r, lim in zip(requests, limits, strict=True):
        for k in ("cpu", "memory"):
            if k not in lim or parse_quantity(r.get(k, lim[k])) != parse_quantity(lim[k]):
                return "Burstable"
    return "Guaranteed"
