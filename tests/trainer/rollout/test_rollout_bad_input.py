"""Bad requests to a rollout server: each gets a 4xx naming what to fix, and the server keeps
serving good requests. The HTTP layer is the project's own; only vLLM is stood in for."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from rollout_standin import TOKEN, StandInEngine
from test_client_server import _start

from gspo_trainer.rollout.server import MAX_BODY_BYTES, MAX_N

GOOD = {"prompts": [[3, 4, 5]], "sampling": {"n": 2, "max_tokens": 4}}
AUTH = {"Authorization": f"Bearer {TOKEN}"}

BAD_BODIES = [
    # (body, status, words the message must contain)
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": 2}, "temprature": 1}, 400, "temprature"),
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": 2, "beam": 3}}, 400, "beam"),
    ({"prompts": [[3]], "sampling": {"n": 10**9, "max_tokens": 2}}, 400, f"1..{MAX_N}"),
    ({"prompts": [[3]], "sampling": {"n": 0, "max_tokens": 2}}, 400, "sampling.n"),
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": 10**9}}, 400, "--max-model-len"),
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": "4"}}, 400, "sampling.max_tokens"),
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": 2, "top_p": 0}}, 400, "top_p"),
    ({"prompts": [[3]], "sampling": {"n": 1, "max_tokens": 2, "temperature": -1}}, 400, "temp"),
    ({"prompts": [[3]], "sampling": [1, 2]}, 400, "sampling"),
    ({"prompts": [], "sampling": {"n": 1, "max_tokens": 2}}, 400, "non-empty"),
    ({"prompts": "1+2=", "sampling": {"n": 1, "max_tokens": 2}}, 400, "prompts"),
    ({"prompts": [[3], [99]], "sampling": {"n": 1, "max_tokens": 2}}, 400, "prompts[1]"),
    ({"prompts": [[3], [-1]], "sampling": {"n": 1, "max_tokens": 2}}, 400, "0..14"),
    ({"prompts": [[3], []], "sampling": {"n": 1, "max_tokens": 2}}, 400, "prompts[1] is empty"),
    ({"prompts": [[3] * 60], "sampling": {"n": 1, "max_tokens": 8}}, 400, "shorten the prompt"),
    ({"prompts": [[3]] * 100, "sampling": {"n": 1000, "max_tokens": 2}}, 400, "split the batch"),
    ([1, 2, 3], 400, "JSON object"),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_BODIES)
async def test_bad_request_is_named_and_the_server_keeps_serving(
    body: object, status: int, words: str
) -> None:
    engine = StandInEngine()
    runner, url = await _start(engine, initial_version=0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/generate", json=body) as resp:
                assert resp.status == status
                error = (await resp.json())["error"]
            assert words in error
            assert engine.seen == [], "a refused request must not reach the engine"
            async with http.post(url + "/v1/generate", json=GOOD) as resp:
                assert resp.status == 200
                assert len((await resp.json())["results"][0]["completions"]) == 2
    finally:
        await runner.cleanup()


async def test_malformed_json_and_oversized_bodies() -> None:
    runner, url = await _start(StandInEngine(), initial_version=0)
    try:
        async with aiohttp.ClientSession() as http:
            headers = {"Content-Type": "application/json"}
            async with http.post(url + "/v1/generate", data=b"{prompts: [", headers=headers) as r:
                assert r.status == 400 and "not JSON" in (await r.json())["error"]
            huge = b'{"prompts": [[' + b"3," * (MAX_BODY_BYTES // 2) + b"3]]}"
            async with http.post(url + "/v1/generate", data=huge, headers=headers) as r:
                assert r.status == 413
            async with http.post(url + "/v1/generate", json=GOOD) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()


async def test_control_routes_refuse_bad_tokens_and_never_log_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = StandInEngine()
    runner, url = await _start(engine, initial_version=3)
    caplog.set_level(logging.DEBUG)
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/control/sync/update", json={}, headers=headers) as r:
                    assert r.status == 401
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
        await runner.cleanup()
