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


def run_ranks(n: int, out: Path, cache: Path, stage: int = 1, micro_tokens: int = 16384) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(WORKER), str(out), str(cache), str(stage),
           str(micro_tokens)]  # fmt: skip
    env = checkout_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] += f":{WORKER.parent}"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    ("stage", "micro_tokens"),
    [(1, 16384), (3, 8)],  # ZeRO-3 really partitions over 2 ranks; 8 tokens: one row a pass
    ids=["zero1", "zero3-micro"],
)
def test_two_ranks_split_every_mini_batch_and_match_one_rank(
    tmp_path: Path, stage: int, micro_tokens: int
) -> None:
    one = run_ranks(1, tmp_path / "one.pt", tmp_path / "models")
    two = run_ranks(2, tmp_path / "two.pt", tmp_path / "models", stage, micro_tokens)
    # Same rollouts (seeded), same rewards: each rank took half of every mini-batch.
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["zero_advantage_fraction"] < 0.5
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    # Adam turns float-order noise in near-zero gradients into ~1e-6 moves; a step is 1e-3.
    for name, p1 in one["params"].items():
        p2 = two["params"][name]
        torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-5, msg=name)
