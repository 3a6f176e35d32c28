"""Atomic checkpoints: written aside, listed with checksums, renamed, then pruned to the last K.

Layout under the checkpoint directory:

    step-000120/             a complete checkpoint (never a partial one)
        engine/              DeepSpeed's model, optimizer and scheduler state (every rank)
        trainer-rank0.pt     step, data position, RNG states (one file per rank)
        manifest.json        every file with its size, sha256 and the rank that wrote it,
                             written last
    step-000130.tmp/         one being written; ignored, removed by the next save
    latest                   name of the newest complete checkpoint
    export/                  the final policy as HF safetensors (model + tokenizer), written
                             a layer at a time (see export_hf)

Each rank hashes the files it wrote as soon as it has written them, all ranks at once
(`save_state` returns them: a 30B model's ZeRO-3 checkpoint is ~360 GB, far too much for one
rank to hash while the others wait); rank 0's `commit` writes the manifest from those
entries. Resume takes the newest `step-*` directory whose files all match the sizes and
checksums in its manifest; each rank checks its own share (`verify(..., rank, world)`), and
a damaged one is passed over, with a log line naming it and its bad files, for the one
before (`newest_intact` for one process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STEP_DIR = re.compile(r"^step-(\d{6,})$")
MANIFEST = "manifest.json"
ENGINE_TAG = "engine"

log = logging.getLogger("gspo.checkpoint")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Entry = dict[str, Any]  # one file of a manifest: {"bytes", "sha256", "rank"}
HASH_THREADS = 8  # hashlib lets go of the GIL: files are hashed in parallel threads


def hash_files(ckpt: Path, rels: list[str], rank: int) -> dict[str, Entry]:
    """Each file (relative to `ckpt`) synced to disk and its manifest entry, written by
    `rank`; in parallel threads."""
    from concurrent.futures import ThreadPoolExecutor

    def entry(rel: str) -> Entry:
        path = ckpt / rel
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path), "rank": rank}

    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(rels)))) as pool:
        return dict(zip(rels, pool.map(entry, rels), strict=True))


def write_manifest(ckpt: Path, step: int, hashed: dict[str, Entry] | None = None) -> dict[str, Any]:
    """The manifest of `ckpt`: the entries the ranks `hashed` as they wrote, and any other
    file there hashed now (as rank 0's)."""
    hashed = dict(hashed or {})
    rest = sorted(
        p.relative_to(ckpt).as_posix()
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )
    hashed.update(hash_files(ckpt, [rel for rel in rest if rel not in hashed], 0))
    missing = sorted(rel for rel in hashed if rel not in rest)
    if missing:
        raise FileNotFoundError(f"checkpoint {ckpt}: files a rank wrote are gone: {missing[:5]}")
    manifest = {"step": step, "files": {rel: hashed[rel] for rel in rest}}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.rename(tmp, ckpt / MANIFEST)
    return manifest


def is_complete(ckpt: Path) -> bool:
    """Manifest present and every listed file there with its size (cheap; no hashing)."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        return all(
            (ckpt / rel).stat().st_size == meta["bytes"] for rel, meta in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError):
        return False


def owner(meta: Entry, index: int, world: int) -> int:
    """The rank that verifies a manifest's `index`-th file on resume: the one that wrote it
    (the same rank of a group of another size: modulo), or spread by index when the
    manifest does not say."""
    return int(meta.get("rank", index)) % world


def verify(ckpt: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Files of `rank`'s share (`owner`; all of them for one process) whose size or checksum
    differs from the manifest, or that are gone (empty: intact). Files are hashed in
    parallel threads (hashlib lets go of the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        listed = json.loads((ckpt / MANIFEST).read_text())["files"]
        files = {
            rel: meta
            for i, (rel, meta) in enumerate(listed.items())
            if owner(meta, i, world) == rank
        }
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return [MANIFEST]

    def damaged(item: tuple[str, dict[str, Any]]) -> bool:
        path = ckpt / item[0]
        try:  # a file that cannot be read is damaged too: the ranks agree on it
            return path.stat().st_size != item[1]["bytes"] or sha256_file(path) != item[1]["sha256"]
        except OSError:
            return True

    with ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:
        flags = list(pool.map(damaged, files.items()))
    return [rel for rel, bad in zip(files, flags, strict=True) if bad]


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint directory, oldest first, intact or not."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (all files there, sizes right), oldest first."""
    return [(step, path) for step, path in list_steps(root) if is_complete(path)]


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint whose files all match its manifest's sizes and checksums; each
    newer one that does not is logged (naming it and its bad files) and passed over."""
    for _, path in reversed(list_steps(root)):
        bad = verify(path)
        if not bad:
            return path
        log.warning(
            "Checkpoint %s failed verification (%s); skipped for the previous one",
            path,
            ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""),
        )
    return None


def latest(root: Path) -> Path | None:
    done = list_complete(root)
    return done[-1][1] if done else None


def aside(root: Path, step: int) -> Path:
    """The directory `step` is written into before `commit` renames it into place."""
    return root / f"{step_name(step)}.tmp"


def clear_stale(root: Path) -> None:
    """Remove aside copies left by failed or killed writes; best effort, never raises."""
    try:
        children = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        return
    for child in children:
        if child.name.endswith(".tmp") and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def commit(root: Path, step: int, keep: int, hashed: dict[str, Entry] | None = None) -> Path:
    """Rank 0, after every rank wrote into the aside directory (and hashed what it wrote:
    `hashed`): manifest, rename, prune."""
    tmp = aside(root, step)
    final = root / step_name(step)
    write_manifest(tmp, step, hashed)
    _fsync_dir(tmp)
    if final.exists():  # a re-run of the same step (resumed at it): replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name + "\n")
    os.rename(pointer, root / "latest")
    for _, old in list_complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --- the learner's state -------------------------------------------------------------


class _WritesRecorded:
    """Stands in for DeepSpeed's checkpoint engine during one save: a write that fails
    (disk full, I/O error) is recorded and the save goes on without writing more, so this
    rank still joins every collective `save_checkpoint` runs; a rank that left it part-way
    would leave the others waiting in a barrier, or pair their barrier with its next
    collective."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.error: BaseException | None = None
        self.written: list[str] = []  # paths this rank saved

    def save(self, state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.error is None:
            self.written.append(str(path))
        return self._guarded("save", state_dict, path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _guarded(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None:
            return None
        try:
            return getattr(self.inner, method)(*args, **kwargs)
        except Exception as exc:  # re-raised once the collectives are done
            self.error = exc
            return None

    def makedirs(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded("makedirs", *args, **kwargs)


def save_state(
    engine: Any, tmp: Path, rank: int, trainer_state: dict[str, Any]
) -> dict[str, Entry]:
    """Every rank: DeepSpeed's shards, and this rank's trainer state (RNG, data, step); then
    the manifest entries of the files this rank wrote, hashed here (every rank hashes its
    own at once). A failed write raises only after DeepSpeed's save has run its course on
    this rank."""
    import torch

    recorder = _WritesRecorded(engine.checkpoint_engine)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        recorder.error = exc
    engine.checkpoint_engine = recorder
    try:
        engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, save_latest=False)
    finally:
        engine.checkpoint_engine = recorder.inner
    if recorder.error is not None:
        raise recorder.error
    mine = tmp / f"trainer-rank{rank}.pt"
    torch.save(trainer_state, mine)
    rels = {
        Path(p).resolve().relative_to(tmp.resolve()).as_posix()
        for p in [*recorder.written, str(mine)]
    }
    return hash_files(tmp, sorted(rels), rank)


def load_state(engine: Any, ckpt: Path, rank: int) -> tuple[dict[str, Any], int | None]:
    """The engine loaded from `ckpt`, and this rank's trainer state and the lr schedule's
    position (the optimizer updates it counted), None when the checkpoint holds none: one an
    earlier release wrote under a constant rate, for which DeepSpeed would hand
    LambdaLR.load_state_dict that None (engine.resumed_updates says what is used then)."""
    import torch

    scheduler, found = engine.lr_scheduler, [True]
    load_schedule = scheduler.load_state_dict

    def load_position(state: dict[str, Any] | None) -> None:
        if state is None:
            found[0] = False
        else:
            load_schedule(state)

    scheduler.load_state_dict = load_position
    try:
        path, _ = engine.load_checkpoint(
            str(ckpt), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    finally:
        del scheduler.load_state_dict  # the class's own again
    if path is None:
        raise RuntimeError(f"checkpoint {ckpt}: DeepSpeed could not load {ENGINE_TAG}/")
    state = torch.load(ckpt / f"trainer-rank{rank}.pt", weights_only=False)
    return state, int(scheduler.last_epoch) if found[0] else None


def rng_state() -> dict[str, Any]:
    """This rank's random states: Python's, NumPy's, torch's CPU one and, on a GPU, that of
    its own device only (asking for every GPU's would open a CUDA context on each of them
    from every rank of the pod)."""
    import random

    import numpy as np
    import torch

    from gspo_trainer.device import rank_device

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    device = rank_device()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Back to `rng_state()`'s states; a GPU's on this rank's device (a checkpoint that kept
    every GPU's, as a list, gives this device's)."""
    import random

    import numpy as np
    import torch

    from gspo_trainer.device import rank_device

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    device = rank_device()
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):
        cuda = cuda[device.index] if device.index is not None and device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


SAFE_WEIGHTS = "model.safetensors"
SAFE_SHARD = "model-{:05d}-of-{:05d}.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def export_hf(
    layers: Iterable[list[tuple[str, Any]]], model: Any, tokenizer: Any, out: Path, shard_bytes: int
) -> Path:
    """Save the policy as an HF directory, written aside then renamed: safetensors shards of
    at most `shard_bytes` (one shard = `model.safetensors`, else `model-0000k-of-0000n` with
    `model.safetensors.index.json`, as save_pretrained names them), config, generation
    config, tokenizer.

    `layers` hands the weights over a layer at a time (a ParamStream: gathered under ZeRO-3);
    each layer is renamed to its checkpoint names by transformers' own
    `revert_weight_conversion` (what save_pretrained does: per-expert tensors of a fused MoE
    layer), copied into the shard, and let go. Extra memory: one shard and one layer.
    """
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    if shard_bytes <= 0:
        raise ValueError(f"shard size must be positive, got {shard_bytes} bytes")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        parts: list[list[str]] = []  # tensor names, shard by shard
        shard: dict[str, Any] = {}
        used = total = 0

        def flush() -> None:
            nonlocal shard, used
            if shard:
                parts.append(list(shard))
                save_file(shard, str(tmp / f"part-{len(parts):05d}"), metadata={"format": "pt"})
                shard, used = {}, 0

        for layer in layers:
            state = revert_weight_conversion(model, dict(layer))
            del layer
            while state:
                name, t = state.popitem()
                nbytes = t.numel() * t.element_size()
                if shard and used + nbytes > shard_bytes:
                    flush()
                # A copy of its own, contiguous: the layer's memory goes back when the stream
                # moves on (no reference may outlive it), and safetensors refuses views into
                # one tensor.
                shard[name] = t.detach().to("cpu", copy=True).contiguous()
                del t
                used += nbytes
                total += nbytes
        flush()
        _name_shards(tmp, parts, total)
        # What save_pretrained records beside the weights.
        model.config.dtype = str(model.dtype).removeprefix("torch.")
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back
        raise
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _name_shards(directory: Path, parts: list[list[str]], total_bytes: int) -> None:
    """Give the written parts save_pretrained's names, with an index when there are several."""
    if len(parts) == 1:
        os.rename(directory / "part-00001", directory / SAFE_WEIGHTS)
        return
    weight_map = {}
    for k, names in enumerate(parts, 1):
        final = SAFE_SHARD.format(k, len(parts))
        os.rename(directory / f"part-{k:05d}", directory / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
