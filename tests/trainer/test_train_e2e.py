"""`gspo train` with no config: real vLLM rollout server, real learner, reward that rises.

One run, stopped by SIGINT early on (the learner writes a final checkpoint and exits 0),
then started again in the same directory: it resumes and trains to the end. The reward is
judged on 50-step windows, not single steps.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkout import REPO, checkout_env, run_gspo

from gspo_trainer import checkpoint as ckpt
from gspo_trainer.plot import read_history

pytestmark = pytest.mark.e2e
# The reward rises from the first steps: over steps 71-120 it is 2.9-6.7x its mean over steps
# 1-50 on five seeds (0.091-0.204 against 0.028-0.042; `bench/bench_peer.py`'s histories,
# BENCHMARKS.md), the two windows compared here.
STEPS = 120


def wait_for_steps(history: Path, steps: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if len(read_history(history)) >= steps:
            return
        time.sleep(0.5)
    raise TimeoutError(f"fewer than {steps} steps after {timeout_s}s")


def test_gspo_train_default_stops_resumes_and_raises_reward(tmp_path: Path) -> None:
    out = tmp_path / "run"
    history = out / "checkpoints" / "history.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "gspo_operator.cli",
        "train",
        "--output-dir",
        str(out),
        "--max-steps",
        str(STEPS),
    ]
    first = subprocess.Popen(
        cmd, env=checkout_env(), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        wait_for_steps(history, 20, first, timeout_s=240)
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert "metrics at http://127.0.0.1:" in stdout
    stopped = ckpt.latest(out / "checkpoints")
    assert stopped is not None and 20 <= int(stopped.name.split("-")[1]) < STEPS

    token_file = out / "job-token"
    first_token = token_file.read_text()
    dead = out / "rollout-token"  # an earlier release's name for it, left in the directory
    dead.write_text("a dead token\n")
    second = run_gspo("train", "--output-dir", str(out), "--max-steps", str(STEPS), timeout_s=420)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not dead.exists()
    # Each run's servers take a token of its own, for their owner alone.
    assert token_file.read_text() != first_token and len(token_file.read_text().strip()) >= 32
    assert token_file.stat().st_mode & 0o777 == 0o600
    learner_log = (out / "logs" / "learner.log").read_text()
    assert f"Resumed from {stopped}" in learner_log
    # The progress bar shows step, reward and clip fraction; the summary closes the run.
    assert f"{STEPS}/{STEPS}" in second.stderr and "reward" in second.stderr
    assert "clip" in second.stderr
    assert "reward curve" in second.stdout and "HF export" in second.stdout

    records = read_history(history)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in records]
    first_50, last_50 = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    print(f"reward: first 50 steps {first_50:.3f}, last 50 {last_50:.3f}")
    assert last_50 >= first_50 + 0.03 and last_50 >= 2 * first_50, (first_50, last_50)
    assert records[-1]["entropy"] < records[0]["entropy"]
    final = ckpt.latest(out / "checkpoints")
    assert final.name == f"step-{STEPS:06d}" and ckpt.verify(final) == []
    png = (out / "reward.png").read_bytes()
    assert png.startswith(b"\x89PNG")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "export")
    assert model.config.model_type == "qwen3_moe"
