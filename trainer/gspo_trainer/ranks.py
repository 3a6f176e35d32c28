"""The learner group's collectives, in one place: every rank calls each in the same order.

One learner rank per process (torchrun); `world == 1` skips every collective, so `gspo train`
on one process never touches a process group's wire. Flags travel as floats through
all_reduce (MAX), objects through broadcast_object_list from rank 0.

These collectives agree on control flow (a flag, a step's rollouts, a checkpoint's name, a
few statistics), and often while rank 0 works alone (generates and scores, waits for the
fleet, evaluates, commits a checkpoint): they run on a gloo group of their own, on the CPU,
whose timeout (`control_timeout_s`) covers the longest such stretch. The default group
(NCCL on GPUs) keeps DeepSpeed's timeout for the tensor traffic of training, where every
rank works at once; its watchdog would end a rank that waited there on rank 0 for longer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from gspo_api import ports

if TYPE_CHECKING:
    from gspo_api.spec import GSPOJobSpec

T = TypeVar("T")

# What rank 0 may still do alone after every bound below: commit a checkpoint (the manifest
# from the ranks' checksums, a rename, pruning the oldest), or export a layer to disk.
CONTROL_SLACK_SECONDS = 1800.0


def control_timeout_s(spec: GSPOJobSpec) -> float:
    """How long a rank waits in a control collective for rank 0 before it fails: the sum of
    what rank 0 may do alone between two of them, each already bounded on rank 0 itself.
    Waiting for the fleet (ports.ROLLOUT_STARTUP_SECONDS at the start), then syncing it (two
    attempts of pause, group and update, each weightSync.timeoutSeconds + 10 s), then
    collecting or evaluating (a generation retried once elsewhere: twice
    rollout.requestTimeoutSeconds), plus CONTROL_SLACK_SECONDS. A rank 0 that fails ends
    the wait at once (its peers see its connections close); this bound is for one that
    hangs."""
    sync_s = 2 * 3 * (spec.weight_sync.timeout_seconds + 10)
    collect_s = 2 * spec.rollout.request_timeout_seconds
    return ports.ROLLOUT_STARTUP_SECONDS + sync_s + collect_s + CONTROL_SLACK_SECONDS


DEFAULT_CONTROL_TIMEOUT_S = 4 * 3600.0  # Ranks() without a spec (tests, benches)
DATA_TIMEOUT_FLOOR_SECONDS = 600.0  # DeepSpeed's own default (deepspeed/constants.py)


def data_timeout_s(spec: GSPOJobSpec) -> float:
    """The default group's timeout (NCCL's watchdog on GPUs). Every rank works at once there,
    but for a weight sync's and an export's gathers: the other ranks wait in the next layer's
    gather while rank 0 sends a bucket to the servers (each wait bounded by
    weightSync.timeoutSeconds, after which rank 0 gives the pass up and gathers the rest) or
    writes a layer to disk. DeepSpeed's 10 minutes, or that bound plus CONTROL_SLACK_SECONDS
    when it is longer."""
    return max(DATA_TIMEOUT_FLOOR_SECONDS, spec.weight_sync.timeout_seconds + CONTROL_SLACK_SECONDS)


class Ranks:
    def __init__(self, control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> None:
        import torch
        import torch.distributed as dist

        from gspo_trainer.device import rank_device

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = rank_device()  # this rank's GPU (or the CPU): the data's device
        self.control_timeout_s = control_timeout_s
        self.group: Any = None  # the control group: gloo, every rank of the learner
        if self.world > 1:
            self.group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=control_timeout_s)
            )
        self._cpu = torch.device("cpu")

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
        box = torch.tensor([float(value)], device=self._cpu)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return int(box.item())

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (what other ranks pass is ignored)."""
        import torch.distributed as dist

        if self.world == 1:
            return obj
        box: list[Any] = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group, device=self._cpu)
        return box[0]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
        import torch.distributed as dist

        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

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
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self._cpu)
        dist.all_reduce(
            vec, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group
        )
        return {k: float(v) for k, v in zip(keys, vec.tolist(), strict=True)}

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier(group=self.group)
