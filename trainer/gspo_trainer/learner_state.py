"""What the learner reports about itself (progress, history), shared by the learner's parts,
and the wait on the rollout fleet that a stop asked for ends (`unless_stopped`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from gspo_api.progress import LearnerPhase

T = TypeVar("T")
STOP_POLL_S = 0.1  # how soon a wait on the rollout fleet sees a stop asked for


@dataclass
class LearnerState:
    step: int = 0  # training steps done (= updates of the policy's version)
    policy_version: int = 0  # the version last pushed to the rollout servers
    last_checkpoint: str | None = None
    last_checkpoint_step: int | None = None
    phase: LearnerPhase = "Starting"
    reward: float | None = None
    message: str = ""
    stop_requested: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


async def unless_stopped(state: LearnerState, work: Awaitable[T]) -> T | None:
    """`work`, or None (cancelled) once `state.stop_requested` is set, which a signal handler
    does (learner_cli.py) while rank 0 awaits the fleet. Suspended, the servers stop with the
    learner, and vLLM ends its engine at once on SIGTERM but keeps a request in flight, a
    generation or a control call, open until its pod is killed a grace period later
    (vllm/entrypoints/launchers/launcher.py, mode abort): waiting for it would hold the final
    checkpoint as long. Work that finished before the cancel landed keeps its result."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if state.stop_requested:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            break
        await asyncio.wait({task}, timeout=STOP_POLL_S)
    return None if task.cancelled() else task.result()
