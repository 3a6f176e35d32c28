"""/control/resume without the token, or with a wrong one: 401, and a paused server stays
paused (the other control routes are covered in test_client_server and test_rollout_bad_input)."""

from __future__ import annotations

import aiohttp
from rollout_standin import StandInEngine
from test_client_server import TOKEN, _start


async def test_resume_needs_the_token_and_changes_nothing_without_it() -> None:
    runner, url = await _start(StandInEngine(), initial_version=2)
    good = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/control/pause", json={}, headers=good) as resp:
                assert resp.status == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                async with http.post(url + "/control/resume", json={}, headers=headers) as resp:
                    assert resp.status == 401, headers
                async with http.get(url + "/health") as resp:
                    assert (await resp.json())["paused"] is True
            async with http.post(url + "/control/resume", json={}, headers=good) as resp:
                assert resp.status == 200
            async with http.get(url + "/health") as resp:
                assert (await resp.json())["paused"] is False
    finally:
        await runner.cleanup()
