"""examples/code.yaml on the local cluster with reward.sandbox.mode service (local_cluster.py).

The operator renders the job's sandbox pod (`gspo sandbox-server`), its Service and its
NetworkPolicy; the learner sends every test case to that pod over HTTP with the job's token
and the pass rate and per-outcome counts land in history.jsonl. The node enforces the rendered
NetworkPolicies in the pods' network namespaces (netpol.py, nftables): the test connects from
inside the pods to show the rollout server kept out of the sandbox and the sandbox kept from
everything. What the node does not model (kubelet.py): a RuntimeClass (runtimeClassName is
not applied: there is no gVisor here), seccomp, capabilities and cgroup limits, kube-proxy (the
Service name resolves straight to the ready sandbox pod's IP).

Two steps of the tiny model, whose character vocabulary writes no real program: what shows is
the path (every case run in the sandbox pod, counted by outcome, none a sandbox failure), not
learning. Needs root (network and mount namespaces), nftables and the real kubectl.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from local_cluster import LocalCluster, local_cluster
from netns import unavailable_reason
from netpol import nft_command
from test_local_cluster import BUILD_CACHE, share_build_cache

from gspo_api import ports
from gspo_operator import names

REPO = Path(__file__).resolve().parents[2]
CODE = yaml.safe_load((REPO / "examples/code.yaml").read_text())
BUILD_CACHE_CLAIM, CLUSTER = yaml.safe_load_all((REPO / "examples/local-cluster.yaml").read_text())
JOB, NS = CODE["metadata"]["name"], "default"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
    pytest.mark.skipif(nft_command() is None, reason="nftables' nft is not available"),
]


def code_job(tmp: Path, data: str) -> Path:
    """examples/code.yaml in mode service, two steps, with local-cluster.yaml's CPU settings
    for the pods (and its build cache claim)."""
    doc = copy.deepcopy(CODE)
    spec = doc["spec"]
    spec["data"]["source"] = data
    # runtimeClassName: needed with isolation namespaces (validation); kubelet.py ignores it.
    spec["reward"]["sandbox"].update(mode="service", replicas=1, runtimeClassName="gvisor")
    spec["algorithm"].update(maxSteps=2, promptsPerStep=2, groupSize=2, maxResponseTokens=16)
    spec["checkpoint"].update(everySteps=2, size="1Gi")
    for role in ("learner", "rollout"):
        for key in ("env", "volumes", "volumeMounts"):
            spec[role][key] = copy.deepcopy(CLUSTER["spec"][role][key])
    spec["metrics"] = {"podMonitor": False}
    path = tmp / "code.yaml"
    path.write_text(yaml.safe_dump_all([BUILD_CACHE_CLAIM, doc]))
    return path


async def connects(cluster: LocalCluster, pod: dict, ip: str, port: int) -> str:
    """From inside `pod`'s network namespace: "ok", "refused" or "timeout"."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({ip!r}, {port}), timeout=2).close(); print('ok')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError: print('timeout')\n"
    )
    netns = cluster.node.netns_of(NS, pod["metadata"]["name"])
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", probe]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode().strip()


def history(cluster: LocalCluster) -> list[dict]:
    path = cluster.claim_dir(f"{JOB}-checkpoints") / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ready(pods: list[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    ]


async def test_code_rewards_run_in_the_jobs_sandbox_pod_over_http(tmp_path) -> None:
    async with local_cluster(tmp_path / "cluster") as cluster:
        share_build_cache(cluster)
        data = BUILD_CACHE / f"code-problems-{os.getpid()}.jsonl"  # /cache in the learner pod
        shutil.copyfile(REPO / "examples/data/code-problems.jsonl", data)
        data.chmod(0o644)
        # A listener on the node (the pods' gateway): reachable by any pod the policies let out.
        node = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0)
        node_port = node.sockets[0].getsockname()[1]
        try:
            job = code_job(tmp_path, f"/cache/{data.name}")
            await cluster.kubectl("apply", "--validate=false", "-f", str(job))
            await cluster.wait(
                lambda: (
                    ready(cluster.pods(JOB, names.SANDBOX, running=True))
                    and ready(cluster.pods(JOB, names.LEARNER, running=True))
                    and cluster.pods(JOB, names.ROLLOUT, running=True)
                ),
                120,
                "the sandbox and learner pods Ready beside the rollout pod",
                JOB,
            )
            cluster.mark("the sandbox pod Ready")

            # --- the NetworkPolicies as the node enforces them, from inside the pods ---------
            (sandbox,) = cluster.pods(JOB, names.SANDBOX)
            (learner,) = cluster.pods(JOB, names.LEARNER)
            (rollout,) = cluster.pods(JOB, names.ROLLOUT)
            at, gateway = (
                (sandbox["status"]["podIP"], ports.SANDBOX_HTTP_PORT),
                (sandbox["status"]["hostIP"], node_port),
            )
            assert await connects(cluster, learner, *at) == "ok"
            assert await connects(cluster, rollout, *at) == "refused"
            assert await connects(cluster, learner, *gateway) == "ok"  # the node listens
            assert await connects(cluster, sandbox, *gateway) == "refused"  # nothing out
            metrics = (learner["status"]["podIP"], ports.LEARNER_METRICS_PORT)  # /healthz
            assert await connects(cluster, rollout, *metrics) == "ok"  # the job's own pods
            assert await connects(cluster, sandbox, *metrics) == "refused"

            # --- two steps, every test case run in the sandbox pod ----------------------------
            succeeded = lambda: cluster.status(JOB).get("phase") == "Succeeded"  # noqa: E731
            await cluster.wait(succeeded, 300, "the job to succeed", JOB)
            cluster.mark("2 steps with code rewards from the sandbox pod")
            records = history(cluster)
            assert [r["step"] for r in records] == [1, 2]
            for r in records:
                counts = {k: v for k, v in r.items() if k.startswith("code_tests/")}
                assert sum(counts.values()) > 0 and counts["code_tests/sandbox_failure"] == 0, r
                assert 0.0 <= r["code_pass_rate"] <= 1.0
        finally:
            node.close()
            data.unlink(missing_ok=True)
