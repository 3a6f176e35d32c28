"""A rollout server whose engine is a deterministic stand-in for vLLM (tests only).

Run as a script it serves on the given port, so a test can SIGKILL a whole server process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from gspo_trainer.rollout.engine import Sample
from gspo_trainer.rollout.types import SamplingParams

TOKEN = "s3cret"
REPO = Path(__file__).resolve().parents[3]


class StandInEngine:
    """Completion k of prompt p is [sum(p) % 15, k, ...]; remembers which prompts it saw."""

    workers = 1
    max_model_len = 64
    vocab_size = 15

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[list[int]] = []
        self.weights_loaded = 0

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Sample]:
        self.seen.append(prompt)
        await asyncio.sleep(self.delay_s)
        head = sum(prompt) % 15
        return [
            Sample([head, k, *[1] * (params.max_tokens - 2)], [-0.5] * params.max_tokens, "length")
            for k in range(params.n)
        ]

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 15 for c in text]

    async def init_sync_group(self, **coords: Any) -> None:
        raise AssertionError("not used here")

    async def receive_weights(self, timeout_s: float) -> dict[str, int]:
        self.weights_loaded += 1
        return {"version": 99, "bytes": 0, "tensors": 0}

    async def load_weights_file(self, path: str, timeout_s: float) -> dict[str, int]:
        raise AssertionError("not used here")

    async def shutdown(self) -> None:
        pass


class _ModelRunner:
    """Where vLLM's model runner would load weights: a dict, loaded slowly on purpose."""

    def __init__(self, seconds_per_tensor: float) -> None:
        self.seconds_per_tensor = seconds_per_tensor
        self.weights: dict[str, Any] = {}

    def get_model(self) -> Any:
        import torch

        return torch.nn.Module()  # no layers: nothing for the extension to prepare

    def reload_weights(self, weights_iterator: Any) -> None:
        for name, tensor in weights_iterator:
            time.sleep(self.seconds_per_tensor)
            self.weights[name] = tensor.clone()


class GlooEngine(StandInEngine):
    """Joins the learner's sync group and receives weights through the project's own worker
    extension over real gloo; only vLLM's model runner is replaced. Its samples start with
    a digest of the weights it holds, so two servers can be compared."""

    def __init__(self, seconds_per_tensor: float = 0.0) -> None:
        super().__init__()
        import torch.distributed  # noqa: F401 - loaded at start-up, as in a vLLM server

        from gspo_trainer.rollout.worker_ext import WeightSyncExtension

        class Worker(WeightSyncExtension):
            rank = 0
            model_runner = _ModelRunner(seconds_per_tensor)

        self.worker = Worker()

    def digest(self) -> int:
        weights = self.worker.model_runner.weights
        return int(sum(float(t.double().sum()) for t in weights.values())) % 15

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Sample]:
        samples = await super().generate(prompt, params)
        return [Sample([self.digest(), *s.token_ids[1:]], s.logprobs, s.finish_reason)
                for s in samples]  # fmt: skip

    async def init_sync_group(self, **coords: Any) -> None:
        await asyncio.to_thread(self.worker.gspo_init_sync_group, **coords)

    async def receive_weights(self, timeout_s: float) -> dict[str, int]:
        return await asyncio.to_thread(self.worker.gspo_receive_weights)

    async def load_weights_file(self, path: str, timeout_s: float) -> dict[str, int]:
        return await asyncio.to_thread(self.worker.gspo_load_weights_file, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def spawn_standin(
    delay_s: float, engine: str = "plain", initial_version: int | None = 0, port: int = 0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start this file as a server process; return it and its URL once /health answers.

    engine "plain": StandInEngine(delay_s); "gloo": GlooEngine(delay_s per loaded tensor).
    A given port restarts a server where one was, as a container restarted in its pod would.
    """
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'trainer'}:{REPO / 'operator'}"}
    version = "none" if initial_version is None else str(initial_version)
    args = [sys.executable, __file__, str(port), str(delay_s), engine, version]
    proc = subprocess.Popen(args, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"stand-in server on {url} did not answer /health within 30 s")


if __name__ == "__main__":
    from aiohttp import web

    from gspo_trainer.rollout.server import build_app

    port, delay, kind, version = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    engine = GlooEngine(delay) if kind == "gloo" else StandInEngine(delay)
    initial = None if version == "none" else int(version)
    web.run_app(
        build_app(engine, token=TOKEN, initial_version=initial),
        host="127.0.0.1", port=port, print=None,
    )  # fmt: skip
