"""Plain data exchanged between the learner and the rollout fleet (no torch, no vLLM)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

# Seeds stay below 2**62 so that a base plus prompt_index * n + sample_index never overflows
# the signed 64-bit seeds torch generators (and vLLM's per-request generators) take.
SEED_SPACE = 2**62


@dataclass(frozen=True)
class SamplingParams:
    n: int  # responses per prompt (the GSPO group size)
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation (true sampling at temperature 1)
    # The batch's base seed. Sample j of prompt i (its index in the batch) is drawn with seed
    # `seed + i * n + j` (`sample_seed`): every sample has its own stream, distinct within the
    # batch, and a client that splits a batch across servers shifts the base per chunk
    # (`for_prompt`), so the draw does not depend on how the batch was split. None: unseeded.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def for_prompt(self, index: int) -> SamplingParams:
        """The parameters of the batch's prompt `index` alone: its samples keep their seeds
        (one request per prompt, as vLLM seeds a request's n children `seed + j`)."""
        if self.seed is None:
            return self
        return replace(self, seed=self.seed + index * self.n)


def step_seed(seed: int, step: int, stream: str = "train") -> int:
    """The base sampling seed of one step of a run: a hash of (run seed, step, stream), so
    neighbouring steps and seeds do not share streams (seed + step would: run 1's step 1 would
    draw run 0's step 2). `stream` keeps evaluation draws apart from training draws."""
    digest = hashlib.blake2b(f"gspo|{seed}|{step}|{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_SPACE


def sample_seed(base: int, prompt_index: int, sample_index: int, n: int) -> int:
    """The seed of sample `sample_index` of prompt `prompt_index` in a batch seeded `base`
    with n samples per prompt: distinct for every sample of the batch."""
    return base + prompt_index * n + sample_index


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
