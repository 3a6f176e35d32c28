"""What the learner tells the operator about a run: served as JSON on GET /progress.

No torch here: the operator reads it with the same model the learner writes it with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

LearnerPhase = Literal["Starting", "Running", "Checkpointing", "Suspending", "Succeeded", "Failed"]
PROGRESS_PATH = "/progress"


class LearnerProgress(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    phase: LearnerPhase = "Starting"
    step: int = Field(0, ge=0, description="Completed training steps.")
    max_steps: int = Field(0, ge=0)
    reward: float | None = Field(None, description="Mean reward of the last step.")
    last_checkpoint: str | None = Field(None, description="Name of the newest complete checkpoint.")
    last_checkpoint_step: int | None = None
    policy_version: int = Field(0, ge=0, description="Weights version the rollout servers hold.")
    server_versions: dict[str, int | None] = Field(
        default_factory=dict,
        description="Policy version each rollout server holds (None: not synced yet), by URL.",
    )
    message: str = ""

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)
