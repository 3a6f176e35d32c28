"""`gspo train` with two learner ranks: `gspo learner` starts its group through
torch.distributed.run, and SIGINT stops both ranks after one final checkpoint they agree on."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from checkout import REPO, checkout_env
from test_train_e2e import wait_for_steps

from gspo_trainer import checkpoint as ckpt
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.plot import read_history

pytestmark = pytest.mark.e2e


def test_two_rank_learner_group_stops_on_sigint_after_a_final_checkpoint(tmp_path: Path) -> None:
    manifest = tiny_manifest()
    manifest["spec"]["learner"]["replicas"] = 2
    manifest["spec"]["checkpoint"].update(everySteps=1000, exportHf=False)  # the final one only
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "run"
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    cmd = [sys.executable, "-m", "gspo_operator.cli", "train", str(config), "--output-dir",
           str(out), "--max-steps", "500", "--no-progress"]  # fmt: skip
    # Run from inside another torch.distributed group (as a pytest process that initialised
    # one is): `gspo train` must still start a group of its own.
    env = {**checkout_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        wait_for_steps(out / "checkpoints" / "history.jsonl", 3, proc, timeout_s=300)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (out / "logs" / "learner.log").read_text()
    assert proc.returncode == 0, stderr[-2000:] + log[-3000:]
    stopped = ckpt.latest(out / "checkpoints")
    assert stopped is not None, log[-3000:]
    assert ckpt.verify(stopped) == []
    # No finished step lost: the final checkpoint is at the last step the history recorded.
    steps = [r["step"] for r in read_history(out / "checkpoints" / "history.jsonl")]
    assert int(stopped.name.split("-")[1]) == steps[-1] >= 3
    assert {p.name for p in stopped.glob("trainer-rank*.pt")} == {
        "trainer-rank0.pt",
        "trainer-rank1.pt",
    }
    assert "FAILED" not in log and "Traceback" not in log, log[-3000:]
