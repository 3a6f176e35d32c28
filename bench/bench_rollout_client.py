"""Rollout client overhead: RolloutClient -> HTTP server -> engine vs the engine directly.

One vLLM engine (tiny dense model, CPU build) serves both paths in the same process, with
the same prompts and the same concurrency (every prompt in flight at once); the runs
alternate and the medians are compared. On a shared 2-core machine the engine's own
run-to-run noise is larger than the effect, so the client path's cost is also measured
alone: the same client, HTTP server and JSON, in front of a replay engine that answers at
once with samples the real engine produced. Its time over the direct engine's time is the
share of generation time the client path costs when nothing overlaps (an upper bound):

    python bench/bench_rollout_client.py [--prompts 64] [--n 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPEATS = 5


class ReplayEngine:
    """Answers at once with samples the real engine gave for the same prompt."""

    def __init__(self, real: Any, answers: dict[tuple[int, ...], list[Any]]) -> None:
        self.real = real
        self.answers = answers
        self.workers, self.max_model_len = real.workers, real.max_model_len
        self.vocab_size = real.vocab_size

    async def generate(self, prompt: list[int], params: Any) -> list[Any]:
        return self.answers[tuple(prompt)]

    def tokenize(self, text: str) -> list[int]:
        return self.real.tokenize(text)


async def bench(args: argparse.Namespace) -> None:
    from aiohttp import web

    from gspo_trainer.rollout.client import RolloutClient
    from gspo_trainer.rollout.engine import EngineOptions, VLLMEngine
    from gspo_trainer.rollout.server import build_app
    from gspo_trainer.rollout.types import SamplingParams
    from gspo_trainer.tiny import materialize

    model = materialize("builtin:tiny-qwen3", tempfile.mkdtemp())
    engine = await VLLMEngine.start(
        EngineOptions(model=str(model), dtype="float32", max_model_len=128, max_num_seqs=256)
    )
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14, 5] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
    answers = {tuple(p): await engine.generate(p, params) for p in prompts}
    runners = []

    async def serve(app_engine: Any) -> str:
        runner = web.AppRunner(build_app(app_engine, token="t", initial_version=0))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    url = await serve(engine)
    replay_url = await serve(ReplayEngine(engine, answers))

    async def direct() -> int:
        groups = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return sum(len(s.token_ids) for g in groups for s in g)

    async with (
        RolloutClient([url], "t", chunk_prompts=args.chunk) as client,
        RolloutClient([replay_url], "t", chunk_prompts=args.chunk) as replay,
    ):

        async def via_client() -> int:
            batch = await client.generate(prompts, params)
            return sum(len(c.token_ids) for g in batch.groups for c in g)

        async def client_alone() -> int:
            batch = await replay.generate(prompts, params)
            return sum(len(c.token_ids) for g in batch.groups for c in g)

        paths = (("direct", direct), ("client", via_client), ("alone", client_alone))
        for _, fn in paths:
            await fn()  # warm every path
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        tokens: dict[str, list[int]] = {name: [] for name, _ in paths}
        for _ in range(REPEATS):
            for name, fn in paths:
                start = time.perf_counter()
                tokens[name].append(await fn())
                times[name].append(time.perf_counter() - start)
    for runner in runners:
        await runner.cleanup()
    await engine.shutdown()
    # Sampled lengths differ run to run: compare time per generated token.
    per_tok = {k: statistics.median(t / n for t, n in zip(times[k], tokens[k], strict=True))
               for k in times}  # fmt: skip
    print(f"{args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, "
          f"chunk {args.chunk} prompts; median of {REPEATS}")  # fmt: skip
    labels = {"direct": "engine directly", "client": "via the client",
              "alone": "client path alone (replay engine)"}  # fmt: skip
    for k, label in labels.items():
        print(f"  {label:<34} {statistics.median(times[k]) * 1e3:8.1f} ms/batch  "
              f"{per_tok[k] * 1e6:7.1f} us/token")  # fmt: skip
    end_to_end = per_tok["client"] / per_tok["direct"] - 1
    alone = per_tok["alone"] / per_tok["direct"]
    print(f"end to end, per generated token: {end_to_end * 100:+.1f}% (noisy on a shared CPU)")
    print(f"client path alone / engine time: {alone * 100:.1f}% (target <= 5%)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=8)
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()
