"""Rollout client overhead: RolloutClient -> vLLM's server (its own app and routes, with the
gspo plugin) -> engine, vs the engine directly.

One vLLM engine (tiny dense model, CPU build) serves every path in the same process, with the
same prompts and the same concurrency (every prompt in flight at once). The server is vLLM's
own app (`build_app` and `init_app_state`, as `vllm serve` builds it, from the command line
`serve_command` builds for the pods, so the plugin is loaded through its entry point). The
runs alternate and the medians are compared per generated token. Four paths:

- engine directly: `AsyncLLM.generate`, as vLLM's route calls it;
- via the client: RolloutClient -> HTTP -> vLLM's /inference/v1/generate -> the engine (end
  to end; on a shared 2-core machine the engine's own noise is larger than the effect);
- server path alone: the same, with the engine replaced by a replay that answers at once with
  the outputs the real engine gave (vLLM's route, its per-token log-prob objects and JSON,
  the plugin's middlewares, HTTP, the client): what the whole HTTP path costs when nothing
  overlaps. On a pod the route runs in vLLM's API-server process, beside the engine core's
  process, so it overlaps the engine there;
- client alone: RolloutClient against a responder that writes back the bytes vLLM's route
  answered (recorded on the first pass): what the learner's process pays per batch (its
  HTTP, the JSON decoding, the checks), the 5% budget.

Then, unless `--no-sync`, the same run compares weight-sync (and generation) time with the
aiohttp server this one replaced (`bench_rollout_servers.py`, the replaced server taken from
git history), each server in a process of its own.

    python bench/bench_rollout_client.py [--prompts 64] [--n 8] [--max-tokens 32] [--no-sync]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "operator"),
    str(REPO / "trainer"),
    str(REPO / "tests" / "trainer" / "rollout"),
]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPEATS = 5
TOKEN = "t"


class ReplayEngine:
    """The real engine client, whose generation answers at once with the final output the
    real engine gave for that prompt while `replaying` is set. (One app serves both the real
    and the replayed paths: the plugin registers its series in the process's one registry.)"""

    def __init__(self, engine: Any, answers: dict[tuple[int, ...], Any]) -> None:
        self._engine, self._answers = engine, answers
        self.replaying = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[Any]:
        key = tuple(prompt["prompt_token_ids"])
        if self.replaying and key in self._answers:
            yield self._answers[key]
            return
        async for out in self._engine.generate(prompt, params, request_id, **kwargs):
            yield out  # the plugin's warm-up


class CannedResponder(asyncio.Protocol):
    """HTTP/1.1 with keep-alive that writes back, for each request (method, path, body), the
    bytes the upstream server answered it with: forwarded and recorded the first time."""

    def __init__(self, upstream: str, store: dict[bytes, bytes]) -> None:
        self.upstream, self.store = upstream, store
        self.buffer = b""
        self.transport: Any = None
        self.pending: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            fields = dict(line.split(": ", 1) for line in head[1:])
            length = int({k.lower(): v for k, v in fields.items()}.get("content-length", 0))
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = head[0].split(" ")[:2]
            key = f"{method} {path}\n".encode() + body
            if key in self.store:
                self.transport.write(self.store[key])
            else:
                self.pending.add(
                    asyncio.ensure_future(self._record(key, method, path, body, fields))
                )

    async def _record(
        self, key: bytes, method: str, path: str, body: bytes, fields: dict[str, str]
    ) -> None:
        import aiohttp

        from gspo_api import ports

        headers = {
            k: v for k, v in fields.items() if k.lower() in ("authorization", "content-type")
        }
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, self.upstream + path, data=body, headers=headers) as resp,
        ):
            payload = await resp.read()
            version = resp.headers.get(ports.VERSION_HEADER)
        extra = f"{ports.VERSION_HEADER}: {version}\r\n" if version is not None else ""
        self.store[key] = (
            f"HTTP/1.1 {resp.status} OK\r\ncontent-type: application/json\r\n"
            f"{extra}content-length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        self.transport.write(self.store[key])


async def bench(args: argparse.Namespace) -> None:
    from rollout_standin import InProcessServer, free_port
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app as build_vllm_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from gspo_trainer.rollout.client import RolloutClient
    from gspo_trainer.rollout.serve_command import ServeOptions, serve_argv, serve_env
    from gspo_trainer.rollout.types import SamplingParams
    from gspo_trainer.tiny import materialize

    model = materialize("builtin:tiny-qwen3", tempfile.mkdtemp())
    opts = ServeOptions(
        model=str(model),
        served_name="builtin:tiny-qwen3",
        host="127.0.0.1",
        port=free_port(),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=256,
        enforce_eager=True,
        initial_version=0,
        engine_args={"disable_log_stats": True},
    )
    os.environ.update(serve_env(opts, TOKEN))  # VLLM_PLUGINS=gspo, the token, the version
    server_args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(opts)[3:])
    validate_parsed_serve_args(server_args)
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14, 5] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=7)
    # What vLLM's generate route asks of the engine for the client's request (not streamed).
    engine_params = VLLMSamplingParams(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = iter(range(10**9))

    async with build_async_engine_client(server_args) as engine:

        async def generate(prompt: list[int]) -> Any:
            request = engine.generate(
                {"prompt_token_ids": prompt}, engine_params, f"bench-{next(ids)}"
            )
            outputs = [out async for out in request]  # FINAL_ONLY: one output
            return outputs[-1]

        answers = {tuple(p): await generate(p) for p in prompts}
        tasks = await engine.get_supported_tasks()
        replay = ReplayEngine(engine, answers)
        app = build_vllm_app(server_args, tasks, engine.model_config)
        await init_app_state(replay, app.state, server_args, tasks)
        server = InProcessServer(app)
        url = await server.start()
        store: dict[bytes, bytes] = {}
        loop = asyncio.get_running_loop()
        canned = await loop.create_server(lambda: CannedResponder(url, store), "127.0.0.1", 0)
        canned_url = f"http://127.0.0.1:{canned.sockets[0].getsockname()[1]}"

        async def direct() -> int:
            outputs = await asyncio.gather(*(generate(p) for p in prompts))
            return sum(len(c.token_ids) for o in outputs for c in o.outputs)

        def through(client: RolloutClient, replaying: bool) -> Callable[[], Awaitable[int]]:
            async def run() -> int:
                replay.replaying = replaying
                batch = await client.generate(prompts, params)
                return sum(len(c.token_ids) for g in batch.groups for c in g)

            return run

        async with (
            RolloutClient([url], TOKEN, chunk_prompts=args.chunk) as client,
            RolloutClient([canned_url], TOKEN, chunk_prompts=args.chunk) as alone,
        ):
            paths = (
                ("direct", direct),
                ("client", through(client, replaying=False)),
                ("server", through(client, replaying=True)),
                ("alone", through(alone, replaying=True)),
            )
            for _, fn in paths:
                await fn()  # warm every path (and record the canned replies)
            assert {s.model for s in client.servers.values()} == {opts.served_name}
            times: dict[str, list[float]] = {name: [] for name, _ in paths}
            tokens: dict[str, list[int]] = {name: [] for name, _ in paths}
            for _ in range(REPEATS):
                for name, fn in paths:
                    start = time.perf_counter()
                    tokens[name].append(await fn())
                    times[name].append(time.perf_counter() - start)
        canned.close()
        await server.stop()
    report(args, times, tokens)


def report(
    args: argparse.Namespace, times: dict[str, list[float]], tokens: dict[str, list[int]]
) -> None:
    # Sampled lengths differ run to run: compare time per generated token.
    per_tok = {
        k: statistics.median(t / n for t, n in zip(times[k], tokens[k], strict=True)) for k in times
    }
    print(
        f"{args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, "
        f"chunk {args.chunk} prompts; median of {REPEATS}"
    )
    labels = {
        "direct": "engine directly",
        "client": "via the client (vLLM server + plugin)",
        "server": "server path alone (replay engine)",
        "alone": "client alone (recorded replies)",
    }
    for k, label in labels.items():
        print(
            f"  {label:<38} {statistics.median(times[k]) * 1e3:8.1f} ms/batch  "
            f"{per_tok[k] * 1e6:7.1f} us/token"
        )
    share = {k: per_tok[k] / per_tok["direct"] for k in ("server", "alone")}
    end_to_end = per_tok["client"] / per_tok["direct"] - 1
    print(f"end to end, per generated token: {end_to_end * 100:+.1f}% (noisy on a shared CPU)")
    print(
        f"server path alone / engine time: {share['server'] * 100:.1f}% (vLLM's route, the "
        "plugin, HTTP and the client; on a pod the route overlaps the engine)"
    )
    print(f"client alone / engine time: {share['alone'] * 100:.1f}% (target <= 5%)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--no-sync", action="store_true", help="skip the sync comparison")
    p.add_argument("--sync-rounds", type=int, default=5)
    args = p.parse_args()
    asyncio.run(bench(args))
    if not args.no_sync:  # its own process: its servers start engines of their own
        print("\nWeight sync and generation vs the replaced server:", flush=True)
        servers = Path(__file__).with_name("bench_rollout_servers.py")
        cmd = [sys.executable, str(servers), "--rounds", str(args.sync_rounds)]
        sys.exit(subprocess.run(cmd, check=False).returncode)


if __name__ == "__main__":
    main()
