"""Which rows of a step each rank trains on, mini-batch by mini-batch, in micro-batches.

A step's N responses form `miniBatches` contiguous mini-batches, one optimizer update each;
each rank takes an equal share of every mini-batch (DeepSpeed averages the gradients, so the
update is the mean over the whole mini-batch whatever the number of ranks), cut into
micro-batches within learner.microBatchTokens: padded tokens (rows x the longest) when rows run
padded, real tokens (the sum of the rows' lengths) when they run packed (learner.packSequences;
step/policy.py), micro-batches then balanced by tokens rather than by rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_trainer.ranks import Ranks
from gspo_trainer.step.batch import (
    Packed,
    micro_count,
    micro_slices,
    token_micro_count,
    token_micro_slices,
)


@dataclass(frozen=True)
class MiniBatch:
    rows: slice  # this rank's rows of the mini-batch
    micro: list[slice]  # the same rows, in micro-batches (as many on every rank)

    def share(self, sub: slice) -> float:
        """The part of the mini-batch a micro-batch holds: its loss's weight."""
        return (sub.stop - sub.start) / (self.rows.stop - self.rows.start)

    def local(self, sub: slice) -> slice:
        """A micro-batch's rows counted from the mini-batch's first row."""
        return slice(sub.start - self.rows.start, sub.stop - self.rows.start)


def plan_step(
    packed: Packed, mini_batches: int, token_budget: int, ranks: Ranks, *, pack: bool = False
) -> list[MiniBatch]:
    """This rank's mini-batches. Every rank runs as many micro-batches (ZeRO's collectives in
    backward pair up across ranks), so the count is the largest any rank needs. `pack`: the
    rows run packed (Policy.packs), so a micro-batch costs its rows' real tokens."""
    n = packed.rewards.shape[0]
    per_update = n // mini_batches
    share = per_update // ranks.world
    mine = [
        slice(k * per_update + ranks.rank * share, k * per_update + (ranks.rank + 1) * share)
        for k in range(mini_batches)
    ]
    if not pack:
        need = max(micro_count(r.stop - r.start, packed.width(r), token_budget) for r in mine)
        need = ranks.max_int(need)
        return [MiniBatch(r, micro_slices(r, need)) for r in mine]
    lengths = [list(packed.seq_lengths[r]) for r in mine]
    need = ranks.max_int(max(token_micro_count(x, token_budget) for x in lengths))
    return [
        MiniBatch(r, token_micro_slices(r, x, need)) for r, x in zip(mine, lengths, strict=True)
    ]
