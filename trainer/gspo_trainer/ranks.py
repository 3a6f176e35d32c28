"""The learner group's collectives, in one place: every rank calls each in the same order.

One learner rank per process (torchrun); `world == 1` skips every collective, so `gspo train`
on one process never touches a process group's wire. Flags travel as floats through
all_reduce (MAX), objects through broadcast_object_list from rank 0. Tensors go on the
group's device: NCCL takes CUDA tensors only (this rank's GPU), gloo CPU ones.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


class Ranks:
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank."""
        return self.max_int(1 if flag else 0) > 0

    def all(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on every rank."""
        return not self.any(not flag)

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks, on every rank."""
        import torch
        import torch.distributed as dist

        if self.world == 1:
            return value
        box = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (what other ranks pass is ignored)."""
        import torch.distributed as dist

        if self.world == 1:
            return obj
        box: list[Any] = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    def mean(self, local: dict[str, float]) -> dict[str, float]:
        """Each value averaged over the ranks (every rank passes the same keys)."""
        return {k: v / self.world for k, v in self._reduce(local, "sum").items()}

    def maximum(self, local: dict[str, float]) -> dict[str, float]:
        """Each value's largest over the ranks (every rank passes the same keys)."""
        return self._reduce(local, "max")

    def _reduce(self, local: dict[str, float], op: str) -> dict[str, float]:
        """One all_reduce (SUM or MAX) of every value, in float64, keys in sorted order."""
        import torch
        import torch.distributed as dist

        if self.world == 1 or not local:
            return dict(local)
        keys = sorted(local)
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return {k: float(v) for k, v in zip(keys, vec.tolist(), strict=True)}

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier()
