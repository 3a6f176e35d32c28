"""Weight sync through faults: a server vanishes mid-broadcast, a server restarts mid-run.

Servers are stand-in processes (rollout_standin.py): the project's endpoint plugin on vLLM's
app shape, whose engine client reaches the project's own worker extension, which joins the
sync group and receives weights over real gloo; only vLLM's engine, route and model runner
are replaced (the runner by a dict that loads slowly, so a broadcast can be interrupted).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import pytest
import torch
from rollout_standin import TOKEN, free_port, spawn_standin

from gspo_trainer.rollout.client import RolloutClient, SyncOptions
from gspo_trainer.rollout.types import SamplingParams

pytestmark = pytest.mark.e2e

SYNC_TIMEOUT_S = 8.0
PARAMS = SamplingParams(n=2, max_tokens=3)


def weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {f"layers.{i}.weight": torch.randn(64, 16, generator=gen) for i in range(40)}


def digest(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(float(t.double().sum()) for t in tensors.values())) % 15


async def health(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
        return await resp.json()


async def heads(client: RolloutClient) -> set[tuple[int, int]]:
    """(weights digest, policy version) of every sample in a batch spread over the fleet."""
    batch = await client.generate([[i % 10 + 3, 4, 5] for i in range(24)], PARAMS)
    return {(c.token_ids[0], c.policy_version) for group in batch.groups for c in group}


@pytest.fixture
async def fleet():
    """start(count, seconds_per_tensor, port=0) -> [(process, url)]; all killed afterwards."""
    procs = []

    async def start(count: int, seconds_per_tensor: float = 0.0, port: int = 0) -> list[Any]:
        started = await asyncio.gather(
            *(spawn_standin(seconds_per_tensor, "gloo", None, port) for _ in range(count))
        )
        procs.extend(p for p, _ in started)
        return list(started)

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


async def test_server_vanishing_mid_broadcast(fleet) -> None:  # type: ignore[no-untyped-def]
    servers = await fleet(3, seconds_per_tensor=0.05)  # ~2 s to load 40 tensors
    urls = [url for _, url in servers]
    victim_proc, victim = servers[2]
    sync = SyncOptions("127.0.0.1", free_port(), bucket_mb=0.01, timeout_s=SYNC_TIMEOUT_S)
    async with RolloutClient(urls, token=TOKEN, sync=sync, timeout_s=30) as client:
        first = await client.sync_weights(weights(1).items(), version=1)
        assert sorted(first.servers) == sorted(urls)

        task = asyncio.create_task(client.sync_weights(weights(2).items(), version=2))
        deadline = time.monotonic() + 20
        while not (await health(victim))["paused"]:  # the update has begun on the victim
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        victim_proc.kill()
        killed_at = time.monotonic()
        report = await asyncio.wait_for(task, timeout=4 * SYNC_TIMEOUT_S + 30)
        detected_s = time.monotonic() - killed_at

        assert report.version == 2 and sorted(report.servers) == sorted(urls[:2])
        assert report.servers_failed == [victim] and report.regrouped
        assert detected_s < 3 * SYNC_TIMEOUT_S + 20, detected_s
        for url in urls[:2]:
            assert (await health(url))["policy_version"] == 2
        # Both survivors hold exactly version 2's weights; no sample comes from version 1.
        assert await heads(client) == {(digest(weights(2)), 2)}

        third = await client.sync_weights(weights(3).items(), version=3)
        assert sorted(third.servers) == sorted(urls[:2]) and not third.regrouped
        assert await heads(client) == {(digest(weights(3)), 3)}


async def test_restarted_server_serves_only_after_receiving_current_weights(fleet) -> None:  # type: ignore[no-untyped-def]
    servers = await fleet(2)
    urls = [url for _, url in servers]
    sync = SyncOptions("127.0.0.1", free_port(), bucket_mb=0.01, timeout_s=SYNC_TIMEOUT_S)
    async with RolloutClient(urls, token=TOKEN, sync=sync, timeout_s=30) as client:
        await client.sync_weights(weights(1).items(), version=1)
        await client.sync_weights(weights(2).items(), version=2)
        current = {(digest(weights(2)), 2)}

        proc, url = servers[1]
        proc.kill()
        proc.wait(timeout=10)
        port = int(url.rsplit(":", 1)[1])
        ((_, restarted),) = await fleet(1, port=port)  # back on its address, unsynced
        assert restarted == url and (await health(url))["policy_version"] is None
        # Until the next sync, only the synced server gets work; nothing stale comes back.
        assert await heads(client) == current
        report = await client.sync_weights(weights(3).items(), version=3)
        assert sorted(report.servers) == sorted(urls) and report.regrouped
        assert (await health(url))["policy_version"] == 3
        assert await heads(client) == {(digest(weights(3)), 3)}
