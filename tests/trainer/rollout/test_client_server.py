"""The client against stand-in rollout servers: vLLM's app shape with the project's real
endpoint plugin (token and gate middlewares, /health, /ready, /control) in front of a
deterministic stand-in for vLLM's engine and /v1/completions route (rollout_standin.py).

The client's balancing, failover, retries, ordering and version checks, and the plugin's
routes, are the project's own code; only vLLM is stood in for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from rollout_standin import (
    MODEL,
    REPO,
    ROUTE_REQUESTS,
    TOKEN,
    StandInEngine,
    serve_in_process,
    spawn_standin,
)

from gspo_api import ports
from gspo_trainer.rollout.client import RequestRefused, RolloutClient, RolloutError
from gspo_trainer.rollout.types import SamplingParams

PARAMS = SamplingParams(n=3, max_tokens=4)
PROMPTS = [[i % 13 + 2, (i * 7) % 13 + 2, 5] for i in range(37)]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _check_groups(batch: Any, params: SamplingParams = PARAMS) -> None:
    assert len(batch.groups) == len(PROMPTS)
    for i, (prompt, group) in enumerate(zip(PROMPTS, batch.groups, strict=True)):
        assert [c.prompt_index for c in group] == [i] * params.n
        assert [c.token_ids[:2] for c in group] == [[sum(prompt) % 15, k] for k in range(3)]
        assert all(len(c.token_ids) == len(c.logprobs) == params.max_tokens for c in group)


def completion(prompt: list[int], **sampling: Any) -> dict[str, Any]:
    """A /v1/completions body as the learner's client sends it."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "n": 1,
        "max_tokens": 3,
        "logprobs": 0,
        "return_token_ids": True,
        **sampling,
    }


async def test_order_and_spread_over_two_servers() -> None:
    engines = [StandInEngine(0.01), StandInEngine(0.01)]
    started = [await serve_in_process(e, 0) for e in engines]
    seeded = SamplingParams(n=3, max_tokens=4, seed=1000)
    try:
        async with RolloutClient([u for _, u in started], TOKEN, chunk_prompts=4) as client:
            batch = await client.generate(PROMPTS, seeded)
            assert {s.model for s in client.servers.values()} == {MODEL}  # from /health
        _check_groups(batch, seeded)
        assert batch.servers_failed == []
        assert all(c.policy_version == 0 for g in batch.groups for c in g)
        counts = sorted(len(e.seen) for e in engines)
        assert sum(counts) == len(PROMPTS) and counts[0] >= 16  # least-outstanding: ~even
        # One request per prompt, each with its batch seed (base + index * n), whichever
        # server and chunk it went to.
        seeds = sorted(
            (p, params.seed)
            for e in engines
            for rid, p, params in e.requests
            if rid.startswith(ROUTE_REQUESTS)
        )
        assert seeds == sorted((p, 1000 + i * 3) for i, p in enumerate(PROMPTS))
        for engine in engines:  # the plugin warmed each engine up at start-up, before any
            # request: one greedy generation, then sampled ones with the log-probs the learner
            # asks for at two batch sizes (vLLM's sampler compiles again for the second).
            warm = engine.requests[: len(engine.warm_ups)]
            assert [rid for rid, _, _ in warm] == engine.warm_ups and len(warm) == 3
            params = [p for _, _, p in warm]
            assert params[0].temperature == 0 and params[0].logprobs is None
            assert all(p.temperature > 0 and p.logprobs == 0 for p in params[1:])
            assert len({p.n for p in params[1:]}) == 2
    finally:
        for server, _ in started:
            await server.stop()


async def test_server_dies_mid_batch_requests_move_to_the_other() -> None:
    alive = StandInEngine(0.05)
    server, alive_url = await serve_in_process(alive, 0)
    proc, dead_url = await spawn_standin(delay_s=1.0)  # a real process, killed with SIGKILL
    try:
        async with RolloutClient([alive_url, dead_url], TOKEN, chunk_prompts=2) as client:
            task = asyncio.create_task(client.generate(PROMPTS, PARAMS))
            await asyncio.sleep(0.5)
            proc.kill()
            batch = await task
        _check_groups(batch)
        assert batch.servers_failed == [dead_url]
        assert all(c.policy_version == 0 for g in batch.groups for c in g)
        assert 0 < len(alive.seen) < len(PROMPTS) + 2 * 2 * 3  # most, plus the retried chunks
    finally:
        proc.kill()
        proc.wait(timeout=10)
        await server.stop()


async def test_no_server_left_raises_with_names() -> None:
    server, url = await serve_in_process(StandInEngine(), 0)
    await server.stop()
    async with RolloutClient([url], TOKEN, probe_timeout_s=1) as client:
        with pytest.raises(RolloutError, match="no rollout server left"):
            await client.generate(PROMPTS[:2], PARAMS)


def rendered_readiness_path() -> str:
    """The path of the readiness probe the operator gives the flagship example's servers."""
    import yaml

    from gspo_api.validation import parse_spec
    from gspo_operator import render
    from gspo_operator.manifest import ClusterPolicy

    body = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
    body["metadata"].update(namespace="default", uid="u")
    objs = render.render_job(body, parse_spec(body["spec"]), token="t", policy=ClusterPolicy())
    (js,) = [o for o in objs if o["kind"] == "JobSet"]
    (rollout,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == "rollout"]
    (container,) = rollout["template"]["spec"]["template"]["spec"]["containers"]
    return str(container["readinessProbe"]["httpGet"]["path"])


async def test_a_server_is_ready_once_its_engine_serves_before_the_first_sync() -> None:
    """Kueue's WaitForPodsReady evicts a job whose pods are not all Ready within its timeout
    (5 minutes by default), and the first sync waits for the learner to load its model: the
    readiness the operator renders must pass on a live, unsynced server. Whether it holds
    the learner's weights is /health's `synced`, which the learner reads."""
    path = rendered_readiness_path()
    server, url = await serve_in_process(StandInEngine(), None)  # no weights synced yet
    try:
        async with aiohttp.ClientSession() as http, http.get(url + path) as resp:
            assert resp.status == 200, await resp.text()
            async with http.get(url + "/health") as health:
                assert (await health.json())["synced"] is False
    finally:
        await server.stop()


async def test_not_synced_server_gets_no_traffic_and_is_not_ready() -> None:
    synced, unsynced = StandInEngine(), StandInEngine()
    a = await serve_in_process(synced, 4)
    b = await serve_in_process(unsynced, None)  # started late: no version until an update
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(b[1] + "/ready") as resp:
                assert resp.status == 503
            async with http.get(a[1] + "/ready") as resp:
                assert resp.status == 200
            async with http.get(b[1] + "/health") as resp:
                health = await resp.json()
            assert resp.status == 200 and health["synced"] is False
            assert health["policy_version"] is None
            # Asked directly, it refuses to generate rather than serve unsynced weights.
            async with http.post(
                b[1] + "/v1/completions", json=completion([3, 4]), headers=AUTH
            ) as resp:
                assert resp.status == 503 and "not synced" in (await resp.json())["error"]
        async with RolloutClient([a[1], b[1]], TOKEN) as client:
            batch = await client.generate(PROMPTS, PARAMS)
        _check_groups(batch)
        assert all(c.policy_version == 4 for g in batch.groups for c in g)
        assert unsynced.seen == [] and len(synced.seen) == len(PROMPTS)
    finally:
        await a[0].stop()
        await b[0].stop()


async def test_control_routes_need_the_token() -> None:
    engine = StandInEngine()
    server, url = await serve_in_process(engine, 1)
    try:
        async with aiohttp.ClientSession() as http:
            paths = (
                "/control/pause",
                "/control/resume",
                "/control/sync/update",
                "/control/sync/init",
                "/control/sync/load",
            )
            for path in paths:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    async with http.post(url + path, json={}, headers=headers) as resp:
                        assert resp.status == 401, path
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["paused"] is False and health["policy_version"] == 1
            assert engine.weights_loaded == 0 and server.engine_client.rpcs == []
            async with http.post(url + "/control/sync/update", json={}, headers=AUTH) as resp:
                assert resp.status == 200 and (await resp.json())["policy_version"] == 99
            # Through the engine client: the worker's method, then the stale prefix cache
            # dropped.
            assert server.engine_client.rpcs == ["gspo_receive_weights"]
            assert engine.weights_loaded == 1 and engine.prefix_cache_resets == 1
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            assert "gspo_rollout_policy_version 99.0" in text
            async with http.post(
                url + "/v1/completions", json=completion([3]), headers=AUTH
            ) as resp:
                assert resp.headers[ports.VERSION_HEADER] == "99"
    finally:
        await server.stop()


async def test_pause_drains_and_holds_new_requests_until_resume() -> None:
    engine = StandInEngine(0.2)
    server, url = await serve_in_process(engine, 0)
    body = completion([1, 2, 3])
    try:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            inflight = asyncio.create_task(http.post(url + "/v1/completions", json=body))
            await asyncio.sleep(0.05)
            async with http.post(url + "/control/pause", json={}) as resp:
                assert resp.status == 200
            assert inflight.done()  # pause returned only after the in-flight one finished
            later = asyncio.create_task(http.post(url + "/v1/completions", json=body))
            await asyncio.sleep(0.3)
            assert not later.done() and len(engine.seen) == 1
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["paused"] is True and health["active_requests"] == 0
            async with http.post(url + "/control/resume") as resp:
                assert resp.status == 200
            reply = await later
            assert reply.status == 200 and len(engine.seen) == 2
            assert reply.headers[ports.VERSION_HEADER] == "0"
            reply.release()
            (await inflight).release()
    finally:
        await server.stop()


async def test_generation_needs_the_token_and_the_probes_do_not() -> None:
    """As on a cluster: a generation needs the job's token (the plugin checks it on vLLM's
    routes), the learner's client sends it, and what probes and Prometheus call stays open."""
    server, url = await serve_in_process(StandInEngine(), 0)
    body = {"model": MODEL, "prompt": "1+2=", "n": 2, "max_tokens": 3, "return_token_ids": True}
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 401, headers
            for probe in ("/health", "/ready", "/metrics"):  # readiness, liveness, scrapes
                async with http.get(url + probe) as resp:
                    assert resp.status == 200, probe
            async with http.post(url + "/v1/completions", json=body, headers=AUTH) as resp:
                out = await resp.json()
            assert [c["prompt_token_ids"] for c in out["choices"]] == [
                [ord(c) % 15 for c in "1+2="]
            ] * 2
        async with RolloutClient([url], TOKEN) as client:  # the learner's client
            assert len((await client.generate(PROMPTS[:2], PARAMS)).groups) == 2
        for token in (None, "wrong"):  # refused at once, not retried as a server fault
            async with RolloutClient([url], token) as client:
                with pytest.raises(RolloutError, match="/inference/v1/generate: 401"):
                    await client.generate(PROMPTS[:2], PARAMS)
                assert client.servers[url].alive
    finally:
        await server.stop()


async def test_a_refused_prompt_benches_no_server_and_is_named_in_the_batch() -> None:
    """A 400 is the request's fault: every server would refuse it. The client names the
    batch's prompt (not the chunk's) and keeps both servers in service."""
    engines = [StandInEngine(), StandInEngine()]
    started = [await serve_in_process(e, 0) for e in engines]
    try:
        async with RolloutClient([u for _, u in started], TOKEN, chunk_prompts=2) as client:
            prompts = [list(p) for p in PROMPTS[:6]]
            prompts[5] = [3] * 65  # the stand-in model holds 64 tokens
            with pytest.raises(RequestRefused) as refused:
                await client.generate(prompts, PARAMS)
            assert refused.value.prompt_index == 5
            assert "maximum context length is 64 tokens" in str(refused.value)
            assert all(s.alive for s in client.servers.values())
            assert [3] * 65 not in engines[0].seen + engines[1].seen
            # vLLM clamps max_tokens to what fits: a 62-token prompt is served 2 tokens.
            prompts[5] = [3] * 62
            batch = await client.generate(prompts, PARAMS)
            assert [len(c.token_ids) for c in batch.groups[5]] == [2] * PARAMS.n
            assert {c.finish_reason for c in batch.groups[5]} == {"length"}
            batch = await client.generate(PROMPTS, PARAMS)  # still served, by both
            _check_groups(batch)
            assert batch.servers_failed == []
    finally:
        for server, _ in started:
            await server.stop()


async def test_a_server_whose_engine_died_is_down_and_gets_no_traffic() -> None:
    """vLLM's engine can die under a live HTTP server: /health (the plugin's) answers 503,
    and the client treats the server as down."""
    engines = [StandInEngine(), StandInEngine()]
    started = [await serve_in_process(e, 0) for e in engines]
    started[1][0].engine_client.dead = True
    try:
        async with aiohttp.ClientSession() as http, http.get(started[1][1] + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "engine dead"
        async with RolloutClient([u for _, u in started], TOKEN) as client:
            batch = await client.generate(PROMPTS, PARAMS)
            assert not client.servers[started[1][1]].alive
        _check_groups(batch)
        assert len(engines[0].seen) == len(PROMPTS) and engines[1].seen == []
    finally:
        for server, _ in started:
            await server.stop()


async def test_a_server_left_paused_is_resumed_before_it_is_sent_work() -> None:
    """A resume the server never answered leaves it paused, and the client marks it down: the
    next generation finds it paused at its probe and resumes it first, instead of sending it
    requests that wait out its admission timeout (600 s) and stall the step."""
    server, url = await serve_in_process(StandInEngine(0.01), 0)
    try:
        async with RolloutClient([url], TOKEN, chunk_prompts=4) as client:
            await client.generate(PROMPTS[:4], PARAMS)
            async with (
                aiohttp.ClientSession(headers=AUTH) as http,
                http.post(url + "/control/pause", json={}) as resp,
            ):
                assert resp.status == 200
            client.servers[url].alive = False  # what _control_all makes of a failed resume
            batch = await asyncio.wait_for(client.generate(PROMPTS, PARAMS), 30)
            _check_groups(batch)
            assert batch.servers_failed == []
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
                assert (await resp.json())["paused"] is False
    finally:
        await server.stop()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_http(serve: Handler) -> AsyncIterator[str]:
    """A bare server on 127.0.0.1 that speaks HTTP as `serve` writes it (to drop or keep
    connections where a real server would): its URL, closed afterwards."""
    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()
        await listener.wait_closed()


async def test_pause_and_resume_are_sent_again_when_the_server_drops_the_connection() -> None:
    """A kept-alive connection the server closes as a request goes out fails with no reply:
    pause and resume (idempotent) go once more; other control requests do not."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        if connections % 2 == 1:  # every first try: closed with no reply
            writer.close()
            return
        body = b'{"paused": false}'
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    async with raw_http(serve) as url, RolloutClient([url], TOKEN) as client:
        assert await client._control(url, "/control/resume", {}, 5) == {"paused": False}
        assert connections == 2
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client._control(url, "/control/sync/load", {}, 5)
        assert connections == 3


async def test_sync_requests_never_go_out_on_a_connection_the_server_may_be_closing() -> None:
    """A server that answers a connection's first request and closes it as the next arrives
    (uvicorn closing a kept-alive connection idle 5 s, racing the request): the sync's
    control requests, which must not be sent twice, each take a new connection and get
    their reply; pause, on the shared pool, meets the race (and is sent again: idempotent)."""
    seen = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        first = True
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            seen += 1
            if not first:  # kept alive, then closed as the next request came in
                break
            first = False
            body = b'{"policy_version": 1}'
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    async with raw_http(serve) as url, RolloutClient([url], TOKEN) as client:
        for path in ("/control/sync/update", "/control/sync/update", "/control/sync/load"):
            assert await client._post(url, path, {}, 5) == {"policy_version": 1}
        assert await client._post(url, "/control/pause", {}, 5) == {"policy_version": 1}
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client._post(url, "/control/pause", {}, 5)  # the kept-alive connection
        assert seen == 5


async def test_the_pool_lets_a_connection_go_before_vllm_would_close_it() -> None:
    """vLLM's server closes a connection idle VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); a request
    on one it is closing is lost with no reply. The client's pool drops its idle connections
    sooner (KEEPALIVE_S), so a request after a longer pause opens a new one."""
    from gspo_trainer.rollout.client import KEEPALIVE_S

    envs = pytest.importorskip("vllm.envs")

    assert KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            body = b'{"paused": true}'
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        writer.close()

    async with raw_http(serve) as url, RolloutClient([url], TOKEN) as client:
        await client._post(url, "/control/pause", {}, 5)
        await client._post(url, "/control/pause", {}, 5)
        assert connections == 1  # kept alive between requests close together
        await asyncio.sleep(KEEPALIVE_S + 0.5)
        await client._post(url, "/control/pause", {}, 5)
        assert connections == 2
