"""`gspo train` while its learner runs: a rollout server that exits is named with the error
its log gives, and once none is left the learner is stopped (a final checkpoint) instead of
waiting for a server no one restarts. Real processes stand in for the learner and servers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_trainer.train import Proc, first_error, follow_learner

# Exits 143 on SIGTERM after writing "final checkpoint" (as the learner does); else waits.
LEARNER = r"""
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("final checkpoint")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(float(sys.argv[2]))
"""

VLLM_LOG = """\
(APIServer pid=1) WARNING 11-26 [system_utils.py:255] Found ulimit of 20000 and failed: \
`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(Worker pid=2) ERROR [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=2) ERROR [multiproc.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=3) ERROR 11-26 [core.py:1512] RuntimeError: Worker failed with error 'x'
(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: \
EngineCore encountered an issue.
nanobind: leaked 514 functions!
"""


def start(tmp_path: Path, name: str, code: str, *args: str) -> Proc:
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as f:
        popen = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return Proc(name, popen, log)


def server_that_dies(tmp_path: Path, name: str, after_s: float) -> Proc:
    log_text = repr(VLLM_LOG)
    code = f"import sys, time; time.sleep({after_s}); sys.stdout.write({log_text}); sys.exit(3)"
    return start(tmp_path, name, code)


def test_the_root_cause_is_the_first_error_line_not_a_quoted_one_or_what_reports_it() -> None:
    assert first_error(VLLM_LOG) == "RuntimeError: CPU Generator does not use offset"
    assert first_error("ValueError: bad\nKeyError: later") == "ValueError: bad"
    assert first_error("all fine\nINFO started") is None


def test_every_server_gone_stops_the_learner_with_a_final_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    learner = start(tmp_path, "learner", LEARNER, str(tmp_path / "stopped"), "60")
    servers = [(server_that_dies(tmp_path, f"rollout-{i}", 0.2 * i), "url") for i in range(2)]
    polls: list[float] = []
    begin = time.monotonic()
    try:
        ended = follow_learner(learner, servers, lambda: polls.append(1), period_s=0.05)
    finally:
        learner.stop(timeout_s=5)
    assert ended is not None and "every rollout server exited" in ended
    assert "run the same command again to resume" in ended
    assert learner.popen.returncode == 143
    assert (tmp_path / "stopped").read_text() == "final checkpoint"
    assert time.monotonic() - begin < 30 and polls
    err = capsys.readouterr().err
    for name in ("rollout-0", "rollout-1"):  # each named once, with its root cause
        line = f"{name} exited (code 3): RuntimeError: CPU Generator does not use offset"
        assert err.count(line) == 1, err


def test_one_server_gone_is_named_and_the_learner_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    learner = start(tmp_path, "learner", LEARNER, str(tmp_path / "stopped"), "1.5")
    alive = start(tmp_path, "rollout-1", "import time; time.sleep(60)")
    servers = [(server_that_dies(tmp_path, "rollout-0", 0), "url"), (alive, "url")]
    try:
        ended = follow_learner(learner, servers, lambda: None, period_s=0.05)
    finally:
        alive.stop(timeout_s=5)
        learner.stop(timeout_s=5)
    assert ended is None
    assert learner.popen.returncode == 0  # it finished on its own, not stopped
    assert not (tmp_path / "stopped").exists()
    err = capsys.readouterr().err
    assert err.count("rollout-0 exited (code 3)") == 1 and "rollout-1" not in err
