"""Rollout client overhead: RolloutClient -> HTTP server -> engine vs the engine directly.

One vLLM engine (tiny dense model, CPU build) serves both paths in the same process, with
the same prompts and the same concurrency (every prompt in flight at once); the runs
alternate and the medians are compared:

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPEATS = 5


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
    runner = web.AppRunner(build_app(engine, token="t", initial_version=0))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14, 5] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0)

    async def direct() -> int:
        groups = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return sum(len(s.token_ids) for g in groups for s in g)

    async with RolloutClient([url], "t", chunk_prompts=args.chunk) as client:

        async def via_client() -> int:
            batch = await client.generate(prompts, params)
            return sum(len(c.token_ids) for g in batch.groups for c in g)

        await direct()
        await via_client()  # warm both paths
        times: dict[str, list[float]] = {"direct": [], "client": []}
        tokens: dict[str, list[int]] = {"direct": [], "client": []}
        for _ in range(REPEATS):
            for name, fn in (("direct", direct), ("client", via_client)):
                start = time.perf_counter()
                tokens[name].append(await fn())
                times[name].append(time.perf_counter() - start)
    await runner.cleanup()
    await engine.shutdown()
    # Sampled lengths differ run to run: compare time per generated token.
    per_tok = {k: statistics.median(t / n for t, n in zip(times[k], tokens[k], strict=True))
               for k in times}  # fmt: skip
    print(f"{args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, "
          f"chunk {args.chunk} prompts; median of {REPEATS}")  # fmt: skip
    for k in ("direct", "client"):
        print(f"  {k:<7} {statistics.median(times[k]) * 1e3:8.1f} ms/batch  "
              f"{per_tok[k] * 1e6:7.1f} us/token")  # fmt: skip
    overhead = per_tok["client"] / per_tok["direct"] - 1
    print(f"client overhead per generated token: {overhead * 100:+.1f}% (target <= 5%)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=8)
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()
