"""Bad requests to a rollout server: each gets a 4xx naming what to fix, reaches no engine,
and the server keeps serving good requests with nothing left held.

Generation bodies are now vLLM's to validate (/v1/completions: its request model and
SamplingParams, which the stand-in route reuses); what is checked here is that a refusal
passes the plugin's generation gate cleanly: it is counted, stamped, and leaves no request
in flight (a leak would hang the next weight sync's drain). Control bodies are the plugin's
own. The plugin is the project's; only vLLM's engine and route are stood in for.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from rollout_standin import MODEL, TOKEN, StandInEngine, serve_in_process

from gspo_api import ports

GOOD = {
    "model": MODEL,
    "prompt": [3, 4, 5],
    "n": 2,
    "max_tokens": 4,
    "logprobs": 0,
    "return_token_ids": True,
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def bad(**fields: Any) -> dict[str, Any]:
    return {**GOOD, **fields}


BAD_BODIES = [
    # (/v1/completions body, status, words the error message must contain)
    (bad(prompt=[3] * 65), 400, "maximum context length is 64 tokens"),
    (bad(prompt=[[3], [3] * 65]), 400, "maximum context length"),
    (bad(max_tokens=10**9), 400, "max_tokens=1000000000 cannot be greater than max_model_len"),
    (bad(prompt=[3, 99]), 400, "Token id 99 is out of vocabulary"),
    (bad(prompt=[3, -1]), 400, "prompt"),
    (bad(prompt=[[3], []]), 400, "prompt cannot be empty"),
    (bad(prompt=None), 400, "prompt"),
    (bad(n=0), 400, "n must be at least 1"),
    (bad(top_p=0), 400, "top_p"),
    (bad(temperature=-1), 400, "temperature"),
    (bad(max_tokens="four"), 400, "max_tokens"),
    (bad(model="another-model"), 404, "another-model"),
    ([1, 2, 3], 400, "valid dictionary"),
]


def message(payload: Any) -> str:
    """vLLM's error message ({"error": {"message": ...}}) or the plugin's ({"error": ...})."""
    error = payload.get("error") if isinstance(payload, dict) else payload
    return str(error.get("message", error) if isinstance(error, dict) else error)


async def gate_outcomes(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """gspo_rollout_requests_total by outcome, from /metrics."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("gspo_rollout_requests_total{"):
            label, value = line.split("}")
            out[label.split('"')[1]] = float(value)
    return out


@pytest.mark.parametrize(("body", "status", "words"), BAD_BODIES)
async def test_bad_request_is_named_and_the_server_keeps_serving(
    body: object, status: int, words: str
) -> None:
    engine = StandInEngine()
    server, url = await serve_in_process(engine, 0)
    try:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == status
                assert words in message(await resp.json())
                assert resp.headers[ports.VERSION_HEADER] == "0"  # through the gate
            assert engine.seen == [], "a refused request must not reach the engine"
            async with http.get(url + "/health") as resp:
                assert (await resp.json())["active_requests"] == 0
            assert await gate_outcomes(http, url) == {"error": 1.0}
            async with http.post(url + "/control/pause", json={"timeout_s": 5}) as resp:
                assert resp.status == 200  # nothing held: the drain returns
            async with http.post(url + "/control/resume") as resp:
                assert resp.status == 200
            async with http.post(url + "/v1/completions", json=GOOD) as resp:
                assert resp.status == 200
                assert len((await resp.json())["choices"]) == 2
            assert await gate_outcomes(http, url) == {"error": 1.0, "ok": 1.0}
    finally:
        await server.stop()


async def test_malformed_json_is_refused_and_the_server_keeps_serving() -> None:
    server, url = await serve_in_process(StandInEngine(), 0)
    try:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            headers = {"Content-Type": "application/json"}
            async with http.post(url + "/v1/completions", data=b"{prompt: [", headers=headers) as r:
                assert r.status == 400 and "JSON decode error" in message(await r.json())
            async with http.post(url + "/v1/completions", data=b"x", headers={}) as r:
                assert r.status == 400 and "application/json" in message(await r.json())
            async with http.post(url + "/v1/completions", json=GOOD) as resp:
                assert resp.status == 200
    finally:
        await server.stop()


BAD_CONTROL = [
    # (route, raw body, status, words)
    ("/control/pause", b"{nope", 400, "not JSON"),
    ("/control/pause", b"[1, 2]", 400, "JSON object"),
    ("/control/sync/init", b"{}", 400, "missing fields"),
    (
        "/control/sync/init",
        b'{"master_addr": "127.0.0.1", "master_port": 1}',
        400,
        "'rank_offset', 'world_size', 'group_name'",
    ),
    ("/control/sync/update", b"7", 400, "JSON object"),
    ("/control/sync/load", b'{"name": "v00000001", "version": 1}', 409, "GSPO_WEIGHTS_DIR"),
]


@pytest.mark.parametrize(("path", "raw", "status", "words"), BAD_CONTROL)
async def test_a_bad_control_body_is_named_and_changes_nothing(
    path: str, raw: bytes, status: int, words: str
) -> None:
    engine = StandInEngine()  # its worker fails a test that reaches a sync group or a file
    server, url = await serve_in_process(engine, 2)
    try:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            async with http.post(url + path, data=raw) as resp:
                assert resp.status == status and words in (await resp.json())["error"]
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["policy_version"] == 2 and health["paused"] is False
            assert server.engine_client.rpcs == [] and engine.weights_loaded == 0
            async with http.post(url + "/v1/completions", json=GOOD) as resp:
                assert resp.status == 200
    finally:
        await server.stop()


async def test_control_routes_refuse_bad_tokens_and_never_log_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = StandInEngine()
    server, url = await serve_in_process(engine, 3)
    caplog.set_level(logging.DEBUG)
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/control/sync/update", json={}, headers=headers) as r:
                    assert r.status == 401
                    assert TOKEN not in await r.text()
            assert engine.weights_loaded == 0
            async with http.get(url + "/health") as resp:
                assert (await resp.json())["policy_version"] == 3
            async with http.post(url + "/control/sync/update", json={}, headers=AUTH) as resp:
                assert resp.status == 200
            assert engine.weights_loaded == 1
            async with http.get(url + "/metrics") as resp:
                metrics = await resp.text()
        assert TOKEN not in metrics and "wrong" not in metrics
        assert TOKEN not in caplog.text
    finally:
        await server.stop()
