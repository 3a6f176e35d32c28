"""The operator as the chart's namespaced install runs it: `--namespace` names, no scanning
(the default then), and so not one cluster-scoped API request, which is what lets the chart
grant it only a Role in each watched namespace. And a bad policy value stops it at start-up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from operator_harness import NS, api_server, eventually, stopped, tiny_job

from gspo_operator import run
from gspo_operator.handlers import Context
from gspo_operator.kube import USER_AGENT, Kube
from gspo_operator.manifest import ENV_METRICS_FROM


async def test_a_namespaced_operator_makes_no_cluster_scoped_request() -> None:
    import kopf

    async with api_server() as api:
        url = api.base_url
        ctx = Context(kube=Kube.for_host(url), interval_s=0.2)

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, default_namespace=NS)

        stop, ready = asyncio.Event(), asyncio.Event()
        # scanning left to its default, as `gspo operator --namespace=NS` runs it
        task = asyncio.create_task(
            run.serve(ctx, namespaces=[NS], login=login, stop_flag=stop, ready_flag=ready)
        )
        try:
            await asyncio.wait_for(ready.wait(), 20)
            async with (
                aiohttp.ClientSession(url) as http,
                http.post(
                    f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs", json=tiny_job()
                ) as resp,
            ):
                assert resp.status < 300, await resp.text()
            await eventually(lambda: api.list_kind("JobSet", NS), what="the JobSet")
            await asyncio.sleep(0.5)  # a few reconciliations
        finally:
            stop.set()
            await stopped(task, ctx, 20)
            ctx.kube.close()
        ours = [
            r
            for r in api._requests
            if r.resource is not None
            and r.resource.plural is not None  # discovery is open to every client
            and r.headers.get("User-Agent", "").startswith((USER_AGENT, "kopf"))
        ]
        assert ours, "no operator request was recorded"
        cluster_scoped = sorted(
            {f"{r.method.value} {r.resource.plural}" for r in ours if not r.namespace}
        )
        assert not cluster_scoped, f"cluster-scoped requests: {cluster_scoped}"
        assert {r.namespace for r in ours} == {NS}


def test_a_bad_policy_value_stops_the_operator_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_METRICS_FROM, '[{"ipBlock": {"cidr": "0.0.0.0/0"}}]')
    assert run.main(["--namespace=team-a", "--metrics-port=0"]) == 2
    assert "$GSPO_METRICS_FROM (from the chart value networkPolicy.metricsFrom)" in caplog.text
    assert "unknown field(s) ipBlock" in caplog.text
