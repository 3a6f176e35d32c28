"""This learner process's device: chosen once, before any CUDA call or collective, and entered
by every thread that touches CUDA.

One learner rank per GPU: torch.distributed.run gives each process LOCAL_RANK, and the
process works on `cuda:LOCAL_RANK` of the GPUs it sees. CUDA keeps the current device per
host thread and a new thread starts on device 0 whatever the main thread set, so ZeRO-3's
gathers and NCCL work started from a thread (the overlapped update, the weight-sync sender
and its group set-up, the filesystem sync) would land on GPU 0: each such thread enters the
rank's device first, through `on_rank_device` (or `in_rank_device`, `to_thread`). Without
CUDA the device is the CPU and entering it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    import torch

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_selected: torch.device | None = None


class DeviceError(RuntimeError):
    """This process cannot have the GPU its LOCAL_RANK names."""


def select_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """Make this process's GPU current (`cuda:LOCAL_RANK`, checked against the GPUs it sees)
    and return it; the CPU without CUDA. The first call decides; later calls return the same
    device (and make it current in the calling thread)."""
    global _selected
    import torch

    with _lock:
        if _selected is None:
            _selected = _choose(os.environ if environ is None else environ)
        device = _selected
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _choose(environ: Mapping[str, str]) -> torch.device:
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    raw = environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise DeviceError(
            f"LOCAL_RANK={raw!r} is not a number: it is this process's "
            "index among the learner processes of its node"
        ) from None
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceError(
            f"learner process LOCAL_RANK={local_rank} needs GPU {local_rank}, but this "
            f"process sees {count} GPU(s){seen}: start at most {count} learner processes "
            "per node (spec.learner.gpusPerReplica), or make the node's GPUs visible"
        )
    return torch.device("cuda", local_rank)


def rank_device() -> torch.device:
    """The device `select_device` chose (choosing it now if nothing has)."""
    return _selected if _selected is not None else select_device()


@contextlib.contextmanager
def on_rank_device() -> Iterator[torch.device]:
    """The calling thread on this rank's device for the block (CUDA's current device is per
    thread; a new one starts on device 0)."""
    yield select_device()


def in_rank_device(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn`, run on this rank's device in whatever thread calls it."""

    @functools.wraps(fn)
    def on_device(*args: P.args, **kwargs: P.kwargs) -> T:
        with on_rank_device():
            return fn(*args, **kwargs)

    return on_device


async def to_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """asyncio.to_thread for work that may touch CUDA: the thread enters the rank's device
    before `fn` runs."""
    return await asyncio.to_thread(in_rank_device(fn), *args, **kwargs)


def forget_selection() -> None:
    """Tests only: the next `select_device` chooses again."""
    global _selected
    with _lock:
        _selected = None
