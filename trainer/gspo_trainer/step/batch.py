"""A step's responses as tensors (`Packed`) and the slices that cut them into micro-batches."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Packed:
    """A step's responses as tensors, one row per response (N rows, groups contiguous)."""

    ids: torch.Tensor  # (N, L) prompt + response, right-padded
    attn: torch.Tensor  # (N, L)
    targets: torch.Tensor  # (N, L-1) ids[:, 1:]
    mask: torch.Tensor  # (N, L-1) bool, True where targets is a response token
    engine_logp: torch.Tensor  # (N, L-1) engine log-probs at the mask
    rewards: torch.Tensor  # (N,)
    lengths: torch.Tensor  # (N,) response tokens
    # (N,) prompt + response tokens of each row, on the host: the row bounds the forward and
    # the micro-batch plan need, read without waiting for the device
    seq_lengths: tuple[int, ...]
    # (N, L-1) each response token's reward at the mask (0 elsewhere), when the reward scored
    # per token; None when every reward was one number per response
    token_rewards: torch.Tensor | None = None

    def to(self, device: torch.device) -> Packed:
        """The same batch on `device` (the engine's: the model, the loss and the collectives
        all read it there); itself when it is there already."""
        if self.ids.device == device:
            return self
        ids = self.ids.to(device)
        tokens = None if self.token_rewards is None else self.token_rewards.to(device)
        return Packed(
            ids,
            self.attn.to(device),
            ids[:, 1:],
            self.mask.to(device),
            self.engine_logp.to(device),
            self.rewards.to(device),
            self.lengths.to(device),
            self.seq_lengths,
            tokens,
        )

    def width(self, rows: slice) -> int:
        """The longest sequence among `rows` (prompt + response), the length they run at."""
        return max(self.seq_lengths[rows])


def pack(
    prompts: list[list[int]],
    responses: list[list[int]],
    engine_logps: list[list[float]],
    rewards: list[float],
    group_size: int,
    pad_id: int,
    token_rewards: list[list[float]] | None = None,
) -> Packed:
    """The responses (each after its group's prompt) as padded rows; each response's
    per-token values (engine log-probs, token rewards) laid at the positions that predict its
    tokens, where `mask` is True."""
    import torch

    if token_rewards is not None:
        bad = [
            i
            for i, (t, r) in enumerate(zip(token_rewards, responses, strict=True))
            if len(t) != len(r)
        ]
        if bad:
            i = bad[0]
            raise ValueError(
                f"response {i} has {len(responses[i])} tokens but "
                f"{len(token_rewards[i])} token rewards"
            )

    rows = [prompts[i // group_size] + r for i, r in enumerate(responses)]
    L = max(len(r) for r in rows)
    N = len(rows)
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    attn = torch.zeros((N, L), dtype=torch.long)
    mask = torch.zeros((N, L - 1), dtype=torch.bool)
    engine_logp = torch.zeros((N, L - 1))
    tok_rewards = None if token_rewards is None else torch.zeros((N, L - 1))
    for i, row in enumerate(rows):
        p, n = len(prompts[i // group_size]), len(responses[i])
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        mask[i, p - 1 : p - 1 + n] = True
        engine_logp[i, p - 1 : p - 1 + n] = torch.tensor(engine_logps[i], dtype=torch.float32)
        if tok_rewards is not None and token_rewards is not None:
            tok_rewards[i, p - 1 : p - 1 + n] = torch.tensor(token_rewards[i], dtype=torch.float32)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    return Packed(
        ids,
        attn,
        ids[:, 1:],
        mask,
        engine_logp,
        torch.tensor(rewards, dtype=torch.float32),
        lengths,
        tuple(len(r) for r in rows),
        tok_rewards,
    )


def micro_slices(rows: slice, count: int) -> list[slice]:
    """`rows` cut into `count` contiguous, nearly equal parts, none empty."""
    n = rows.stop - rows.start
    count = max(1, min(count, n))
    bounds = [rows.start + (n * j) // count for j in range(count + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def micro_count(rows_per_update: int, padded_len: int, token_budget: int) -> int:
    """Micro-batches so that each holds at most `token_budget` padded tokens (one row each
    when a single row is longer than the budget)."""
    per_micro = max(1, token_budget // max(padded_len, 1))
    return -(-rows_per_update // per_micro)


def token_micro_count(lengths: list[int], token_budget: int) -> int:
    """Packed (learner.packSequences), the fewest contiguous micro-batches of these rows
    (their lengths, prompt + response) holding at most `token_budget` real tokens each (a row
    longer than the budget goes alone)."""
    return len(_cut(lengths, token_budget))


def token_micro_slices(rows: slice, lengths: list[int], count: int) -> list[slice]:
    """`rows` (of `lengths` tokens each) cut into `count` contiguous micro-batches (fewer only
    when there are fewer rows), none empty, the largest one's tokens as few as they can be."""
    n = rows.stop - rows.start
    assert len(lengths) == n
    count = max(1, min(count, n))
    lo, hi = max(lengths, default=0), sum(lengths)
    while lo < hi:  # the smallest cap that `count` micro-batches can keep to
        mid = (lo + hi) // 2
        if len(_cut(lengths, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    parts = _cut(lengths, lo)
    while len(parts) < count:  # split the heaviest micro-batch of 2+ rows where it halves
        a, b = max((p for p in parts if p[1] - p[0] > 1), key=lambda p: sum(lengths[p[0] : p[1]]))
        total = sum(lengths[a:b])
        at = min(range(a + 1, b), key=lambda i: max(s := sum(lengths[a:i]), total - s))
        k = parts.index((a, b))
        parts[k : k + 1] = [(a, at), (at, b)]
    return [slice(rows.start + a, rows.start + b) for a, b in parts]


def _cut(lengths: list[int], cap: int) -> list[tuple[int, int]]:
    """Greedy contiguous parts of at most `cap` tokens (a longer row alone), as (start, stop)."""
    parts: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, x in enumerate(lengths):
        if i > start and total + x > cap:
            parts.append((start, i))
            start, total = i, 0
        total += x
    if lengths:
        parts.append((start, len(lengths)))
    return parts
