"""The memory plan as a check: a spec that cannot fit the GPUs it names is refused before any pod
starts (`gspo validate` and the operator alike), with the numbers and the fixes.

The plan needs the model's config.json (gspo_api.memory_plan). The operator has the
built-in models and the configs shipped with the package; a Hub model neither there nor in a
local Hugging Face cache is not planned, and the job goes ahead: a warning says the plan was
skipped, never a refusal. The annotation gspo.dev/allow-overcommit: "true" on the GSPOJob (or
`gspo validate --allow-overcommit`) turns a refusal into a warning, for a user who knows their
GPUs better than the plan does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gspo_api.memory_plan import MemoryPlan, plan_spec, refusals
from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import Problem

ALLOW_OVERCOMMIT = "gspo.dev/allow-overcommit"


@dataclass(frozen=True)
class MemoryCheck:
    plan: MemoryPlan | None
    problems: list[Problem] = field(default_factory=list)  # refusals
    warnings: list[str] = field(default_factory=list)  # a skipped plan, allowed overcommits


def overcommit_allowed(annotations: Any) -> bool:
    value = annotations.get(ALLOW_OVERCOMMIT) if isinstance(annotations, Mapping) else None
    return str(value).lower() == "true"


def check_memory(
    spec: GSPOJobSpec,
    *,
    allow_overcommit: bool = False,
    gpu_memory_gib: float | None = None,
) -> MemoryCheck:
    """The plan of `spec` and what it refuses (or, allowed to overcommit, warns of)."""
    plan, skipped = plan_spec(spec, gpu_memory_gib)
    if plan is None:
        return MemoryCheck(None, warnings=[skipped])
    found = [
        Problem(
            path,
            f'{message}; or annotate the GSPOJob {ALLOW_OVERCOMMIT}: "true" to run it anyway',
        )
        for path, message in refusals(plan)
    ]
    if allow_overcommit:
        return MemoryCheck(plan, warnings=[f"{p.path}: {p.message}" for p in found])
    return MemoryCheck(plan, problems=found)
