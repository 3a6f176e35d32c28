"""What the learner reports about itself (progress, history), shared by the learner's parts."""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_api.progress import LearnerPhase


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
