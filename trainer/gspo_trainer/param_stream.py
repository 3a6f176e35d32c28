"""The policy's parameters one layer at a time: what a weight sync and an export read.

Under ZeRO-3 each rank holds a shard of every parameter. Gathering them all at once costs the
whole model on every rank (61 GB for Qwen3-30B-A3B in bf16, beside the shards, activations
and optimizer state on an 80 GB card). A `ParamStream` gathers one group at a time (one
decoder layer, or one parameter outside the layers: embeddings, final norm, lm_head), hands
its tensors out, and frees it before gathering the next; a consumer copies each tensor out
(into a send bucket, a file shard) before asking for the next. Names, full shapes and dtypes
are known without gathering (ZeRO-3 records `ds_shape`), so a sender plans its buckets and a
writer its shards before the first gather.

Gathering is collective: every rank gathers the same groups in the same order. Rank 0 reads
the stream; the other ranks `follow()`: rank 0 tells them when a pass starts (a sync that
fails mid-way re-forms its group and sends again, so there may be several) and when it is
done (`finish()`). A pass left early still gathers its remaining groups, so the followers
never wait on a gather rank 0 skipped, and so does one closed before its first layer (an
export that fails before it reads). Under ZeRO-0/1/2 (or one rank) the parameters are
whole on every rank: the stream yields them as they are and nothing is collective.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from gspo_trainer.ranks import Ranks

if TYPE_CHECKING:
    import torch

TensorSpec = tuple[str, tuple[int, ...], "torch.dtype"]  # name, full shape, dtype

_PASS, _DONE = "pass", "done"


def group_key(name: str) -> str:
    """The group a parameter is gathered with: its name up to the first index
    (`model.layers.7.mlp.gate.weight` → `model.layers.7`), else the name itself."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


class ParamStream:
    """(name, full tensor) pairs of `module`, in `named_parameters()` order, one group
    gathered at a time. A tensor is valid until the stream moves to the next group."""

    def __init__(self, module: Any, ranks: Ranks, *, zero3: bool) -> None:
        named = list(module.named_parameters())
        self.groups = [list(g) for _, g in itertools.groupby(named, key=lambda p: group_key(p[0]))]
        self.ranks = ranks
        # Followers exist only when a gather is a collective: ZeRO-3 over more than one rank.
        self.zero3, self.collective = zero3, zero3 and ranks.world > 1

    @classmethod
    def of(cls, engine: Any, ranks: Ranks) -> ParamStream:
        return cls(engine.module, ranks, zero3=engine.zero_optimization_stage() == 3)

    def metas(self) -> list[TensorSpec]:
        """Every parameter's name, full shape and dtype, without gathering anything."""
        return [meta for group in self._group_metas() for meta in group]

    def nbytes(self) -> int:
        return sum(_nbytes(meta) for meta in self.metas())

    def largest_group_bytes(self) -> int:
        """The most one gathered group holds: the stream's own peak beyond the shards."""
        return max((sum(_nbytes(m) for m in g) for g in self._group_metas()), default=0)

    def _group_metas(self) -> list[list[TensorSpec]]:
        out = []
        for group in self.groups:
            metas = []
            for name, p in group:
                shape = getattr(p, "ds_shape", None) if self.zero3 else None
                metas.append((name, tuple(shape if shape is not None else p.shape), p.dtype))
            out.append(metas)
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass (rank 0, or a lone rank), tensor by tensor."""
        layers = self.layers()
        try:
            for layer in layers:
                yield from layer
                del layer  # held into the next gather, it would keep this layer's memory
        finally:
            layers.close()

    def layers(self) -> Pass:
        """One pass, group by group (for a consumer that converts a layer's tensors
        together). Starting it tells the followers to gather too; close it however the
        reading ends (it then gathers the groups not read, as the followers do)."""
        if self.collective:
            if self.ranks.rank != 0:
                raise RuntimeError("only rank 0 reads a ParamStream; the others follow()")
            self.ranks.broadcast(_PASS)
        return Pass(self)

    def finish(self) -> None:
        """Rank 0: no more passes; the followers return from follow()."""
        if self.collective and self.ranks.rank == 0:
            self.ranks.broadcast(_DONE)

    def follow(self) -> int:
        """Ranks other than 0: gather along with every pass rank 0 makes until it finishes;
        returns the number of passes."""
        passes = 0
        if not self.collective:
            return passes
        while self.ranks.broadcast(None) == _PASS:
            for _ in Pass(self):
                pass
            passes += 1
        return passes


class Pass(Iterator[list[tuple[str, "torch.Tensor"]]]):
    """One pass over a ParamStream's groups, each gathered while it is the current one.
    `close()` ends it however it went: read to the end, left mid-way, or never started, it
    gathers every group not yet gathered, so rank 0 runs the same gathers as the followers."""

    def __init__(self, stream: ParamStream) -> None:
        self.stream = stream
        self.left = iter(stream.groups)  # shared with the generator: what close() gathers
        self.gathered = self._gathered()

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> list[tuple[str, torch.Tensor]]:
        return next(self.gathered)

    def close(self) -> None:
        self.gathered.close()  # lets go of the current group
        if self.stream.collective:
            import deepspeed

            for group in self.left:
                with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                    pass

    def _gathered(self) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        if not self.stream.zero3:
            for group in self.left:
                yield [(name, p.data) for name, p in group]
            return
        import deepspeed

        for group in self.left:
            with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                yield [(name, p.data) for name, p in group]


def _nbytes(meta: TensorSpec) -> int:
    return math.prod(meta[1]) * meta[2].itemsize
