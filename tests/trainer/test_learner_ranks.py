"""Two learner ranks on CPU (torchrun, gloo) take the update one rank takes alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkout import checkout_env

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("two_rank_worker.py")


def run_ranks(n: int, out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(WORKER), str(out), str(cache)]  # fmt: skip
    env = checkout_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] += f":{WORKER.parent}"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_two_ranks_split_every_mini_batch_and_match_one_rank(tmp_path: Path) -> None:
    one = run_ranks(1, tmp_path / "one.pt", tmp_path / "models")
    two = run_ranks(2, tmp_path / "two.pt", tmp_path / "models")
    # Same rollouts (seeded), same rewards: each rank took half of every mini-batch.
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for name, p1 in one["params"].items():
        p2 = two["params"][name]
        torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-6, msg=name)
