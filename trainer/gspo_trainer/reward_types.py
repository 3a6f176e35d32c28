"""What a reward is given and what one scoring pass saw: the types the scorer (rewards.py),
the code sandbox's runner (code/runner.py) and the TRL and verl conventions
(reward_conventions.py) share, in a module of their own so that none of them imports
another for its types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Scored:
    prompt: str
    completion: str  # decoded response without special tokens
    answer: str
    finished: bool  # the response ended with EOS (not cut at max tokens)
    tokens: int | None = None  # response tokens, read by the length component
    # For TRL's and verl's functions (reward_conventions.py): the response's token ids, the
    # prompt as the data set holds it (text or messages) and the data set's row.
    token_ids: Sequence[int] | None = None
    source_prompt: str | list[dict[str, Any]] | None = None
    row: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class BatchOutcome:
    """What one score() call saw: its calls, and those that failed by reason."""

    calls: int = 0
    failed: dict[str, int] = field(default_factory=lambda: {"error": 0, "timeout": 0})
    first: str = ""  # the first failure's message, for the batch's one warning

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())
