"""How a rollout server confined to one core shares it: its front end before its engine.

vLLM's server is two processes: the front end (HTTP, request admission, output processing)
and its child, the engine core (the scheduler, and with the uniproc executor the model worker
too: `train.server_env`). The engine starts a forward as soon as one request is queued. When
both share one core, each request the front end admits wakes the engine, which the kernel
lets preempt the front end, so a step's requests (one per prompt) reach the engine in several
waves, and a batch that fits one forward per token runs as several. With the engine's threads
at a lower priority (a higher nice value) the front end admits the whole burst first: on the
embedded default (256 sequences of at most 4 tokens) 6.4 engine iterations a step became 5.1,
and the core's CPU time per step fell by about a tenth (BENCHMARKS.md). Nothing is starved:
the engine runs whenever the front end waits, which is most of the time.

Linux only (a nice value is per thread there, read from /proc); elsewhere nothing changes.

One side effect is handled here too: vLLM (0.32) stops its engine with no grace period by
default, and when the front end's output task is cancelled in that stop, its output handler
can still read the cancellation as an EngineDeadError and log it with a traceback
(vllm/v1/engine/core_client.py `process_outputs_socket`, async_llm.py `output_handler`). At
equal priority the engine's own SIGTERM handling usually won that race; below the front end
it never does, and every run ended with a traceback in the server's log. `ShutdownNoise`
drops that one record, and only once the server's own shutdown has begun.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from gspo_api import ports

log = logging.getLogger("gspo.rollout")

PROC = Path("/proc")
MAX_NICE = 19  # the lowest priority setpriority(2) takes


def child_processes(pid: int, proc: Path = PROC) -> list[int]:
    """The live children of process `pid` (each of its threads' /proc children lists)."""
    children: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return sorted(set(children))


def lower_children(increment: int, pid: int | None = None, proc: Path = PROC) -> list[int]:
    """Every thread of every child of `pid` (this process by default) at `increment` more
    nice than `pid` has, at most MAX_NICE; returns the children it lowered. A child or thread
    gone meanwhile is skipped; a refused change (another user's process) is logged."""
    pid = os.getpid() if pid is None else pid
    base = os.getpriority(os.PRIO_PROCESS, pid)
    target = min(MAX_NICE, base + increment)
    lowered = []
    for child in child_processes(pid, proc):
        try:
            threads = [int(t.name) for t in (proc / str(child) / "task").iterdir()]
        except OSError:
            continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            except ProcessLookupError:
                continue
            except OSError as exc:
                log.warning("Could not lower the priority of thread %d of %d: %s", tid, child, exc)
                break
        else:
            lowered.append(child)
    return lowered


SHUTDOWN_LOGGER = "vllm.entrypoints.launchers.launcher"  # "[shutdown] API server: ..."
OUTPUT_HANDLER_LOGGER = "vllm.v1.engine.async_llm"


class ShutdownNoise(logging.Filter):
    """Drops the output handler's EngineDeadError record once the server began to shut down
    (vLLM's launcher logged "[shutdown] API server: shutdown triggered"); every other record,
    and that one before the shutdown (an engine that really died), passes."""

    def __init__(self) -> None:
        super().__init__()
        self.shutting_down = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == SHUTDOWN_LOGGER and "shutdown triggered" in message:
            self.shutting_down = True
            return True
        error = record.exc_info[1] if record.exc_info else None
        dead = type(error).__name__ == "EngineDeadError"
        return not (self.shutting_down and dead and "output_handler failed" in message)

    def install(self) -> None:
        for name in (SHUTDOWN_LOGGER, OUTPUT_HANDLER_LOGGER):
            logging.getLogger(name).addFilter(self)


def engine_yields(environ: Mapping[str, str]) -> list[int]:
    """In the server's front end once its engine runs: its child processes (the engine core,
    with the uniproc executor the worker too; multiprocessing's resource tracker, idle)
    lowered by $GSPO_ENGINE_NICE, set by `gspo train` only for that layout on one core; []
    when it is unset, invalid, or nothing could be lowered (said in the log)."""
    raw = environ.get(ports.ENV_ENGINE_NICE, "").strip()
    if not raw or not PROC.is_dir():
        return []
    try:
        increment = int(raw)
    except ValueError:
        increment = -1
    if increment < 0:  # as root a negative one would raise the engine above its front end
        log.warning(
            "$%s=%r is not a whole number of 0 or more: the engine keeps its priority",
            ports.ENV_ENGINE_NICE,
            raw,
        )
        return []
    lowered = lower_children(increment)
    if not lowered:  # no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN), or refused
        log.warning("No child of the front end could be lowered: the engine keeps its priority")
        return []
    ShutdownNoise().install()
    nice = os.getpriority(os.PRIO_PROCESS, lowered[0])
    log.info("The front end's child processes %s run at nice %d beside it", lowered, nice)
    return lowered
