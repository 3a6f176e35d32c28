"""Fixtures that start real `gspo rollout-server` processes (vLLM's CPU build)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rollout_standin import REPO, TOKEN, free_port
from server_env import SERVER_ENV


@dataclass
class RolloutProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def kill(self) -> None:
        """SIGKILL the server and the engine processes it spawned (its own session)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def launch_rollout(model: Path, log_dir: Path, *extra: str) -> RolloutProcess:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **SERVER_ENV,
        "GSPO_JOB_TOKEN": TOKEN,
    }
    log_path = log_dir / f"rollout-{port}.log"
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    cmd = [sys.executable, "-m", "gspo_operator.cli", "rollout-server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "128", "--max-num-seqs", "32", *extra]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return RolloutProcess(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(servers: list[RolloutProcess], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending and time.monotonic() < deadline:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited:\n{server.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(server)
            except OSError:
                pass
        time.sleep(0.5)
    if pending:
        raise TimeoutError(f"rollout servers not healthy after {timeout_s} s: {pending}")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def start_rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Start servers together (their loads overlap); all are stopped after the module."""
    started: list[RolloutProcess] = []
    log_dir = tmp_path_factory.mktemp("rollout-logs")

    def start(model: Path, count: int = 1, *extra: str) -> list[RolloutProcess]:
        servers = [launch_rollout(model, log_dir, *extra) for _ in range(count)]
        started.extend(servers)
        wait_healthy(servers)
        return servers

    yield start
    for server in started:
        server.stop()
