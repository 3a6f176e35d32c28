"""`gspo train` whose rollout server never starts: a real `gspo rollout-server` (vLLM's CPU
build) given an engine argument its engine core refuses at start-up (`block_size` 3: vLLM's
argument parser accepts it, the engine core's initialisation fails). The run must end
quickly, with exit status 1, naming the server that exited and showing vLLM's own reason from
its log, without a traceback of ours; the learner, started beside the server as a job's pods
start, is stopped before it trains."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from checkout import run_gspo

from gspo_trainer.jobs import tiny_manifest

pytestmark = pytest.mark.e2e


def test_a_rollout_server_that_never_starts_ends_the_run_with_vllms_reason(
    tmp_path: Path,
) -> None:
    manifest = tiny_manifest()
    manifest["spec"]["rollout"]["engineArgs"] = {"block_size": 3}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "run"
    start = time.monotonic()
    done = run_gspo("train", str(job), "--output-dir", str(out), "--no-progress", timeout_s=300)
    took_s = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert "gspo train: rollout-0 exited while starting" in done.stderr
    assert "Engine core initialization failed" in done.stderr  # vLLM's words, from its log
    assert "Traceback" not in done.stderr.split("exited while starting")[0]  # none of ours
    assert "Learner started" not in done.stdout
    assert (out / "logs" / "learner.log").is_file()  # it started beside the server
    assert not (out / "checkpoints" / "history.jsonl").exists()  # and was stopped untrained,
    assert not list((out / "checkpoints").glob("step-*"))  # with no checkpoint of nothing
    assert (out / "logs" / "rollout-0.log").is_file()
    assert took_s < 240  # it did not wait out the start-up timeout
