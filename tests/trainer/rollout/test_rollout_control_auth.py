"""/control/resume without the token, or with a wrong one: 401, and a paused server stays
paused; a server started without a token refuses every control route (the other control
routes are covered in test_client_server and test_rollout_bad_input)."""

from __future__ import annotations

import aiohttp
from rollout_standin import (
    MODEL,
    TOKEN,
    InProcessServer,
    StandInEngine,
    build_app,
    plugin_env,
    serve_in_process,
)

from gspo_api import ports

GOOD = {"Authorization": f"Bearer {TOKEN}"}


async def test_resume_needs_the_token_and_changes_nothing_without_it() -> None:
    server, url = await serve_in_process(StandInEngine(), 2)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/control/pause", json={}, headers=GOOD) as resp:
                assert resp.status == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/control/resume", json={}, headers=headers) as resp:
                    assert resp.status == 401, headers
                async with http.get(url + "/health") as resp:
                    assert (await resp.json())["paused"] is True
            async with http.post(url + "/control/resume", json={}, headers=GOOD) as resp:
                assert resp.status == 200
            async with http.get(url + "/health") as resp:
                assert (await resp.json())["paused"] is False
    finally:
        await server.stop()


async def test_without_a_token_the_control_routes_are_disabled() -> None:
    """No $GSPO_JOB_TOKEN: nobody can pause or load weights (403 naming the setting, with
    or without a bearer token), while generation and the probes stay open."""
    engine = StandInEngine()
    server, url = await serve_in_process(engine, 5, token=None)
    try:
        async with aiohttp.ClientSession() as http:
            for path in (
                "/control/pause",
                "/control/resume",
                "/control/sync/update",
                "/control/sync/init",
                "/control/sync/load",
            ):
                for headers in ({}, GOOD):
                    async with http.post(url + path, json={}, headers=headers) as resp:
                        assert resp.status == 403, path
                        assert "GSPO_JOB_TOKEN" in (await resp.json())["error"]
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["paused"] is False and health["policy_version"] == 5
            assert engine.weights_loaded == 0
            body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
    finally:
        await server.stop()


async def test_a_server_given_the_tokens_earlier_name_asks_for_that_token() -> None:
    """A pod of a job created by an earlier release sets only $GSPO_SYNC_TOKEN: its server
    still guards the control routes with it."""
    from prometheus_client import CollectorRegistry

    env = {**plugin_env(), ports.ENV_JOB_TOKEN: None, ports.ENV_JOB_TOKEN_EARLIER: TOKEN}
    server = InProcessServer(build_app(StandInEngine(), env, registry=CollectorRegistry()))
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            wrong = {"Authorization": "Bearer wrong"}
            async with http.post(url + "/control/pause", json={}, headers=wrong) as resp:
                assert resp.status == 401
            async with http.post(url + "/control/pause", json={}, headers=GOOD) as resp:
                assert resp.status == 200
    finally:
        await server.stop()


def test_the_new_name_wins_over_the_earlier_one() -> None:
    both = {ports.ENV_JOB_TOKEN: "new", ports.ENV_JOB_TOKEN_EARLIER: "old"}
    assert ports.job_token(both) == "new"
    assert ports.job_token({ports.ENV_JOB_TOKEN_EARLIER: "old"}) == "old"
    assert ports.job_token({ports.ENV_JOB_TOKEN: ""}) is None
