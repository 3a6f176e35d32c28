"""Two learner ranks on CPU (torchrun, gloo): the update one rank takes alone, and
checkpoints every rank agrees on, even when only one of them can write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from transformers import AutoModelForCausalLM

from gspo_trainer.checkpoint import list_steps, newest_intact, step_name

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("two_rank_worker.py")


def launch(n: int, out: Path, cache: Path, *args: object,
           staleness: int = 0) -> subprocess.CompletedProcess:  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(WORKER), str(out), str(cache), *map(str, args)]  # fmt: skip
    env = checkout_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", MAX_STALENESS=str(staleness))
    env["PYTHONPATH"] += f":{WORKER.parent}"
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def run_ranks(n: int, out: Path, cache: Path, stage: int = 1, micro_tokens: int = 16384,
              staleness: int = 0) -> dict:  # fmt: skip
    proc = launch(n, out, cache, stage, micro_tokens, staleness=staleness)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One rank's run (ZeRO-1, whole mini-batches), the reference every split below must
    match: run once for the module, the tests only read it."""
    tmp = tmp_path_factory.mktemp("one-rank")
    return run_ranks(1, tmp / "one.pt", tmp / "models")


@pytest.mark.parametrize(
    ("stage", "micro_tokens"),
    [(1, 16384), (3, 8)],  # ZeRO-3 really partitions over 2 ranks; 8 tokens: one row a pass
    ids=["zero1", "zero3-micro"],
)
def test_two_ranks_split_every_mini_batch_and_match_one_rank(
    one_rank: dict, tmp_path: Path, stage: int, micro_tokens: int
) -> None:
    one = one_rank
    two = run_ranks(2, tmp_path / "two.pt", tmp_path / "models", stage, micro_tokens)
    # Same rollouts (seeded), same rewards: each rank took half of every mini-batch.
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["zero_advantage_fraction"] < 0.5
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    # Adam turns float-order noise in near-zero gradients into ~1e-6 moves; a step is 1e-3.
    for name, p1 in one["params"].items():
        p2 = two["params"][name]
        torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-5, msg=name)


def test_two_ranks_running_collection_ahead_match_one_rank(tmp_path: Path) -> None:
    """maxStaleness 1 over two ranks: rank 0 collects step 2 while both update step 1 in
    their worker threads; the run equals one rank's, lag and importance weights included."""
    one = run_ranks(1, tmp_path / "one.pt", tmp_path / "models", staleness=1)
    two = run_ranks(2, tmp_path / "two.pt", tmp_path / "models", 3, 8, staleness=1)
    assert [r["staleness"] for r in two["history"]] == [0, 1]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"]
        for key in ("loss", "importance_weight_mean", "importance_weight_max"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for name, p1 in one["params"].items():
        torch.testing.assert_close(two["params"][name], p1, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("stage", [1, 3])
def test_one_rank_failing_its_checkpoint_write_stops_both_and_keeps_the_last_good_one(
    tmp_path: Path, stage: int
) -> None:
    """Rank 1's disk fills once step 1's checkpoint is written, part-way into DeepSpeed's own
    writes of the next (whose collectives must still line up across ranks): both ranks agree
    that steps 2 and 3 failed, both stop, and step 1's checkpoint stays the verified one to
    resume from."""
    ckpt, models = tmp_path / "ckpt", tmp_path / "models"
    failed = launch(2, tmp_path / "b.pt", models, stage, 16384, ckpt, 3, 4096, 1)
    logs = failed.stdout + failed.stderr
    assert "[rank0] Checkpoint at step 1 FAILED" not in logs, logs[-5000:]
    assert failed.returncode != 0, logs[-3000:]
    for step in (2, 3):
        assert f"[rank1] Checkpoint at step {step}: this rank could not write" in logs, logs[-5000:]
        assert f"[rank0] Checkpoint at step {step}: this rank" not in logs, logs[-5000:]
        for rank in (0, 1):  # every rank agreed it failed
            assert f"[rank{rank}] Checkpoint at step {step} FAILED" in logs, logs[-5000:]
    assert "training stops here rather than carry on without checkpoints" in logs
    assert [step for step, _ in list_steps(ckpt)] == [1]
    assert newest_intact(ckpt) == ckpt / step_name(1)
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")], logs[-3000:]

    resumed = launch(2, tmp_path / "c.pt", models, stage, 16384, ckpt, 3, 0)  # space freed
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs[-3000:]
    assert f"Resumed from {ckpt / step_name(1)} at step 1" in logs, logs[-3000:]
    assert [step for step, _ in list_steps(ckpt)] == [1, 2, 3]
    # The exported policy is the one the ranks hold (ZeRO-3: gathered from both ranks' shards).
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "export", dtype=torch.float32)
    final = torch.load(tmp_path / "c.pt", weights_only=False)["params"]
    for name, param in exported.named_parameters():
        torch.testing.assert_close(param, final[name], rtol=0, atol=0, msg=name)
