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

    async def shutdown(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def spawn_standin(delay_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start this file as a server process; return it and its URL once /health answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'trainer'}:{REPO / 'operator'}"}
    proc = subprocess.Popen([sys.executable, __file__, str(port), str(delay_s)], env=env)
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

    port, delay = int(sys.argv[1]), float(sys.argv[2])
    web.run_app(
        build_app(StandInEngine(delay), token=TOKEN, initial_version=0),
        host="127.0.0.1", port=port, print=None,
    )  # fmt: skip
