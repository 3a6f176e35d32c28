"""NetworkPolicy on the local cluster's node: the job's rendered policy, enforced in the pods'
network namespaces (netpol.py), lets the job's own traffic through and keeps other pods out.

The live test runs small listener pods labelled and ported as the operator renders a job's
learner and rollout pods (no training: each pod listens on its role's ports and on one ephemeral
port, as gloo and NCCL open them), applies the job's rendered NetworkPolicy and connects from
inside each pod's network namespace. The pure tests check `pod_ruleset`'s semantics and that nft
accepts every kind of rule it writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # kmock_apiserver

from apiserver import ClusterApiServer
from kubelet import ProcessKubelet
from netns import unavailable_reason
from netpol import NFT_MISSING, PodAddress, nft_command, pod_ruleset
from operator_harness import tiny_job

from gspo_api import ports
from gspo_api.validation import parse_spec
from gspo_operator.render import render_job

Obj = dict[str, Any]
NS = "default"
JOB = "exp"

# Listens on the ports given as arguments and on one ephemeral port (printed), accepting and
# closing every connection: what a connect() needs to succeed.
LISTEN = r"""
import selectors, socket, sys
sel = selectors.DefaultSelector()
for port in [*map(int, sys.argv[1:]), 0]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    sel.register(s, selectors.EVENT_READ)
    if port == 0:
        print("EPHEMERAL", s.getsockname()[1], flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.close()
"""

# Connects to each "ip:port" argument; prints {target: "ok" | "refused" | "timeout"}.
CONNECT = r"""
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        out[target] = "ok"
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def rendered_job() -> tuple[Obj, dict[str, Obj]]:
    """The job's NetworkPolicy and its learner and rollout pod templates, as the operator
    renders them."""
    job = tiny_job(JOB)  # no uid: no ownerReferences (the store would collect the orphans)
    objs = render_job(job, parse_spec(job["spec"]), token="t")
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    templates = {
        rj["name"]: rj["template"]["spec"]["template"] for rj in jobset["spec"]["replicatedJobs"]
    }
    return policy, templates


def listener(name: str, ns: str, labels: dict[str, str], container_ports: list[Obj]) -> Obj:
    numbers = [str(p["containerPort"]) for p in container_ports]
    container = {
        "name": "main",
        "image": "ignored",
        "command": ["python", "-c", LISTEN, *numbers],
        "ports": container_ports,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[ClusterApiServer, ProcessKubelet]]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the local cluster's node needs network namespaces: {reason}")
    assert nft_command() is not None, NFT_MISSING
    async with ClusterApiServer() as api:
        kubelet = ProcessKubelet(api, tmp_path / "node")
        stop = asyncio.Event()
        task = asyncio.create_task(kubelet.run(stop))
        try:
            yield api, kubelet
        finally:
            stop.set()
            try:
                await task
            finally:
                await kubelet.close()


async def connect(kubelet: ProcessKubelet | None, source: str, targets: list[str]) -> dict:
    """Connect to `targets` from inside pod `source` (ns/name), or from the node (None)."""
    prefix = (
        [] if kubelet is None else ["ip", "netns", "exec", kubelet.netns_of(*source.split("/"))]
    )
    proc = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, "-c", CONNECT, *targets, stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return json.loads(out)


async def test_job_traffic_flows_and_other_pods_are_kept_out(node: Any) -> None:
    api, kubelet = node
    policy, templates = rendered_job()
    learner, rollout = templates["learner"], templates["rollout"]
    pods = {
        f"{NS}/learner-0": (learner["metadata"]["labels"], learner),
        f"{NS}/learner-1": (learner["metadata"]["labels"], learner),
        f"{NS}/rollout-0": (rollout["metadata"]["labels"], rollout),
        # The chart's default scrapers: Prometheus pods in any namespace; the operator's pods.
        "monitoring/prometheus": ({"app.kubernetes.io/name": "prometheus"}, None),
        "gspo-system/operator": ({"app.kubernetes.io/name": "gspo-operator"}, None),
        f"{NS}/outsider": ({"app": "web"}, None),
        f"{NS}/other-job": ({"gspo.dev/job-name": "other", "gspo.dev/role": "learner"}, None),
    }
    await api.create(policy)
    for key, (labels, template) in pods.items():
        ns, name = key.split("/")
        container_ports = template["spec"]["containers"][0]["ports"] if template else []
        await api.create(listener(name, ns, dict(labels), container_ports))

    def ip(key: str) -> str:
        return str((api.get("Pod", *key.split("/")).get("status") or {}).get("podIP", ""))

    ephemeral: dict[str, str] = {}
    deadline = time.monotonic() + 60  # seven pods start on a busy 2-core machine
    while len(ephemeral) < len(pods):
        for key in pods:
            ns, name = key.split("/")
            log = kubelet.log_path(ns, name, "main")
            text = log.read_text() if log.exists() else ""
            if "EPHEMERAL" in text and ip(key):
                ephemeral[key] = text.split("EPHEMERAL", 1)[1].split()[0]
        assert time.monotonic() < deadline, f"pods never listened: {sorted(ephemeral)}"
        await asyncio.sleep(0.1)

    learner0, learner1, rollout0 = f"{NS}/learner-0", f"{NS}/learner-1", f"{NS}/rollout-0"
    rdzv, sync, metrics = ports.RENDEZVOUS_PORT, ports.WEIGHT_SYNC_PORT, ports.LEARNER_METRICS_PORT
    http = ports.ROLLOUT_HTTP_PORT

    def at(key: str, port: int | str) -> str:
        return f"{ip(key)}:{port}"

    # (source, target, expected): None as source is the node (kubelet probes).
    cases = [
        # The job's own traffic: rendezvous, gloo/NCCL ephemeral ports both ways, the learner's
        # HTTP to the rollout server and the servers' weight-sync group back to the learner.
        (learner0, at(learner1, rdzv), "ok"),
        (learner1, at(learner0, rdzv), "ok"),
        (learner0, at(learner1, ephemeral[learner1]), "ok"),
        (learner1, at(learner0, ephemeral[learner0]), "ok"),
        (learner0, at(rollout0, http), "ok"),
        (learner0, at(rollout0, ephemeral[rollout0]), "ok"),
        (rollout0, at(learner0, sync), "ok"),
        (rollout0, at(learner0, ephemeral[learner0]), "ok"),
        # Scraping: Prometheus reaches both /metrics ports and nothing else.
        ("monitoring/prometheus", at(learner0, metrics), "ok"),
        ("monitoring/prometheus", at(rollout0, http), "ok"),
        ("monitoring/prometheus", at(learner0, rdzv), "refused"),
        ("monitoring/prometheus", at(rollout0, ephemeral[rollout0]), "refused"),
        # The operator reads /progress on the learner's metrics port, and nothing else.
        ("gspo-system/operator", at(learner0, metrics), "ok"),
        ("gspo-system/operator", at(rollout0, http), "refused"),
        ("gspo-system/operator", at(learner0, sync), "refused"),
        # Pods outside the job reach neither the rollout server nor the learner.
        (f"{NS}/outsider", at(rollout0, http), "refused"),
        (f"{NS}/outsider", at(learner0, rdzv), "refused"),
        (f"{NS}/outsider", at(learner0, sync), "refused"),
        (f"{NS}/outsider", at(learner0, metrics), "refused"),
        (f"{NS}/outsider", at(learner1, ephemeral[learner1]), "refused"),
        (f"{NS}/other-job", at(rollout0, http), "refused"),
        (f"{NS}/other-job", at(learner0, ephemeral[learner0]), "refused"),
        # Pods the policy does not select stay open; the node reaches every pod.
        (learner0, at(f"{NS}/outsider", ephemeral[f"{NS}/outsider"]), "ok"),
        (None, at(learner0, rdzv), "ok"),
        (None, at(rollout0, http), "ok"),
    ]
    by_source: dict[str | None, list[str]] = {}
    for source, target, _ in cases:
        by_source.setdefault(source, []).append(target)
    results = {}
    for source, targets in by_source.items():
        got = await connect(None if source is None else kubelet, source or "", targets)
        results.update({(source, t): r for t, r in got.items()})
    wrong = [(s, t, want, results[(s, t)]) for s, t, want in cases if results[(s, t)] != want]
    assert not wrong, f"(source, target, expected, got): {wrong}"

    # The rules follow the store: without the policy the outsider gets in.
    await api.delete("NetworkPolicy", NS, policy["metadata"]["name"])
    target = at(rollout0, http)
    deadline = time.monotonic() + 10
    while (await connect(kubelet, f"{NS}/outsider", [target]))[target] != "ok":
        assert time.monotonic() < deadline, "the rules stayed after the NetworkPolicy went"
        await asyncio.sleep(0.1)


async def test_a_policy_pass_in_flight_while_a_pod_sandbox_is_torn_down_skips_it(
    node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy pass is loading a pod's rules (`nft -f` in its netns) when the pod ends and
    its netns is deleted: the pass skips the pod (its sandbox is going) instead of failing the
    node with "setting the network namespace failed". The pass's load is held until the
    namespace is gone, and the teardown until the load has failed."""
    import kubelet as kubelet_module

    api, kubelet = node
    await api.create(policy_of({"podSelector": {"matchLabels": {"app": "web"}}}))
    pod = listener("web", NS, {"app": "web"}, [])
    pod["spec"]["containers"][0]["command"] = ["python", "-c", "import time; time.sleep(2)"]
    armed, removed, loaded = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real_apply, real_remove = kubelet_module.apply_ruleset, kubelet.network.remove

    async def held_apply(netns: str, script: str) -> None:
        if not armed.is_set():
            return await real_apply(netns, script)
        await removed.wait()
        try:
            await real_apply(netns, script)  # fails: the namespace is gone
        finally:
            loaded.set()

    async def remove_then_wait(ep: Any) -> None:
        await real_remove(ep)
        removed.set()
        if armed.is_set():
            await loaded.wait()

    monkeypatch.setattr(kubelet_module, "apply_ruleset", held_apply)
    kubelet.network.remove = remove_then_wait  # type: ignore[method-assign]
    await api.create(pod)
    deadline = time.monotonic() + 60
    while not any(rt.ruleset and not rt.done for rt in kubelet._pods.values()):
        assert time.monotonic() < deadline, "the pod's rules were never loaded"
        await asyncio.sleep(0.05)
    for rt in kubelet._pods.values():
        rt.ruleset = None  # its rules "changed": the next pass loads them again
    armed.set()
    in_flight = asyncio.create_task(kubelet._sync_policies())
    await asyncio.wait_for(in_flight, 60)  # raised RuntimeError("nft -f in ...") before
    assert loaded.is_set()
    phase = None
    while phase != "Succeeded":
        assert time.monotonic() < deadline + 30, f"the pod ended {phase}, not Succeeded"
        await asyncio.sleep(0.1)
        phase = (api.get("Pod", NS, "web").get("status") or {}).get("phase")


# --- pod_ruleset: the semantics ---------------------------------------------------------------


def address(name: str, ip: str, ns: str = NS, **labels: str) -> PodAddress:
    return PodAddress(namespace=ns, name=name, ip=ip, labels=labels)


def policy_of(spec: Obj, name: str = "p", ns: str = NS) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def accepts(script: str | None, chain: str) -> list[str]:
    """The accept lines of a chain that come from policies (the common rules left out)."""
    assert script is not None
    body = script.split(f"chain {chain} {{", 1)[1].split("}\n", 1)[0]
    return [
        line.strip().split(" comment ")[0]
        for line in body.splitlines()
        if "ingress[" in line or "egress[" in line or line.strip().startswith("reject")
    ]


NODE = "10.0.0.1"
WEB = address("web", "10.0.0.2", app="web")
DB = address("db", "10.0.0.3", app="db")
MON = address("prom", "10.0.0.4", ns="mon", app="prom")
MON_OTHER = address("tool", "10.0.0.5", ns="mon", app="tool")
PODS = [WEB, DB, MON, MON_OTHER]
NAMESPACES = {"mon": {"team": "ops"}}


def test_unselected_pods_have_no_rules_and_empty_selector_selects_all() -> None:
    only_db = policy_of({"podSelector": {"matchLabels": {"app": "db"}}})
    assert pod_ruleset(WEB, [only_db], PODS, NAMESPACES, NODE) is None
    deny_all = policy_of({"podSelector": {}})
    script = pod_ruleset(WEB, [deny_all], PODS, NAMESPACES, NODE)
    assert accepts(script, "ingress") == ["reject"]
    assert accepts(script, "egress") == []  # policyTypes default: Ingress only
    other_ns = policy_of({"podSelector": {}}, ns="mon")
    assert pod_ruleset(WEB, [other_ns], PODS, NAMESPACES, NODE) is None


def test_peers_ports_and_directions() -> None:
    policy = policy_of(
        {
            "podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]},
                {
                    # both selectors: pods matching both; a namespaceSelector alone: every pod.
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"team": "ops"}},
                            "podSelector": {
                                "matchExpressions": [
                                    {"key": "app", "operator": "In", "values": ["prom"]}
                                ]
                            },
                        },
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "mon"}
                            }
                        },
                    ],
                    "ports": [
                        {"port": "metrics"},
                        {"protocol": "UDP", "port": 5000, "endPort": 5010},
                    ],
                },
                {"from": [{"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.4/32"]}}]},
                {"ports": [{"protocol": "TCP"}]},
            ],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                    "ports": [{"port": "http"}],
                }
            ],
        }
    )
    db = PodAddress(NS, "db", "10.0.0.3", {"app": "db"}, {"metrics": (("TCP", 9090),)})
    web = PodAddress(NS, "web", "10.0.0.2", {"app": "web"}, {"http": (("TCP", 8000),)})
    pods = [web, db, MON, MON_OTHER]
    script = pod_ruleset(db, [policy], pods, NAMESPACES, NODE)
    assert accepts(script, "ingress") == [
        "ip saddr 10.0.0.2 accept",
        "ip saddr 10.0.0.4 tcp dport 9090 accept",
        "ip saddr 10.0.0.4 udp dport 5000-5010 accept",
        "ip saddr { 10.0.0.4, 10.0.0.5 } tcp dport 9090 accept",
        "ip saddr { 10.0.0.4, 10.0.0.5 } udp dport 5000-5010 accept",
        "ip saddr 10.0.0.0/24 ip saddr != 10.0.0.4/32 accept",
        "meta l4proto tcp accept",
        "reject",
    ]
    # Egress is isolated because the policy has an egress section; the named port is the
    # destination pod's.
    assert accepts(script, "egress") == ["ip daddr 10.0.0.2 tcp dport 8000 accept", "reject"]
    assert f"ip saddr {NODE} accept" in str(script)


def test_nft_accepts_every_rule_it_is_given() -> None:
    """`nft -c` (check only) parses what pod_ruleset writes, every kind of rule included."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"nft needs what network namespaces need: {reason}")
    found = nft_command()
    assert found is not None, NFT_MISSING
    policy = policy_of(
        {
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": {}}],
                    "ports": [{"port": 80}, {"protocol": "SCTP", "port": 9}],
                },
                {
                    "from": [
                        {
                            "ipBlock": {
                                "cidr": "10.0.0.0/16",
                                "except": ["10.0.1.0/24", "10.0.2.0/24"],
                            }
                        }
                    ]
                },
                {"ports": [{"protocol": "UDP"}, {"port": 1000, "endPort": 2000}]},
                {},
            ],
            "egress": [
                {
                    "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                    "ports": [{"port": 53, "protocol": "UDP"}],
                }
            ],
        }
    )
    script = pod_ruleset(WEB, [policy], PODS, NAMESPACES, NODE)
    assert script is not None
    argv, env = found
    checked = subprocess.run(
        [*argv, "-c", "-f", "-"],
        input=script,
        text=True,
        capture_output=True,
        env={**os.environ, **env},
    )
    assert checked.returncode == 0, checked.stderr + script
