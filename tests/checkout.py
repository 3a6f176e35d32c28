"""Running `gspo` as a user would, from this checkout (importable from any test directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


DIST_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def checkout_env(**extra: str) -> dict[str, str]:
    """Environment whose Python imports this checkout's packages first, without the
    rendezvous of a process group this test process may hold (engine.init_distributed sets
    MASTER_PORT to a port its own store keeps bound: a child would fail to listen on it)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_RENDEZVOUS}
    paths = [str(REPO / "operator"), str(REPO / "trainer")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_gspo(
    *args: str, timeout_s: float = 120, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run `gspo ARGS...` in a subprocess, as the console script would (`env`: more variables)."""
    return subprocess.run(
        [sys.executable, "-m", "gspo_operator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**checkout_env(), **(env or {})},
        cwd=kwargs.pop("cwd", REPO),
        **kwargs,
    )
