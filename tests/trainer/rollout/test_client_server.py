"""The client against real HTTP servers built by `server.build_app` around a stand-in engine.

The stand-in replaces only vLLM (deterministic tokens, optional delay); the HTTP routes,
auth, drain gate, client balancing, retries and ordering are the project's own code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rollout_standin import StandInEngine, spawn_standin

from gspo_trainer.rollout.client import RolloutClient, RolloutError
from gspo_trainer.rollout.server import build_app
from gspo_trainer.rollout.types import SamplingParams

TOKEN = "s3cret"


async def _start(engine: StandInEngine, **kw: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(engine, token=TOKEN, **kw))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


PARAMS = SamplingParams(n=3, max_tokens=4)
PROMPTS = [[i % 13 + 2, (i * 7) % 13 + 2, 5] for i in range(37)]


def _check_groups(batch: Any) -> None:
    assert len(batch.groups) == len(PROMPTS)
    for i, (prompt, group) in enumerate(zip(PROMPTS, batch.groups, strict=True)):
        assert [c.prompt_index for c in group] == [i] * PARAMS.n
        assert [c.token_ids[:2] for c in group] == [[sum(prompt) % 15, k] for k in range(3)]


async def test_order_and_spread_over_two_servers() -> None:
    engines = [StandInEngine(0.01), StandInEngine(0.01)]
    started = [await _start(e, initial_version=0) for e in engines]
    try:
        async with RolloutClient([u for _, u in started], TOKEN, chunk_prompts=4) as client:
            batch = await client.generate(PROMPTS, PARAMS)
        _check_groups(batch)
        assert batch.servers_failed == []
        assert all(c.policy_version == 0 for g in batch.groups for c in g)
        counts = sorted(len(e.seen) for e in engines)
        assert sum(counts) == len(PROMPTS) and counts[0] >= 16  # least-outstanding: ~even
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_server_dies_mid_batch_requests_move_to_the_other() -> None:
    alive = StandInEngine(0.05)
    runner, alive_url = await _start(alive, initial_version=0)
    proc, dead_url = await spawn_standin(delay_s=1.0)  # a real process, killed with SIGKILL
    try:
        async with RolloutClient([alive_url, dead_url], TOKEN, chunk_prompts=2) as client:
            task = asyncio.create_task(client.generate(PROMPTS, PARAMS))
            await asyncio.sleep(0.5)
            proc.kill()
            batch = await task
        _check_groups(batch)
        assert batch.servers_failed == [dead_url]
        assert 0 < len(alive.seen) < len(PROMPTS) + 2 * 2 * 3  # most, plus the retried chunks
    finally:
        proc.kill()
        proc.wait(timeout=10)
        await runner.cleanup()


async def test_no_server_left_raises_with_names() -> None:
    runner, url = await _start(StandInEngine(), initial_version=0)
    await runner.cleanup()
    async with RolloutClient([url], TOKEN, probe_timeout_s=1) as client:
        with pytest.raises(RolloutError, match="no rollout server left"):
            await client.generate(PROMPTS[:2], PARAMS)


async def test_not_synced_server_gets_no_traffic_and_is_not_ready() -> None:
    synced, unsynced = StandInEngine(), StandInEngine()
    a = await _start(synced, initial_version=4)
    b = await _start(unsynced)  # started late: no version until the learner's update
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(b[1] + "/ready") as resp:
                assert resp.status == 503
            async with http.get(a[1] + "/ready") as resp:
                assert resp.status == 200
        async with RolloutClient([a[1], b[1]], TOKEN) as client:
            batch = await client.generate(PROMPTS, PARAMS)
        _check_groups(batch)
        assert unsynced.seen == [] and len(synced.seen) == len(PROMPTS)
    finally:
        await a[0].cleanup()
        await b[0].cleanup()


async def test_control_routes_need_the_token() -> None:
    engine = StandInEngine()
    runner, url = await _start(engine, initial_version=1)
    try:
        async with aiohttp.ClientSession() as http:
            paths = ("/control/pause", "/control/sync/update", "/control/sync/init",
                     "/control/sync/load")  # fmt: skip
            for path in paths:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    async with http.post(url + path, json={}, headers=headers) as resp:
                        assert resp.status == 401, path
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["paused"] is False and health["policy_version"] == 1
            assert engine.weights_loaded == 0
            good = {"Authorization": f"Bearer {TOKEN}"}
            async with http.post(url + "/control/sync/update", json={}, headers=good) as resp:
                assert resp.status == 200 and (await resp.json())["policy_version"] == 99
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            assert "gspo_rollout_policy_version 99.0" in text
    finally:
        await runner.cleanup()


async def test_pause_drains_and_holds_new_requests_until_resume() -> None:
    engine = StandInEngine(0.2)
    runner, url = await _start(engine, initial_version=0)
    good = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompts": [[1, 2, 3]], "sampling": {"n": 1, "max_tokens": 3}}
    try:
        async with aiohttp.ClientSession() as http:
            inflight = asyncio.create_task(http.post(url + "/v1/generate", json=body))
            await asyncio.sleep(0.05)
            async with http.post(url + "/control/pause", json={}, headers=good) as resp:
                assert resp.status == 200
            assert inflight.done()  # pause returned only after the in-flight one finished
            later = asyncio.create_task(http.post(url + "/v1/generate", json=body))
            await asyncio.sleep(0.3)
            assert not later.done() and len(engine.seen) == 1
            async with http.post(url + "/control/resume", headers=good) as resp:
                assert resp.status == 200
            assert (await later).status == 200 and len(engine.seen) == 2
            (await inflight).release()
    finally:
        await runner.cleanup()


async def test_generate_token_and_body_errors() -> None:
    """As on a cluster (the rendered rollout pods pass --require-token-for-generate): a
    generation needs the job's token, the learner's client sends it, and what probes and
    Prometheus call stays open."""
    runner, url = await _start(StandInEngine(), initial_version=0, require_token_for_generate=True)
    body = {"prompts": ["1+2="], "sampling": {"n": 2, "max_tokens": 3}}
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/v1/generate", json=body, headers=headers) as resp:
                    assert resp.status == 401, headers
            for probe in ("/health", "/ready", "/metrics"):  # readiness, liveness, scrapes
                async with http.get(url + probe) as resp:
                    assert resp.status == 200, probe
            good = {"Authorization": f"Bearer {TOKEN}"}
            async with http.post(url + "/v1/generate", json=body, headers=good) as resp:
                out = await resp.json()
            assert out["results"][0]["prompt_token_ids"] == [ord(c) % 15 for c in "1+2="]
            bad = {"prompts": [[1]], "sampling": {"n": 1, "max_tokens": 1, "beam": 3}}
            async with http.post(url + "/v1/generate", json=bad, headers=good) as resp:
                assert resp.status == 400 and "beam" in await resp.text()
        async with RolloutClient([url], TOKEN) as client:  # the learner's client
            assert len((await client.generate(PROMPTS[:2], PARAMS)).groups) == 2
        for token in (None, "wrong"):  # refused at once, not retried as a server fault
            async with RolloutClient([url], token) as client:
                with pytest.raises(RolloutError, match="/v1/generate: 401"):
                    await client.generate(PROMPTS[:2], PARAMS)
    finally:
        await runner.cleanup()


async def test_a_refused_prompt_benches_no_server_and_is_named_in_the_batch() -> None:
    """A 400 is the request's fault: every server would refuse it. The client names the
    batch's prompt (not the chunk's) and keeps both servers in service."""
    from gspo_trainer.rollout.client import RequestRefused

    engines = [StandInEngine(), StandInEngine()]
    started = [await _start(e, initial_version=0) for e in engines]
    try:
        async with RolloutClient([u for _, u in started], TOKEN, chunk_prompts=2) as client:
            prompts = [list(p) for p in PROMPTS[:6]]
            prompts[5] = [3] * 61  # the stand-in model holds 64 tokens: 60 with max_tokens 4
            with pytest.raises(RequestRefused) as refused:
                await client.generate(prompts, PARAMS)
            assert refused.value.prompt_index == 5 and "prompts[1]" in str(refused.value)
            assert all(s.alive for s in client.servers.values())
            batch = await client.generate(PROMPTS, PARAMS)  # still served, by both
            _check_groups(batch)
            assert batch.servers_failed == []
    finally:
        for runner, _ in started:
            await runner.cleanup()
