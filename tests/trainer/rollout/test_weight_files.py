"""Weight sync through a shared volume: the version files, and the client and servers over
HTTP. The servers are stand-ins with the project's own endpoint plugin (/control/sync/load,
$GSPO_WEIGHTS_DIR) and worker extension (the file load, reached through the engine client's
collective_rpc); only vLLM's engine and model runner are stood in for, as in the broadcast
tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from rollout_standin import TOKEN, GlooEngine, StandInEngine, serve_in_process

from gspo_api import ports
from gspo_trainer.rollout import weight_files
from gspo_trainer.rollout.client import RolloutClient, SyncOptions
from gspo_trainer.rollout.weight_sync import checkpoint_named_tensors
from gspo_trainer.tiny import build_tiny_model

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(4, 6, 3, generator=g)  # experts.gate_up_proj: its halves are views
    return [
        ("embed.weight", torch.randn(15, 8, generator=g)),
        ("norm.weight", torch.randn(8, generator=g, dtype=torch.float64).to(torch.bfloat16)),
        ("experts.0.gate_proj.weight", fused[0, :3]),
        ("experts.0.up_proj.weight", fused[0, 3:]),
        ("step", torch.tensor([7], dtype=torch.int64)),
    ]


def test_a_version_round_trips_in_shards_and_replaces_the_previous(tmp_path: Path) -> None:
    first, _ = weight_files.write_version(tensors(0), tmp_path, 3, shard_bytes=1024)
    path, nbytes = weight_files.write_version(tensors(1), tmp_path, 4, shard_bytes=200)
    assert path == tmp_path / "v00000004"
    assert not first.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["v00000004"]
    assert len(list(path.glob("*.safetensors"))) > 1  # a 480-byte tensor alone beats 200
    assert nbytes == sum(t.numel() * t.element_size() for _, t in tensors(1))
    loaded = dict(weight_files.read_version(weight_files.resolve(tmp_path, "v00000004")))
    expected = dict(tensors(1))
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


@pytest.mark.parametrize("name", ["../v00000004", "v4", "/etc", "v00000004/..", None, 7])
def test_only_a_version_directory_name_resolves(tmp_path: Path, name: Any) -> None:
    weight_files.write_version(tensors(0), tmp_path, 4, shard_bytes=1024)
    with pytest.raises(ValueError, match="version directory"):
        weight_files.resolve(tmp_path, name)


def test_a_version_not_on_this_volume_says_to_mount_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mounted"):
        weight_files.resolve(tmp_path, "v00000001")


async def test_every_server_loads_the_version_and_one_without_the_volume_is_left_out(
    tmp_path: Path,
) -> None:
    model, _ = build_tiny_model("builtin:tiny-qwen3-moe", seed=3)
    named = checkpoint_named_tensors(model.named_parameters())
    expected = {n: t.detach().clone() for n, t in named}
    engines = [GlooEngine(), GlooEngine(), GlooEngine()]
    weights = tmp_path / "weights"
    started = [await serve_in_process(e, None, weights_dir=weights) for e in engines[:2]]
    started.append(await serve_in_process(engines[2], None))  # no $GSPO_WEIGHTS_DIR
    urls = [url for _, url in started]
    try:
        sync = SyncOptions(
            master_addr="127.0.0.1", method="filesystem", directory=str(weights), bucket_mb=0.05
        )
        async with RolloutClient(urls, TOKEN, sync=sync) as client:
            report = await client.sync_weights(model.named_parameters(), version=5)
            assert report.servers == urls[:2] and report.servers_failed == [urls[2]]
            assert report.bytes_total == sum(t.numel() * 4 for t in expected.values())
            assert [client.servers[u].policy_version for u in urls] == [5, 5, None]
        for (server, _), engine in zip(started[:2], engines[:2], strict=True):
            held = engine.worker.model_runner.weights
            assert held.keys() == expected.keys()
            assert all(torch.equal(held[n], t) for n, t in expected.items())
            # The worker's file load through collective_rpc, then the prefix cache dropped.
            assert server.engine_client.rpcs == ["gspo_load_weights_file"]
            assert engine.prefix_cache_resets == 1
        assert engines[2].worker.model_runner.weights == {}
        assert started[2][0].engine_client.rpcs == []
        async with aiohttp.ClientSession() as http:
            for url, version in zip(urls, [5, 5, None], strict=True):
                async with http.get(url + "/health") as resp:
                    assert (await resp.json())["policy_version"] == version
            async with http.post(
                urls[2] + "/control/sync/load",
                headers=AUTH,
                json={"name": "v00000005", "version": 5},
            ) as resp:
                assert resp.status == 409 and "GSPO_WEIGHTS_DIR" in (await resp.json())["error"]
            async with http.post(
                urls[0] + "/v1/completions",
                headers=AUTH,
                json={"prompt": [3, 4], "max_tokens": 2, "return_token_ids": True},
            ) as resp:
                assert resp.status == 200 and resp.headers[ports.VERSION_HEADER] == "5"
                digest = int(sum(float(t.double().sum()) for t in expected.values())) % 15
                assert (await resp.json())["choices"][0]["token_ids"][0] == digest
    finally:
        for server, _ in started:
            await server.stop()


BAD_LOADS = [
    ({"name": "../../etc", "version": 1}, "version directory"),
    ({"name": "v00000009", "version": 1}, "mounted"),
    ({"name": "v00000001", "version": "1"}, "version must be a non-negative integer"),
    ({"name": "v00000001", "version": -1}, "version must be a non-negative integer"),
    ({"version": 1}, "version directory"),
]


@pytest.mark.parametrize(("body", "words"), BAD_LOADS)
async def test_a_bad_load_request_is_named_and_changes_nothing(
    tmp_path: Path, body: dict[str, Any], words: str
) -> None:
    weight_files.write_version(tensors(0), tmp_path, 1, shard_bytes=1024)
    engine = StandInEngine()  # its file load would fail the test: it must not be reached
    server, url = await serve_in_process(engine, 0, weights_dir=tmp_path)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/control/sync/load", json=body, headers=AUTH) as resp:
                assert resp.status == 400 and words in (await resp.json())["error"]
            async with http.get(url + "/health") as resp:
                health = await resp.json()
            assert health["policy_version"] == 0 and health["paused"] is False
            assert server.engine_client.rpcs == []
    finally:
        await server.stop()
