"""Start-up checks of what the spec points at: data, reward function, model path, hardware.

`validation` checks the spec's shape; these check the world it names, before the learner
loads a model or starts a process group, so a bad input is refused in a second with the
field named (`gspo learner` exits 2) instead of failing minutes later mid-run.
"""

from __future__ import annotations

import os
from pathlib import Path

from gspo_trainer.config import GSPOJobSpec
from gspo_trainer.validation import Problem

_PATH_PREFIXES = ("/", "./", "../", "~")


def check_data(spec: GSPOJobSpec, prefix: str = "spec") -> list[Problem]:
    from gspo_trainer.data import BUILTIN_ADDITION, read_rows

    cfg = spec.data
    if cfg.source.startswith("builtin:"):
        if cfg.source != BUILTIN_ADDITION:
            why = f"{cfg.source!r} is not a built-in task; use {BUILTIN_ADDITION}"
            return [Problem(f"{prefix}.data.source", why)]
        return []
    if not Path(cfg.source).expanduser().exists():
        return [Problem(f"{prefix}.data.source", f"{cfg.source!r} does not exist")]
    try:
        rows = read_rows(cfg)
    except (OSError, ValueError) as exc:
        return [Problem(f"{prefix}.data.source", f"cannot read {cfg.source!r}: {exc}")]
    if not rows:
        return [Problem(f"{prefix}.data.source", f"{cfg.source!r} holds no rows")]
    out = []
    for field, key in (("promptField", cfg.prompt_field), ("answerField", cfg.answer_field)):
        missing = [i for i, row in enumerate(rows) if not isinstance(row, dict) or key not in row]
        if missing:
            first = rows[missing[0]]
            fields = sorted(first) if isinstance(first, dict) else type(first).__name__
            out.append(Problem(
                f"{prefix}.data.{field}",
                f"{len(missing)} of {len(rows)} rows of {cfg.source!r} have no field {key!r} "
                f"(row {missing[0]} has {fields}); name the right field",
            ))  # fmt: skip
    return out


def check_reward(spec: GSPOJobSpec, prefix: str = "spec") -> list[Problem]:
    from gspo_trainer.rewards import load_function

    cfg = spec.reward
    if cfg.kind != "python":
        return []
    if not cfg.function:
        return [Problem(f"{prefix}.reward.function", "set 'module:function' for kind python")]
    try:
        load_function(cfg.function)
    except ValueError as exc:
        return [Problem(f"{prefix}.reward.function", str(exc).split(": ", 1)[-1])]
    return []


def _looks_like_path(name: str) -> bool:
    return name.startswith(_PATH_PREFIXES) or (os.sep in name and Path(name).exists())


def check_model(spec: GSPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """A local path must exist and hold an HF config; hub names are left to the loader."""
    out = []
    for field, name in (("name", spec.model.name), ("tokenizer", spec.model.tokenizer)):
        if not name or name.startswith("builtin:") or not _looks_like_path(name):
            continue
        path = Path(name).expanduser()
        if not path.exists():
            out.append(Problem(f"{prefix}.model.{field}", f"{name!r} does not exist"))
        elif field == "name" and path.is_dir() and not (path / "config.json").is_file():
            why = f"{name!r} has no config.json: not an HF model directory"
            out.append(Problem(f"{prefix}.model.name", why))
    return out


def check_hardware(spec: GSPOJobSpec, gpus: int, prefix: str = "spec") -> list[Problem]:
    asked = spec.learner.gpus_per_replica
    if asked > gpus:
        return [Problem(
            f"{prefix}.learner.gpusPerReplica",
            f"asks for {asked} GPUs per learner, this machine has {gpus}; lower it (0 runs on CPU)",
        )]  # fmt: skip
    return []


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def preflight(spec: GSPOJobSpec, gpus: int | None = None, prefix: str = "spec") -> list[Problem]:
    """Every problem found, in spec order (empty: the learner may start)."""
    return [
        *check_model(spec, prefix),
        *check_data(spec, prefix),
        *check_reward(spec, prefix),
        *check_hardware(spec, visible_gpus() if gpus is None else gpus, prefix),
    ]
