"""NetworkPolicy (networking.k8s.io/v1) enforced on the local cluster's node, in each pod's netns.

Why: the operator renders a NetworkPolicy for every job (only the job's own pods reach its pods;
the metrics ports also admit the cluster's scrapers and the operator). A node that ignores it
cannot show that the job's own traffic (rendezvous, gloo/NCCL's ephemeral ports, weight sync,
HTTP to the rollout servers, scraping) survives the policy, nor that other pods are kept out.
This module turns the NetworkPolicies in the API store into nftables rules in each pod's own
network namespace (`pod_ruleset`, pure), and `ProcessKubelet` applies them (`apply_ruleset`).

Semantics, from kubernetes pkg/apis/networking/types.go (NetworkPolicySpec, NetworkPolicyPeer,
NetworkPolicyPort, IPBlock; read at commit bd2776e, 2026) and the NetworkPolicy concept page:
- A pod is isolated for ingress when a policy of its namespace selects it (spec.podSelector;
  `{}` selects every pod of the namespace) with "Ingress" in policyTypes, for egress likewise
  with "Egress". policyTypes unset: Ingress always, Egress when the policy has an egress section.
  A pod no policy selects (in a direction) is not isolated: everything passes.
- An isolated pod admits a connection when some rule of some policy selecting it admits it (the
  union; order never matters). A rule admits when one of its peers matches and one of its ports
  matches; a missing or empty `from`/`to` admits every peer, missing or empty `ports` every port.
- Peers: podSelector alone selects pods of the policy's namespace; namespaceSelector alone every
  pod of the selected namespaces; both, pods matching podSelector in namespaces matching
  namespaceSelector; ipBlock a CIDR minus its `except` CIDRs. Selectors: matchLabels and
  matchExpressions (In, NotIn, Exists, DoesNotExist); `{}` matches everything. A namespace's
  labels are its Namespace object's plus kubernetes.io/metadata.name, which kube-apiserver sets on
  every namespace (here also for namespaces that have no object in the store).
- Ports: protocol (TCP by default, UDP, SCTP), a number or a named port, endPort for a range. A
  named port in an ingress rule is the selected pod's containerPort of that name and protocol; in
  an egress rule, each destination pod's own (so it needs pod peers).
- Replies of an admitted connection pass (connection tracking), loopback inside a pod always
  passes, and traffic from the pod's node always reaches it (types.go: traffic is allowed "if the
  traffic source is the pod's local node"; kube-router accepts "fib saddr type local" towards the
  pod: here the node's address as pods see it, the bridge gateway, where probes come from).

Rules, modelled on kube-router v2.11's nftables controller (cloudnativelabs/kube-router
pkg/controllers/netpol/npc_nftables.go: a common chain that drops invalid and accepts
established/related and a few ICMP types, "from local node", one jump per selecting policy, a
final REJECT of what no policy admitted): per pod one table `inet gspo_netpol` in the pod's netns
with an `ingress` chain (input hook) and an `egress` chain (output hook); after the common rules,
one accept per admitted (peers, ports) of every selecting policy, then `reject` when the pod is
isolated in that direction (a connection fails at once with "connection refused", as kube-router's
REJECT makes it; Calico drops instead, which a client sees as a timeout). The table is replaced in
one transaction (`nft -f`) whenever what it should hold changes: a pod starts or goes, labels or
policies change.

Not modelled: IPv6, hostNetwork pods, Service ClusterIPs (there is no kube-proxy: names resolve
to pod IPs), traffic from beyond the node (nothing routes into the pod network, so an ipBlock only
ever matches pods and the node), kube-router's optional default-deny for pods no policy selects,
AdminNetworkPolicy, NetworkPolicy status conditions, logging of rejected packets, named ports in
an egress rule towards an ipBlock (they match nothing).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

TABLE = "gspo_netpol"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
PROTOCOLS = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
# kube-router's CommonICMPRules (pkg/utils): what an isolated pod still accepts.
ICMP_TYPES = "echo-request, destination-unreachable, time-exceeded"
REPO = Path(__file__).resolve().parents[2]
TOOLS_NFT = REPO / ".tools" / "nftables"
NO_RULES = f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n"  # what drops the table


@dataclass(frozen=True)
class PodAddress:
    """What the rules need to know of one pod: where it is, its labels, its named ports."""

    namespace: str
    name: str
    ip: str
    labels: Mapping[str, str] = field(default_factory=dict)
    # containerPort name -> [(protocol, port)] over the pod's containers
    named_ports: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, pod: Obj, ip: str) -> PodAddress:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        named: dict[str, list[tuple[str, int]]] = {}
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            for p in c.get("ports") or []:
                if p.get("name"):
                    proto = str(p.get("protocol") or "TCP")
                    named.setdefault(p["name"], []).append((proto, int(p["containerPort"])))
        return cls(
            namespace=meta.get("namespace") or "default",
            name=meta["name"],
            ip=ip,
            labels=dict(meta.get("labels") or {}),
            named_ports={k: tuple(v) for k, v in named.items()},
        )


# --- selection ------------------------------------------------------------------------------


def selector_matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against labels (`{}` matches everything)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
        have = labels.get(key)
        if op == "In" and have not in values:
            return False
        if op == "NotIn" and have in values:
            return False
        if op == "Exists" and have is None:
            return False
        if op == "DoesNotExist" and have is not None:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False  # the API server refuses other operators; match nothing
    return True


def policy_types(policy: Obj) -> set[str]:
    """spec.policyTypes, or its default: Ingress, plus Egress when an egress section exists."""
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return set(spec["policyTypes"])
    return {"Ingress", "Egress"} if spec.get("egress") else {"Ingress"}


def selects(policy: Obj, pod: PodAddress) -> bool:
    """The policy's podSelector picks `pod` (a policy applies to its own namespace only)."""
    if (policy["metadata"].get("namespace") or "default") != pod.namespace:
        return False
    return selector_matches((policy.get("spec") or {}).get("podSelector") or {}, pod.labels)


def namespace_labels(namespace: str, namespaces: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    return {**namespaces.get(namespace, {}), NAMESPACE_NAME_LABEL: namespace}


def peer_pods(
    peer: Obj,
    policy_ns: str,
    pods: Iterable[PodAddress],
    namespaces: Mapping[str, Mapping[str, str]],
) -> list[PodAddress]:
    """The pods a NetworkPolicyPeer with a podSelector and/or namespaceSelector selects."""
    pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
    out = []
    for pod in pods:
        if ns_sel is None:
            if pod.namespace != policy_ns:
                continue
        elif not selector_matches(ns_sel, namespace_labels(pod.namespace, namespaces)):
            continue
        if pod_sel is not None and not selector_matches(pod_sel, pod.labels):
            continue
        out.append(pod)
    return out


# --- rules ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Match:
    """One accept rule: an address match (None: any address) and a port match (None: any)."""

    addresses: tuple[str, ...] | None  # IPs or CIDRs
    excepts: tuple[str, ...] = ()
    protocol: str | None = None  # nft name: tcp, udp, sctp
    ports: tuple[str, ...] = ()  # "80", "1000-2000"; empty with a protocol: every port


def _port_matches(port: Obj, named: Mapping[str, tuple[tuple[str, int], ...]]) -> list[_Match]:
    """A NetworkPolicyPort as (protocol, port) matches; a named port resolved against `named`."""
    proto = str(port.get("protocol") or "TCP")
    nft_proto = PROTOCOLS.get(proto)
    if nft_proto is None:
        return []
    value = port.get("port")
    if value is None:
        return [_Match(None, protocol=nft_proto)]
    if isinstance(value, str) and not value.isdigit():
        numbers = [n for p, n in named.get(value, ()) if p == proto]
        return [_Match(None, protocol=nft_proto, ports=(str(n),)) for n in numbers]
    start = int(value)
    end = port.get("endPort")
    text = f"{start}-{int(end)}" if end is not None and int(end) > start else str(start)
    return [_Match(None, protocol=nft_proto, ports=(text,))]


def _rule_matches(
    rule: Obj,
    peers_key: str,
    policy_ns: str,
    target: PodAddress,
    pods: list[PodAddress],
    namespaces: Mapping[str, Mapping[str, str]],
    ingress: bool,
) -> list[_Match]:
    """Every (address, port) match one ingress or egress rule admits for `target`."""
    peers = rule.get(peers_key) or []
    ports = rule.get("ports") or []
    # Address sides: (addresses or None for "anyone", excepts, pods for egress named ports).
    sides: list[tuple[tuple[str, ...] | None, tuple[str, ...], list[PodAddress]]] = []
    if not peers:
        sides.append((None, (), []))
    for peer in peers:
        block = peer.get("ipBlock")
        if block is not None:
            sides.append(((str(block["cidr"]),), tuple(block.get("except") or ()), []))
            continue
        selected = [p for p in peer_pods(peer, policy_ns, pods, namespaces) if p.ip]
        if selected:
            sides.append((tuple(sorted({p.ip for p in selected})), (), selected))
    out: list[_Match] = []
    for addresses, excepts, selected in sides:
        if not ports:
            out.append(_Match(addresses, excepts))
            continue
        for port in ports:
            named_here = isinstance(port.get("port"), str) and not str(port["port"]).isdigit()
            if ingress or not named_here:
                for m in _port_matches(port, target.named_ports if ingress else {}):
                    out.append(_Match(addresses, excepts, m.protocol, m.ports))
                continue
            for pod in selected:  # egress to a named port: each destination pod's own number
                for m in _port_matches(port, pod.named_ports):
                    out.append(_Match((pod.ip,), (), m.protocol, m.ports))
    return out


def _accept_line(m: _Match, direction: str) -> str:
    field_ = "saddr" if direction == "ingress" else "daddr"
    parts = []
    if m.addresses is not None:
        parts.append(f"ip {field_} {_set(m.addresses)}")
        if m.excepts:
            parts.append(f"ip {field_} != {_set(m.excepts)}")
    if m.protocol is not None:
        parts.append(
            f"{m.protocol} dport {_set(m.ports)}" if m.ports else f"meta l4proto {m.protocol}"
        )
    parts.append("accept")
    return " ".join(parts)


def _set(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def pod_ruleset(
    target: PodAddress,
    policies: Iterable[Obj],
    pods: Iterable[PodAddress],
    namespaces: Mapping[str, Mapping[str, str]],
    node_ip: str,
) -> str | None:
    """The nft script for `target`'s netns, or None when no policy isolates it either way."""
    pods = [p for p in pods if p.ip]
    chains: dict[str, list[str] | None] = {"ingress": None, "egress": None}
    for policy in sorted(
        policies, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])
    ):
        if not selects(policy, target):
            continue
        spec, types = policy.get("spec") or {}, policy_types(policy)
        policy_ns = policy["metadata"].get("namespace") or "default"
        for direction, section, peers_key in (
            ("ingress", "ingress", "from"),
            ("egress", "egress", "to"),
        ):
            if direction.capitalize() not in types:
                continue
            lines = chains[direction]
            if lines is None:
                lines = chains[direction] = []
            name = f"{policy_ns}/{policy['metadata']['name']}"
            for i, rule in enumerate(spec.get(section) or []):
                matches = _rule_matches(
                    rule, peers_key, policy_ns, target, pods, namespaces, direction == "ingress"
                )
                for m in matches:
                    line = _accept_line(m, direction)
                    lines.append(f'{line} comment "{name} {direction}[{i}]"')
    if chains["ingress"] is None and chains["egress"] is None:
        return None
    hooks = {"ingress": ("input", "iifname"), "egress": ("output", "oifname")}
    out = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    for direction, lines in chains.items():
        hook, ifname = hooks[direction]
        out += [
            f"  chain {direction} {{",
            f"    type filter hook {hook} priority filter; policy accept;",
            "    ct state invalid drop",
            "    ct state established,related accept",
            f'    {ifname} "lo" accept',
            f"    icmp type {{ {ICMP_TYPES} }} accept",
        ]
        if direction == "ingress":
            out.append(f'    ip saddr {node_ip} accept comment "from the node"')
        if lines is not None:
            out += [f"    {line}" for line in dict.fromkeys(lines)]
            out.append('    reject comment "admitted by no NetworkPolicy"')
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"


# --- applying ---------------------------------------------------------------------------------


def nft_command() -> tuple[list[str], dict[str, str]] | None:
    """`nft` (the system's, else the one `make tools` unpacks) and the environment it needs."""
    system = shutil.which("nft")
    if system:
        return [system], {}
    exe = TOOLS_NFT / "usr" / "sbin" / "nft"
    libs = sorted(TOOLS_NFT.glob("usr/lib/*/libnftables.so.1"))
    if exe.exists() and libs:
        return [str(exe)], {"LD_LIBRARY_PATH": str(libs[0].parent)}
    return None


NFT_MISSING = (
    "enforcing NetworkPolicies needs nftables' `nft`: run `make tools` (it unpacks Debian's "
    "nftables into .tools/nftables) or install the nftables package"
)


async def apply_ruleset(netns: str, script: str) -> None:
    """Load `script` into the namespace's nftables in one transaction."""
    found = nft_command()
    if found is None:
        raise RuntimeError(NFT_MISSING)
    argv, extra_env = found
    proc = await asyncio.create_subprocess_exec(
        *("ip", "netns", "exec", netns, *argv, "-f", "-"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **extra_env},
    )
    _, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"nft -f in {netns}: {err.decode().strip()}\n{script}")
