"""Operator throughput: N GSPOJobs applied at once, until every one has all its children and
status Running, against the same number of raw API requests to the same server.

The API server is the test stand-in (tests/cluster/apiserver.py) in this process, with the
JobSet and Job controller stand-ins making each job's pods from its JobSet; a simulated
kubelet marks pods Running/Ready as they appear (directly in the store, so it makes no API
requests). The baseline replays as many
raw requests as the operator made (creates of small ConfigMaps, all in flight at once through
the same client stack), so the ratio is the operator's own overhead: kopf's watch, handlers,
status patches and timers.

    python bench/bench_operator.py [--jobs 200] [--interval 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / p) for p in ("operator", "trainer", "tests/operator", "tests/cluster", "tests")
]

NS = "default"


async def kubelet(api, stop: asyncio.Event) -> None:
    """Start every pod JobSet's Jobs create and make it Ready, as a cluster would."""
    while not stop.is_set():
        for pod in api.list_kind("Pod", NS):
            if pod.get("status", {}).get("phase") == "Pending":
                ready = [{"type": "Ready", "status": "True"}]
                name = pod["metadata"]["name"]
                await api.patch_status("Pod", NS, name, {"phase": "Running", "conditions": ready})
        await asyncio.sleep(0.05)


def running(api, jobs: int) -> int:
    return sum(
        (j.get("status") or {}).get("phase") == "Running" for j in api.list_kind("GSPOJob", NS)
    )


async def bench(args: argparse.Namespace) -> None:
    import aiohttp
    from operator_harness import api_server, operator, tiny_job

    from gspo_operator.kube import Kube

    async with api_server() as api:
        user = Kube.for_host(api.base_url)
        stop = asyncio.Event()
        fake_kubelet = asyncio.create_task(kubelet(api, stop))
        async with operator(api, interval_s=args.interval) as ctx:
            served_before = api.served
            docs = [tiny_job(f"job-{i:03d}", progress_port=1) for i in range(args.jobs)]
            start = time.perf_counter()
            path = f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs"
            async with aiohttp.ClientSession(api.base_url) as session:

                async def post(doc: dict) -> None:
                    async with session.post(path, json=doc) as resp:
                        assert resp.status == 201, await resp.text()

                await asyncio.gather(*(post(d) for d in docs))
            while running(api, args.jobs) < args.jobs:
                await asyncio.sleep(0.05)
            operator_s = time.perf_counter() - start
            jobsets = len(api.list_kind("JobSet", NS))
            assert jobsets == args.jobs, jobsets
            requests = api.served - served_before
            sample = ctx.metrics.registry.get_sample_value
            reconciles = sum(
                sample("controller_runtime_reconcile_total", {"controller": "gspojob", "result": r})
                or 0
                for r in ("success", "error", "requeue")
            )
            own = ctx.kube.requests_total
        stop.set()
        await fake_kubelet

        # Baseline: the same number of raw requests, all in flight at once, same server.
        body = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}}
        start = time.perf_counter()
        await asyncio.gather(
            *(
                user.create({**body, "metadata": {"name": f"raw-{i}", "namespace": NS}})
                for i in range(requests)
            )
        )
        raw_s = time.perf_counter() - start
        user.close()

    print(f"jobs: {args.jobs}, timer interval: {args.interval} s")
    print(f"operator: {operator_s:.2f} s until every job had its children and phase Running")
    print(
        f"API requests during that time: {requests} ({requests / args.jobs:.1f} per job; "
        f"user creates included)"
    )
    print(f"raw: {requests} requests in {raw_s:.2f} s")
    print(f"ratio operator/raw: {operator_s / raw_s:.2f}x (target <= 3x)")
    print(
        f"reconciles: {reconciles:.0f}; operator requests (kube.py) per reconcile: "
        f"{own / max(reconciles, 1):.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--interval", type=float, default=2.0, help="reconcile timer seconds")
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()
