"""An in-process rollout source: transformers `generate` on a private copy of the policy.

Same interface as `RolloutClient` (generate, sync_weights), so the learner runs unchanged on
it. Sampling is seeded per prompt from SamplingParams.seed (prompt i draws its n samples
from the stream seeded `seed + i * n`), which makes runs repeatable: the exact-resume test
and quick benchmarks use it. Temperature 0 is greedy decoding, as in vLLM. Production always
uses the vLLM fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gspo_trainer.rollout.types import Completion, RolloutBatch, SamplingParams


@dataclass(frozen=True)
class LocalSyncReport:
    version: int
    bytes_total: int
    seconds: float = 0.0


class LocalRollout:
    def __init__(self, model: Any, pad_id: int, eos_id: int) -> None:
        self.model = model.eval()
        self.pad_id, self.eos_id = pad_id, eos_id
        self.policy_version: int | None = None

    async def __aenter__(self) -> LocalRollout:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def sync_weights(
        self, named_tensors: Iterable[tuple[str, Any]], version: int
    ) -> LocalSyncReport:
        import torch

        params = dict(self.model.named_parameters())
        total = 0
        with torch.no_grad():
            for name, t in named_tensors:
                params[name].copy_(t)
                total += t.numel() * t.element_size()
        self.policy_version = version
        return LocalSyncReport(version, total)

    async def fleet_state(self) -> tuple[int, int]:
        """One in-process policy: it always serves whatever it last received."""
        return 1, 0

    def server_versions(self) -> dict[str, int | None]:
        return {}  # no servers to report

    async def discover(self) -> list[str]:
        return []

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> RolloutBatch:
        import torch

        groups = []
        with torch.random.fork_rng(), torch.no_grad():
            for i, prompt in enumerate(prompts):
                one = params.for_prompt(i)
                if one.seed is not None:  # the prompt's own stream, not one for the batch
                    torch.manual_seed(one.seed)
                groups.append(self._sample(i, list(prompt), one))
        return RolloutBatch([list(p) for p in prompts], groups)

    def _sample(self, index: int, prompt: list[int], params: SamplingParams) -> list[Completion]:
        import torch

        ids = torch.tensor([prompt], device=self.model.device)  # (1, P), on the model's device
        greedy = params.temperature == 0
        sampling = (
            {}
            if greedy
            else {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": max(params.top_k, 0),
            }
        )
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=not greedy,
            **sampling,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.n,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        seqs = out.sequences[:, len(prompt) :]  # (n, T)
        logp = torch.stack(out.scores, 1).float().log_softmax(-1)  # (n, T, V)
        token_logp = logp.gather(-1, seqs[..., None])[..., 0]  # (n, T)
        completions = []
        for row in range(params.n):
            tokens = seqs[row].tolist()
            end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            completions.append(
                Completion(
                    prompt_index=index,
                    token_ids=tokens[:end],
                    logprobs=token_logp[row, :end].tolist(),
                    finish_reason="stop"
                    if end <= len(tokens) and self.eos_id in tokens
                    else "length",
                    policy_version=self.policy_version or 0,
                )
            )
        return completions
