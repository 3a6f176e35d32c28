"""Real vLLM rollout servers (CPU build) on tiny random models: four engine starts in all.

Engine log-probs are compared with a transformers forward of the same weights, in float32,
within LOGPROB_ATOL (measured gaps are ~1e-5; the engine uses different kernels).
"""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_standin import TOKEN, free_port

from gspo_trainer.rollout.client import RolloutClient, SyncOptions
from gspo_trainer.rollout.types import RolloutBatch, SamplingParams
from gspo_trainer.tiny import build_tiny_model, materialize

pytestmark = pytest.mark.e2e

LOGPROB_ATOL = 2e-3
PROMPTS = [[3, 4, 13, 5, 14], [9, 9, 13, 2, 14], [3, 13, 3, 14], [12, 11, 10, 13, 8, 7, 14]]
SAMPLE = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7)
GREEDY = SamplingParams(n=1, max_tokens=10, temperature=0.0)


def hf_logprobs(
    model: Any, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log pi(response_t | prompt, response_<t) from a transformers forward, under the
    sampling temperature (the distribution the tokens were drawn from).  # (T,)"""
    ids = torch.tensor([prompt + response])  # (1, P+T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (P+T, V)
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)  # (T, V)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_gap(model: Any, batch: RolloutBatch, temperature: float = 1.0) -> float:
    gaps = []
    for prompt, group in zip(batch.prompts, batch.groups, strict=True):
        for c in group:
            ref = hf_logprobs(model, prompt, c.token_ids, temperature)
            gaps.append((ref - torch.tensor(c.logprobs)).abs().max().item())
    return max(gaps)


def with_experts_perturbed(model: Any, std: float) -> Any:
    """A copy of `model` whose expert weights (and nothing else) get N(0, std) noise added."""
    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        experts = [p for name, p in new.named_parameters() if ".experts." in name]
        assert experts, "the model has no expert weights"
        for p in experts:
            p.add_(std * torch.randn(p.shape, generator=generator))
    return new


def check_batch(batch: RolloutBatch, params: SamplingParams, version: int) -> None:
    assert len(batch.groups) == len(PROMPTS)
    for i, group in enumerate(batch.groups):
        assert len(group) == params.n
        for c in group:
            assert c.prompt_index == i and c.policy_version == version
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= params.max_tokens
            assert all(0 <= t < 15 for t in c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == 1  # EOS ends the response and is part of it


def generate(urls: list[str], params: SamplingParams, **kw: Any) -> RolloutBatch:
    async def run() -> RolloutBatch:
        async with RolloutClient(urls, TOKEN, timeout_s=120, **kw) as client:
            return await client.generate(PROMPTS, params)

    return asyncio.run(run())


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post(url: str, body: dict[str, Any], token: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def dense_dir(model_root: Path) -> Path:
    return materialize("builtin:tiny-qwen3", model_root)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The learner's weight directory (weightSync filesystem), shared with the servers."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def dense_pair(start_rollout: Any, dense_dir: Path, weights_root: Path) -> list[Any]:
    return start_rollout(
        dense_dir, 2, "--initial-policy-version", "0", "--weights-dir", str(weights_root)
    )


def sync_from_files(urls: list[str], model: Any, version: int, root: Path) -> Any:
    async def run() -> Any:
        sync = SyncOptions(
            master_addr="127.0.0.1", method="filesystem", directory=str(root), bucket_mb=0.05
        )
        async with RolloutClient(urls, TOKEN, sync=sync) as client:
            return await client.sync_weights(model.named_parameters(), version=version)

    return asyncio.run(run())


def test_moe_generation_logprobs_and_update(
    start_rollout: Any, model_root: Path, tmp_path: Path
) -> None:
    moe_dir = materialize("builtin:tiny-qwen3-moe", model_root)
    (server,) = start_rollout(
        moe_dir, 1, "--initial-policy-version", "0", "--weights-dir", str(tmp_path)
    )
    old, _ = build_tiny_model("builtin:tiny-qwen3-moe")
    new = with_experts_perturbed(old, std=0.3)  # only the experts differ
    first = generate([server.url], SAMPLE)
    check_batch(first, SAMPLE, version=0)
    assert max_logprob_gap(old, first) < LOGPROB_ATOL

    async def run() -> tuple[RolloutBatch, Any]:
        sync = SyncOptions(master_addr="127.0.0.1", master_port=free_port(), timeout_s=120)
        async with RolloutClient([server.url], TOKEN, sync=sync) as client:
            report = await client.sync_weights(new.named_parameters(), version=5)
            return await client.generate(PROMPTS, SAMPLE), report

    batch, report = asyncio.run(run())
    assert report.servers == [server.url] and report.servers_failed == []
    check_batch(batch, SAMPLE, version=5)
    assert max_logprob_gap(new, batch) < LOGPROB_ATOL  # the experts' kernel sees the update
    assert max_logprob_gap(old, batch) > 0.05
    # The same experts' reload, from safetensors on a shared volume (weightSync filesystem).
    report = sync_from_files([server.url], old, 6, tmp_path)
    assert report.servers == [server.url] and report.servers_failed == []
    batch = generate([server.url], SAMPLE)
    check_batch(batch, SAMPLE, version=6)
    assert max_logprob_gap(old, batch) < LOGPROB_ATOL
    server.stop()


def test_dense_generation_logprobs_match_transformers(dense_pair: list[Any], dense_dir) -> None:  # type: ignore[no-untyped-def]
    batch = generate([s.url for s in dense_pair], SAMPLE)
    check_batch(batch, SAMPLE, version=0)
    model, _ = build_tiny_model("builtin:tiny-qwen3")
    assert max_logprob_gap(model, batch) < LOGPROB_ATOL


def test_engine_logprobs_are_those_of_the_sampling_distribution(dense_pair: list[Any]) -> None:  # type: ignore[no-untyped-def]
    """At T != 1 the engine reports log-probs after temperature (what the learner computes
    for the same tokens), so their gap is numerics only; before temperature it would be the
    temperature's effect, which the mismatch metric and alert would then measure."""
    params = SamplingParams(n=3, max_tokens=10, temperature=0.7, seed=7)
    batch = generate([s.url for s in dense_pair], params)
    model, _ = build_tiny_model("builtin:tiny-qwen3")
    assert max_logprob_gap(model, batch, temperature=0.7) < 1e-4
    assert max_logprob_gap(model, batch, temperature=1.0) > 0.05  # raw log-probs would be these


def test_seeded_prompts_over_one_steps_token_budget_are_all_served(dense_pair: list[Any]) -> None:
    """32 distinct seeded 100-token prompts reach one server at once: 3,200 prompt tokens,
    more than one engine step takes (2,048). With chunked prefill a prompt split over two steps
    made the CPU engine rewind its seeded generator, which CPU generators refuse: the engine
    died and every later request failed (serve_command.py)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(2, 15, (100,), generator=generator)] for _ in range(32)
    ]
    params = SamplingParams(n=1, max_tokens=4, temperature=1.0, seed=3)

    async def run() -> RolloutBatch:
        async with RolloutClient([dense_pair[0].url], TOKEN, timeout_s=120) as client:
            return await client.generate(prompts, params)

    batch = asyncio.run(run())
    assert [len(group) for group in batch.groups] == [1] * len(prompts)
    assert all(1 <= len(c.token_ids) <= params.max_tokens for g in batch.groups for c in g)
    assert dense_pair[0].proc.poll() is None  # the server is still up for the tests after


def test_update_without_token_is_refused_and_changes_nothing(dense_pair: list[Any]) -> None:
    url = dense_pair[0].url
    before = generate([url], GREEDY)
    assert post(url + "/control/sync/update", {"timeout_s": 5}, token=None) == 401
    assert post(url + "/control/sync/update", {"timeout_s": 5}, token="wrong") == 401
    assert post(url + "/control/pause", {}, token=None) == 401
    status, health = get_json(url + "/health")
    assert status == 200 and health["policy_version"] == 0 and health["paused"] is False
    after = generate([url], GREEDY)
    assert [c.token_ids for g in after.groups for c in g] == [
        c.token_ids for g in before.groups for c in g
    ]
    assert [c.logprobs for g in after.groups for c in g] == [
        c.logprobs for g in before.groups for c in g
    ]


def test_one_broadcast_updates_both_servers(dense_pair: list[Any]) -> None:
    old, _ = build_tiny_model("builtin:tiny-qwen3")
    new, _ = build_tiny_model("builtin:tiny-qwen3", seed=1)
    urls = [s.url for s in dense_pair]

    async def run() -> Any:
        sync = SyncOptions(master_addr="127.0.0.1", master_port=free_port(), bucket_mb=0.05)
        async with RolloutClient(urls, TOKEN, sync=sync) as client:
            return await client.sync_weights(new.named_parameters(), version=1)

    report = asyncio.run(run())
    assert sorted(report.servers) == sorted(urls) and report.servers_failed == []
    assert report.bytes_total == sum(p.numel() * 4 for p in new.parameters())
    per_server = [generate([u], GREEDY) for u in urls]
    for batch in per_server:
        check_batch(batch, GREEDY, version=1)
        assert max_logprob_gap(new, batch) < LOGPROB_ATOL
        assert max_logprob_gap(old, batch) > 0.05
    a, b = ([c.token_ids for g in batch.groups for c in g] for batch in per_server)
    assert a == b
    with urllib.request.urlopen(urls[0] + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "gspo_rollout_policy_version 1.0" in metrics
    assert f"gspo_rollout_last_sync_bytes {float(report.bytes_total)}" in metrics
    assert "vllm:" in metrics  # the engine's own metrics are served too


def test_versions_written_to_a_shared_volume_update_both_servers(
    dense_pair: list[Any], weights_root: Path
) -> None:
    previous, _ = build_tiny_model("builtin:tiny-qwen3", seed=1)  # the broadcast's version
    new, _ = build_tiny_model("builtin:tiny-qwen3", seed=2)
    urls = [s.url for s in dense_pair]
    report = sync_from_files(urls, new, 2, weights_root)
    assert sorted(report.servers) == sorted(urls) and report.servers_failed == []
    assert report.bytes_total == sum(p.numel() * 4 for p in new.parameters())
    assert [p.name for p in weights_root.iterdir()] == ["v00000002"]
    for url in urls:
        batch = generate([url], GREEDY)
        check_batch(batch, GREEDY, version=2)
        assert max_logprob_gap(new, batch) < LOGPROB_ATOL
        assert max_logprob_gap(previous, batch) > 0.05


def test_a_load_that_fails_part_way_leaves_the_server_able_to_load_the_next(
    dense_pair: list[Any], weights_root: Path
) -> None:
    """A version whose last shard is unreadable fails after the first was loaded:
    the server answers 500 and serves nothing (not synced), and the next good version loads
    and generates (vLLM's in-place reload, interrupted, would leave layers it can never load
    again)."""
    from gspo_trainer.rollout import weight_files

    url = dense_pair[0].url
    broken, _ = build_tiny_model("builtin:tiny-qwen3", seed=5)
    good, _ = build_tiny_model("builtin:tiny-qwen3", seed=6)
    # Shard 1: the embedding and layer 0's q_proj (vLLM's fused qkv_proj then half loaded);
    # shard 2 unreadable.
    first = list(broken.named_parameters())[:2]
    assert first[1][0] == "model.layers.0.self_attn.q_proj.weight"
    path, _ = weight_files.write_version(first, weights_root, 3, 1 << 30)
    (path / weight_files.SHARD.format(2)).write_bytes(b"not a safetensors file")
    body = {"name": path.name, "version": 3, "timeout_s": 60}
    assert post(url + "/control/sync/load", body, TOKEN) == 500
    status, health = get_json(url + "/health")
    assert status == 200 and health["policy_version"] is None and health["synced"] is False
    report = sync_from_files([url], good, 4, weights_root)
    assert report.servers == [url] and report.servers_failed == []
    batch = generate([url], GREEDY)
    check_batch(batch, GREEDY, version=4)
    assert max_logprob_gap(good, batch) < LOGPROB_ATOL


def test_server_killed_mid_batch_every_prompt_gets_its_group(dense_pair: list[Any]) -> None:
    """Runs last in this module: it kills one of the shared servers.

    The victim is paused first, so the chunks it is handed wait inside it: the kill always
    lands while it owes part of the batch, however fast the survivor is (a tiny model can
    otherwise finish its share between any check and the kill, and a survivor busy
    generating may not answer a health probe until it has finished)."""
    survivor, victim = dense_pair
    prompts = [p for p in PROMPTS for _ in range(6)]  # 24 prompts
    params = SamplingParams(n=4, max_tokens=100, temperature=1.0, stop_token_ids=())

    async def run() -> RolloutBatch:
        async with RolloutClient([survivor.url, victim.url], TOKEN, chunk_prompts=2) as client:
            # Probed before the pause: generate() then probes no one, and does not resume the
            # victim as a server a failed weight sync left paused.
            await client.refresh()
            assert all(s.alive and s.policy_version is not None for s in client.servers.values())
            assert post(victim.url + "/control/pause", {"timeout_s": 30}, TOKEN) == 200
            task = asyncio.create_task(client.generate(prompts, params))
            for _ in range(500):  # until chunks are handed to the victim
                await asyncio.sleep(0.02)
                if client.servers[victim.url].outstanding > 0:
                    break
            assert client.servers[victim.url].outstanding > 0 and not task.done()
            victim.kill()
            return await task

    batch = asyncio.run(run())
    assert batch.servers_failed == [victim.url]
    assert len(batch.groups) == len(prompts)
    for i, group in enumerate(batch.groups):
        assert len(group) == 4 and all(c.prompt_index == i for c in group)


class KillMidBroadcast:
    """A TensorSource whose tensors kill `victim` once `after` of them have been read: the
    sender has broadcast the buckets before it (bucket_mb is small), so the kill lands inside
    the broadcast; only the first pass kills (a re-formed group reads the source again)."""

    def __init__(self, model: Any, after: int, victim: Any) -> None:
        self.items = list(model.named_parameters())
        self.after, self.victim, self.passes = after, victim, 0

    def metas(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, tuple(t.shape), t.dtype) for name, t in self.items]

    def __iter__(self) -> Any:
        self.passes += 1
        for i, item in enumerate(self.items):
            if self.passes == 1 and i == self.after:
                self.victim.kill()
            yield item


def test_server_killed_mid_sync_the_survivor_takes_the_version(
    dense_pair: list[Any], start_rollout: Any, dense_dir: Path
) -> None:
    """Runs after the mid-batch kill: a fresh server joins the first survivor. A clean sync
    forms their group; during the next broadcast the fresh one is SIGKILLed. The sync re-forms
    the group with the survivor alone and sends again: the survivor generates from the new
    weights under the new version, the victim is reported failed."""
    survivor = dense_pair[0]
    (victim,) = start_rollout(dense_dir, 1, "--initial-policy-version", "0")
    before, _ = build_tiny_model("builtin:tiny-qwen3", seed=3)
    after, _ = build_tiny_model("builtin:tiny-qwen3", seed=4)
    source = KillMidBroadcast(after, after=len(list(after.parameters())) // 2, victim=victim)

    async def run() -> tuple[Any, Any, RolloutBatch]:
        sync = SyncOptions(
            master_addr="127.0.0.1", master_port=free_port(), bucket_mb=0.01, timeout_s=20
        )
        async with RolloutClient([survivor.url, victim.url], TOKEN, sync=sync) as client:
            clean = await client.sync_weights(before.named_parameters(), version=11)
            broken = await client.sync_weights(source, version=12)
            return clean, broken, await client.generate(PROMPTS, GREEDY)

    clean, broken, batch = asyncio.run(run())
    assert sorted(clean.servers) == sorted([survivor.url, victim.url])
    assert victim.proc.poll() is not None and source.passes == 2
    assert broken.regrouped and broken.servers == [survivor.url]
    assert broken.servers_failed == [victim.url]
    check_batch(batch, GREEDY, version=12)
    assert batch.servers_failed == []
    assert max_logprob_gap(after, batch) < LOGPROB_ATOL
    assert max_logprob_gap(before, batch) > 0.05
