"""A one-core server's engine below its front end (rollout/core_share.py), on real processes:
a front-end process of the test's own, whose only child stands in for the engine (this
test's process may have children of other tests, which must not be touched)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gspo_api import ports
from gspo_trainer.rollout import core_share

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

# The engine: a child with a second thread (every thread of it must be lowered).
TWO_THREADS = (
    "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True)"
    ".start(); print('up', flush=True); time.sleep(60)"
)
# The front end: starts the engine, applies $GSPO_ENGINE_NICE as the plugin does, reports,
# and keeps both alive until the test has looked.
FRONT_END = f"""
import json, os, subprocess, sys
from gspo_trainer.rollout import core_share
engine = subprocess.Popen([sys.executable, "-c", {TWO_THREADS!r}], stdout=subprocess.PIPE)
engine.stdout.readline()
lowered = core_share.engine_yields(os.environ)
print(json.dumps({{"engine": engine.pid, "lowered": lowered}}), flush=True)
sys.stdin.readline()
engine.kill()
"""


@pytest.fixture
def front_end() -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str]) -> tuple[int, int, list[int]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", FRONT_END],
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        return proc.pid, report["engine"], report["lowered"]

    yield start
    for proc in started:
        proc.communicate("\n", timeout=30)


def niceness(pid: int) -> list[int]:
    threads = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())
    return [os.getpriority(os.PRIO_PROCESS, tid) for tid in threads]


def test_every_thread_of_the_engine_runs_below_its_front_end(front_end: Any) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, os.getpid())
    pid, engine, lowered = front_end({ports.ENV_ENGINE_NICE: "3"})
    assert lowered == [engine] and core_share.child_processes(pid) == [engine]
    assert niceness(engine) == [min(mine + 3, core_share.MAX_NICE)] * 2
    assert niceness(pid) == [mine] * len(niceness(pid))  # the front end keeps its own


@pytest.mark.parametrize("setting", [None, "ten", "-5"])
def test_without_a_valid_setting_the_engine_keeps_its_priority(
    front_end: Any, setting: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, os.getpid())
    monkeypatch.delenv(ports.ENV_ENGINE_NICE, raising=False)
    _, engine, lowered = front_end({} if setting is None else {ports.ENV_ENGINE_NICE: setting})
    assert lowered == [] and niceness(engine) == [mine] * 2


def test_a_bad_setting_or_nothing_to_lower_is_said(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.WARNING, logger="gspo.rollout"):
        assert core_share.engine_yields({ports.ENV_ENGINE_NICE: "ten"}) == []
        assert ports.ENV_ENGINE_NICE in caplog.text and "'ten'" in caplog.text
        caplog.clear()
        # A kernel without /proc/<pid>/task/<tid>/children: nothing found, and it says so.
        monkeypatch.setattr(core_share, "lower_children", lambda increment: [])
        assert core_share.engine_yields({ports.ENV_ENGINE_NICE: "10"}) == []
        assert "No child of the front end could be lowered" in caplog.text


def test_a_process_without_children_or_gone_lowers_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    gone = int(done.stdout)
    assert core_share.child_processes(gone) == []
    me = os.getpid()
    fake = tmp_path / "proc"  # a /proc whose child vanished between the two reads
    (fake / str(me) / "task" / str(me)).mkdir(parents=True)
    (fake / str(me) / "task" / str(me) / "children").write_text(f"{gone} ")
    assert core_share.child_processes(me, fake) == [gone]
    assert core_share.lower_children(1, proc=fake) == []


class EngineDeadError(Exception):
    """Named as vLLM's (vllm/v1/engine/exceptions.py): the filter matches the name."""


def handler_failed() -> logging.LogRecord:
    try:
        raise EngineDeadError("EngineCore encountered an issue.")
    except EngineDeadError:
        exc_info = sys.exc_info()
    return logging.LogRecord(
        core_share.OUTPUT_HANDLER_LOGGER,
        logging.ERROR,
        "async_llm.py",
        906,
        "AsyncLLM output_handler failed.",
        None,
        exc_info,
    )


def test_the_engines_death_is_reported_unless_the_server_is_stopping() -> None:
    noise = core_share.ShutdownNoise()
    assert noise.filter(handler_failed())  # a real death: kept
    other = logging.LogRecord(
        core_share.SHUTDOWN_LOGGER, logging.INFO, "launcher.py", 1, "serving", None, None
    )
    assert noise.filter(other) and not noise.shutting_down
    triggered = logging.LogRecord(
        core_share.SHUTDOWN_LOGGER,
        logging.INFO,
        "launcher.py",
        254,
        "[shutdown] API server: shutdown triggered",
        None,
        None,
    )
    assert noise.filter(triggered) and noise.shutting_down
    assert not noise.filter(handler_failed())  # the stop's own race: dropped
    unrelated = logging.LogRecord(
        core_share.OUTPUT_HANDLER_LOGGER,
        logging.ERROR,
        "async_llm.py",
        1,
        "AsyncLLM output_handler failed.",
        None,
        (ValueError, ValueError("x"), None),
    )
    assert noise.filter(unrelated)  # any other failure still shows
