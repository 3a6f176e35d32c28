"""Operator cost: N GSPOJobs applied at once, (1) until every one has all its children and
status Running, against the same number of raw API requests to the same server, then (2) API
requests per job per minute at steady state, every learner training.

The API server is the test stand-in (tests/cluster/apiserver.py) in this process, with the
JobSet and Job controller stand-ins making each job's pods from its JobSet; a simulated
kubelet marks pods Running/Ready as they appear (directly in the store, so it makes no API
requests). Every learner rank 0 answers GET /progress with a step that advances every
`--step-seconds`, as a training learner does. Phase (1)'s baseline replays as many raw
requests as the operator made (creates of small ConfigMaps, all in flight at once through
the same client stack), so the ratio is the operator's own overhead. Phase (2) counts every
request the API server serves during `--window` seconds, watches included, divided by jobs
and minutes: what 200 running jobs cost the API server.

    python bench/bench_operator.py [--jobs 200] [--interval 10] [--window 60]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import time
from collections import Counter
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
                status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": ready}
                await api.patch_status("Pod", NS, name, status)
        await asyncio.sleep(0.05)


def running(api, jobs: int) -> int:
    return sum(
        (j.get("status") or {}).get("phase") == "Running" for j in api.list_kind("GSPOJob", NS)
    )


async def bench(args: argparse.Namespace) -> None:
    import aiohttp
    from operator_harness import api_server, operator, progress_server, tiny_job

    from gspo_api.progress import LearnerProgress
    from gspo_operator.kube import Kube

    async with api_server() as api, progress_server() as prog:
        user = Kube.for_host(api.base_url)
        stop = asyncio.Event()
        fake_kubelet = asyncio.create_task(kubelet(api, stop))
        begun = time.monotonic()

        async def learning() -> None:  # every learner advances one step per --step-seconds
            while not stop.is_set():
                step = int((time.monotonic() - begun) / args.step_seconds)
                prog.value = LearnerProgress(step=step, policy_version=step, reward=0.5)
                await asyncio.sleep(0.1)

        learner = asyncio.create_task(learning())
        options = {"interval_s": args.interval}
        if "progress_write_s" in inspect.signature(operator).parameters:  # not before
            options["progress_write_s"] = args.progress_write
            options["progress_writes_per_minute"] = args.progress_budget
        async with operator(api, **options) as ctx:
            served_before = api.served
            docs = [tiny_job(f"job-{i:03d}", progress_port=prog.port) for i in range(args.jobs)]
            start = time.perf_counter()
            path = f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs"
            async with aiohttp.ClientSession(api.base_url) as session:

                async def post(doc: dict) -> None:
                    async with session.post(path, json=doc) as resp:
                        assert resp.status == 201, await resp.text()

                await asyncio.gather(*(post(d) for d in docs))
            shown = time.perf_counter()
            while running(api, args.jobs) < args.jobs:
                await asyncio.sleep(0.05)
                if time.perf_counter() - shown > 10:  # long work shows progress
                    shown = time.perf_counter()
                    phases = Counter(
                        (j.get("status") or {}).get("phase") for j in api.list_kind("GSPOJob", NS)
                    )
                    print(f"  {shown - start:.0f} s: {dict(phases)}", flush=True)
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

            # Steady state: let start-up settle for one interval, then count for a window.
            await asyncio.sleep(args.interval + 2)
            seen_before, served_at = len(api._requests), api.served
            events_before = {e["metadata"]["name"] for e in api.list_kind("Event", NS)}
            await asyncio.sleep(args.window)
            reasons = Counter(
                e.get("reason")
                for e in api.list_kind("Event", NS)
                if e["metadata"]["name"] not in events_before
            )
            steady = api.served - served_at
            kinds = Counter(
                f"{r.method.value} {r.resource.plural if r.resource else '-'}"
                + ("?watch" if r.params.get("watch") in ("true", "1") else "")
                for r in api._requests[seen_before:]
            )
            steps = sorted(
                int((j.get("status") or {}).get("step") or 0) for j in api.list_kind("GSPOJob", NS)
            )
            per_job_min = steady / args.jobs / (args.window / 60)
            print(
                f"steady state: {steady} API requests in {args.window:.0f} s = "
                f"{per_job_min:.2f} per job per minute; by kind: {dict(kinds.most_common(6))}"
            )
            print(f"status step at the end: min {steps[0]}, max {steps[-1]}", flush=True)
            print(f"Events posted in the window, by reason: {dict(reasons)}", flush=True)
        stop.set()
        await asyncio.gather(fake_kubelet, learner)

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

    print(f"jobs: {args.jobs}, progress interval: {args.interval} s")
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
    p.add_argument("--interval", type=float, default=10.0, help="progress poll, seconds")
    p.add_argument(
        "--progress-write", type=float, default=30.0, help="shortest progress write interval, s"
    )
    p.add_argument(
        "--progress-budget", type=float, default=30.0, help="progress writes a minute, all jobs"
    )
    p.add_argument("--window", type=float, default=60.0, help="steady-state seconds counted")
    p.add_argument("--step-seconds", type=float, default=2.0, help="a learner step, seconds")
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()
