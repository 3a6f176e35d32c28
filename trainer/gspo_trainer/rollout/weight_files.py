"""Weight sync through a shared volume (`weightSync.method: filesystem`).

For clusters where the rollout servers cannot join a collective group with learner rank 0
(different networks, no NCCL between them): rank 0 writes each policy version as safetensors
shards into a directory of the volume, and each server, told the version's directory name,
loads it through the same in-place reload a broadcast uses. Slower than a broadcast (the
whole model goes through the volume every sync), but only HTTP crosses between the pods.

A version is written aside and renamed, so a server never sees half of one; only the
newest is kept. Shards are at most `shard_bytes` (the bucket size), which also bounds the
extra memory rank 0 needs to copy the tensors out.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_trainer.rollout.weight_sync import reading

if TYPE_CHECKING:
    import torch

NAME = re.compile(r"^v\d{8}$")
SHARD = "model-{:05d}.safetensors"


def version_name(version: int) -> str:
    return f"v{version:08d}"


def write_version(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    root: Path,
    version: int,
    shard_bytes: int,
) -> tuple[Path, int]:
    """Write one version under `root`; returns its directory and its bytes."""
    from safetensors.torch import save_file

    if shard_bytes <= 0:
        raise ValueError(f"shard size must be positive, got {shard_bytes} bytes")
    final = root / version_name(version)
    tmp = root / (final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    used = total = shards = 0

    def flush() -> None:
        nonlocal shard, used, shards
        if shard:
            shards += 1
            save_file(
                shard, str(tmp / SHARD.format(shards)), metadata={"policy_version": str(version)}
            )
            shard, used = {}, 0

    # Closed however the writing ends: a failed write ends the stream's pass now, not when
    # the error is let go.
    with reading(named_tensors) as tensors:
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if shard and used + nbytes > shard_bytes:
                flush()
            # A copy of its own: checkpoint names may be views into one fused tensor, which
            # safetensors refuses to write as separate entries; and a streamed layer
            # (ParamStream) is let go once the next one is asked for.
            shard[name] = t.detach().to("cpu", copy=True).contiguous()
            del t  # not held while the next layer is gathered
            used += nbytes
            total += nbytes
        flush()
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in root.iterdir():
        if old != final and NAME.match(old.name.removesuffix(".tmp")):
            shutil.rmtree(old, ignore_errors=True)
    return final, total


def resolve(root: Path, name: object) -> Path:
    """The version directory `name` under `root` (as a request sent it); ValueError for anything
    else."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"name must be a version directory like {version_name(7)!r}, got {name!r}")
    path = root / name
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{path} holds no safetensors: is the learner's checkpoint volume "
            "mounted here at the same path?"
        )
    return path


def read_version(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a version, shard by shard (one shard in memory at a time)."""
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)
