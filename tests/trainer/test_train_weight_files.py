"""`gspo train` with `weightSync.method: filesystem`: the learner writes each policy version
to the checkpoint volume and the real vLLM server loads it from there; no sync group."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from checkout import run_gspo

from gspo_api import ports
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.plot import read_history
from gspo_trainer.train import torch_cache_dir

pytestmark = pytest.mark.e2e
STEPS = 3


def test_train_syncs_every_step_through_the_shared_volume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    manifest = tiny_manifest()
    manifest["spec"]["weightSync"] = {"method": "filesystem", "bucketSizeMb": 1}
    manifest["spec"]["checkpoint"].update(exportHf=False)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "run"
    tmp = tmp_path / "tmp"  # the run's temporary directory: left as it was found
    tmp.mkdir()
    kept = tmp / Path(torch_cache_dir()).name  # torch's directory there: the one it keeps
    kept.symlink_to(torch_cache_dir(), target_is_directory=True)
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    done = run_gspo("train", str(config), "--output-dir", str(out), "--max-steps", str(STEPS),
                    "--no-progress", timeout_s=400, env={"TMPDIR": str(tmp)})  # fmt: skip
    learner_log = (out / "logs" / "learner.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + learner_log[-3000:]
    assert [r["step"] for r in read_history(out / "checkpoints" / "history.jsonl")] == [1, 2, 3]
    # The server loaded the start-up weights and each step's from files, in order.
    server_log = (out / "logs" / "rollout-0.log").read_text()
    loaded = [int(v) for v in re.findall(r"Loaded policy version (\d+)", server_log)]
    assert loaded == list(range(STEPS + 1)), server_log[-3000:]
    # Every reload ran (above) and none warned about the rotary embedding's computed cache.
    assert "RotaryEmbedding: Failed to load weights" not in server_log
    weights = out / "checkpoints" / ports.WEIGHTS_SUBDIR
    assert [p.name for p in weights.iterdir()] == [f"v{STEPS:08d}"]  # only the newest kept
    assert "sync group" not in learner_log.lower()
    # vLLM's ZeroMQ sockets and rendezvous file went with its servers' own directory.
    assert [p.name for p in tmp.iterdir()] == [kept.name]


def test_the_reload_warning_of_computed_layers_is_dropped_and_no_other() -> None:
    """vLLM warns "<Layer>: Failed to load weights" at every reload for each layer whose
    tensors the update did not carry; for the rotary embedding (a computed cache) that is
    noise, for any other layer a missing weight."""
    import logging

    from gspo_trainer.rollout.worker_ext import RELOAD_LOGGER, keep_reload_record

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 1, message, (), None)

    assert not keep_reload_record(record("RotaryEmbedding: Failed to load weights"))
    assert keep_reload_record(record("QKVParallelLinear: Failed to load weights"))
    assert keep_reload_record(record("RotaryEmbedding: Delayed processing"))
    assert keep_reload_record in logging.getLogger(RELOAD_LOGGER).filters
