"""What a run appends to survives a writer killed mid-line and a resume: history.jsonl (its
readers skip an undecodable line, its writer cuts a partial last line before appending) and
the logs of `gspo train` (appended after a header per attempt, not truncated)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

from gspo_trainer.plot import read_history
from gspo_trainer.train import ProgressView, spawn

RECORD = {"reward_mean": 0.5, "clip_fraction": 0.0, "log_ratio_abs": 0.0, "response_length": 2.0}


def killed_mid_write(path: Path) -> None:
    """Two whole records, then the third cut where a SIGKILL left it."""
    whole = "".join(json.dumps({"step": s, **RECORD}) + "\n" for s in (1, 2))
    path.write_text(whole + json.dumps({"step": 3, **RECORD})[:17])


def test_readers_skip_a_last_line_cut_by_a_killed_learner(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    killed_mid_write(history)
    assert [r["step"] for r in read_history(history)] == [1, 2]
    history.write_text(history.read_text() + "\n")  # the cut line, ended by the next writer
    view = ProgressView(history, max_steps=10, bar=False, out=io.StringIO())
    view.poll()
    assert [r["step"] for r in view.records] == [1, 2]


def test_the_learner_cuts_a_partial_last_line_before_appending(tmp_path: Path) -> None:
    from gspo_trainer.learner_state import LearnerState
    from gspo_trainer.step.stats import StepReport

    history = tmp_path / "history.jsonl"
    killed_mid_write(history)
    metrics = SimpleNamespace(
        observe_step=lambda step, stats: None,
        tokens=SimpleNamespace(inc=lambda n: None),
        observe_seconds=lambda stage, value: None,
    )
    trackers = SimpleNamespace(log=lambda step, record: None)
    report = StepReport(metrics, LearnerState(), trackers, history)  # type: ignore[arg-type]
    report.record(3, dict(RECORD), {"step": 1.0}, 10.0, None, None)
    lines = history.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_a_resumed_run_appends_to_its_logs_after_a_header(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_bytes(b"Traceback (most recent call last):\n  the first attempt's crash, cut")
    proc = spawn("learner", ["--version"], dict(os.environ), log)
    assert proc.popen.wait(timeout=60) == 0
    text = log.read_text()
    assert text.startswith("Traceback (most recent call last):\n  the first attempt's crash")
    assert "cut\n===== gspo train: learner started " in text  # the header on a line of its own
    assert text.rstrip().endswith("version 0.1.0")
    assert "Traceback" not in proc.tail()  # this attempt's lines only
