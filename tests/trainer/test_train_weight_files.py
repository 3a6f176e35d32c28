"""`gspo train` with `weightSync.method: filesystem`: the learner writes each policy version
to the checkpoint volume and the real vLLM server loads it from there; no sync group."""

from __future__ import annotations

import re

import pytest
import yaml
from checkout import run_gspo

from gspo_trainer import ports
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.plot import read_history

pytestmark = pytest.mark.e2e
STEPS = 3


def test_train_syncs_every_step_through_the_shared_volume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    manifest = tiny_manifest()
    manifest["spec"]["weightSync"] = {"method": "filesystem", "bucketSizeMb": 1}
    manifest["spec"]["checkpoint"].update(exportHf=False)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "run"
    done = run_gspo("train", str(config), "--output-dir", str(out), "--max-steps", str(STEPS),
                    "--no-progress", timeout_s=400)  # fmt: skip
    learner_log = (out / "logs" / "learner.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + learner_log[-3000:]
    assert [r["step"] for r in read_history(out / "checkpoints" / "history.jsonl")] == [1, 2, 3]
    # The server loaded the start-up weights and each step's from files, in order.
    server_log = (out / "logs" / "rollout-0.log").read_text()
    loaded = [int(v) for v in re.findall(r"Loaded policy version (\d+)", server_log)]
    assert loaded == list(range(STEPS + 1)), server_log[-3000:]
    weights = out / "checkpoints" / ports.WEIGHTS_SUBDIR
    assert [p.name for p in weights.iterdir()] == [f"v{STEPS:08d}"]  # only the newest kept
    assert "sync group" not in learner_log.lower()
