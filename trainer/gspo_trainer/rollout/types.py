"""Plain data exchanged between the learner and the rollout fleet (no torch, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    n: int  # responses per prompt (the GSPO group size)
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation (true sampling at temperature 1)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Completion:
    """One sampled response. `logprobs[t]` is the engine's log-prob of `token_ids[t]`."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or stop token, included in token_ids) | "length"
    policy_version: int


@dataclass
class RolloutBatch:
    """Responses in prompt order: groups[i] holds the n completions of prompts[i]."""

    prompts: list[list[int]]
    groups: list[list[Completion]]
    servers_failed: list[str] = field(default_factory=list)
