"""Reproducible sampling: per-sample seeds from (seed, step, prompt index, sample index).

The trap this guards against: one seed per request made every prompt of a batch draw from
the same random stream (vLLM seeds each request with SamplingParams.seed), so a batch lost
its diversity. Each sample now has a seed of its own, whichever way a batch is split.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from learner_helpers import make_learner, run, tiny_spec

from gspo_trainer.rollout.types import SamplingParams, sample_seed, step_seed

VOLATILE = {"seconds", "time", "tokens_per_second"}  # wall-clock, not the run's numbers
VOLATILE_SUFFIX = "_seconds"


def test_step_seeds_differ_across_seeds_steps_and_streams() -> None:
    seeds = {
        step_seed(s, t, stream)
        for s in range(5)
        for t in range(1, 200)
        for stream in ("train", "eval")
    }
    assert len(seeds) == 5 * 199 * 2
    assert step_seed(3, 7) == step_seed(3, 7)  # a pure function of its inputs
    # Not seed + step: run 1's step 1 must not replay run 0's step 2.
    assert step_seed(1, 1) != step_seed(0, 2)


def test_every_sample_of_a_batch_has_its_own_seed() -> None:
    base, prompts, n = step_seed(0, 1), 16, 8
    seeds = [sample_seed(base, i, j, n) for i in range(prompts) for j in range(n)]
    assert len(set(seeds)) == prompts * n
    params = SamplingParams(n=n, max_tokens=4, seed=base)
    # A request for prompt i alone (vLLM adds the sample index to a request's seed) and a
    # chunk starting at prompt 4 keep the seeds the samples have in the whole batch.
    assert params.for_prompt(5).seed == sample_seed(base, 5, 0, n)
    assert params.for_prompt(4).for_prompt(1).seed == params.for_prompt(5).seed
    assert SamplingParams(n=n, max_tokens=4).for_prompt(3).seed is None


def recording_server(seeds: list[int | None]) -> Any:
    """A server answering as vLLM's token-in/token-out route (/inference/v1/generate) does
    for what the client asks (n completions of one token-id prompt), recording each
    request's seed."""
    from aiohttp import web

    from gspo_api import ports

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": 0, "model": "m", "workers": 1})

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        sampling = body["sampling_params"]
        seeds.append(sampling["seed"])
        choice = {
            "token_ids": [1, 2],
            "finish_reason": "stop",
            "logprobs": {
                "content": [{"token_id": 1, "logprob": -0.1}, {"token_id": 2, "logprob": -0.2}]
            },
        }
        choices = [{**choice, "index": k} for k in range(sampling["n"])]
        return web.json_response({"choices": choices}, headers={ports.VERSION_HEADER: "0"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/inference/v1/generate", generate)
    return app


def test_a_batch_split_over_requests_keeps_every_sample_seed() -> None:
    """The client sends chunks of 2 prompts, each prompt its own request; the seeds are
    those the samples have in the whole batch (vLLM seeds a request's n samples seed + j)."""
    from aiohttp.test_utils import TestServer

    from gspo_trainer.rollout.client import RolloutClient

    seeds: list[int | None] = []

    async def go() -> None:
        server = TestServer(recording_server(seeds))
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            async with RolloutClient([url], chunk_prompts=2) as client:
                params = SamplingParams(n=3, max_tokens=2, seed=500)
                batch = await client.generate([[3, 4, 5]] * 5, params)
                assert [len(g) for g in batch.groups] == [3] * 5
        finally:
            await server.close()

    asyncio.run(go())
    assert sorted(s for s in seeds if s is not None) == [500, 503, 506, 509, 512]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def history(cache: Path, tmp: Path, seed: int) -> list[dict[str, float]]:
    learner = make_learner(cache, tmp, tiny_spec(maxSteps=4, seed=seed))
    assert run(learner) == 0
    return [
        {k: v for k, v in r.items() if k not in VOLATILE and not k.endswith(VOLATILE_SUFFIX)}
        for r in learner.state.history
    ]


def test_same_seed_same_history_other_seed_another(cache: Path, tmp_path: Path) -> None:
    first = history(cache, tmp_path / "a", seed=0)
    again = history(cache, tmp_path / "b", seed=0)
    other = history(cache, tmp_path / "c", seed=1)
    assert len(first) == 4
    assert first == again
    assert [r["reward_mean"] for r in first] != [r["reward_mean"] for r in other] or [
        r["entropy"] for r in first
    ] != [r["entropy"] for r in other]
