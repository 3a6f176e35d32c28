"""What the learner checks before any work: the parts of a spec only the machine it runs on
can judge (files, imports, hardware).

`validation` judges a spec on its own and runs everywhere (`gspo validate`, the operator);
these checks need the model, the data and the GPUs, so they run where the learner starts,
before it loads a model, opens a port or touches a checkpoint. Every problem names the spec
field and the fix, like validation's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import Problem
from gspo_trainer.code.preflight import check_code_reward


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def check_model(spec: GSPOJobSpec) -> list[Problem]:
    name = spec.model.name
    if name.startswith("builtin:"):
        return []
    if _looks_like_path(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            return [
                Problem(
                    "spec.model.name",
                    f"{name!r} does not exist; give a local model "
                    "directory (with config.json) or a Hugging Face model id",
                )
            ]
        if not (path / "config.json").is_file():
            return [
                Problem(
                    "spec.model.name",
                    f"{name!r} has no config.json; point it at the directory save_pretrained wrote",
                )
            ]
        return []
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(
            name, revision=spec.model.revision, trust_remote_code=spec.model.trust_remote_code
        )
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "give a local model directory or a model id this node can download"
        return [Problem("spec.model.name", f"cannot load the config of {name!r} ({first}); {hint}")]
    return []


def check_reward(spec: GSPOJobSpec) -> list[Problem]:
    """reward.function, or every python component of reward.functions, imports."""
    from gspo_trainer.rewards import load_function, reward_function

    reward, problems = spec.reward, []
    try:
        # code: check_code_reward; positional: built in, nothing to import
        if reward.functions is None and reward.kind not in ("code", "positional"):
            reward_function(reward)
    except ValueError as exc:
        problems.append(Problem("spec.reward.function", str(exc).removeprefix("reward.function ")))
    for i, f in enumerate(reward.functions or []):
        if f.kind != "python":
            continue
        try:
            load_function(f.function or "")
        except ValueError as exc:
            message = str(exc).removeprefix("reward.function ")
            problems.append(Problem(f"spec.reward.functions[{i}].function", message))
    return problems


def check_data(spec: GSPOJobSpec) -> list[Problem]:
    """Rows are read and checked as the learner will (templates are applied later, with the
    model's tokenizer): the training set, and the held-out evaluation set if one is named
    (found missing only at the first evaluation, it would end a run hours in). A Hub data
    set is downloaded here, once, into the cache the learner then reads."""
    from gspo_trainer.data import DataError, load_eval_examples, load_examples

    sets: list[tuple[str, Callable[[], object]]] = [
        ("spec.data.source", lambda: load_examples(spec.data))
    ]
    if spec.data.eval_source:
        sets.append(("spec.data.evalSource", lambda: load_eval_examples(spec.data)))
    for where, load in sets:
        try:
            load()
        except DataError as exc:
            field = f"spec.data.{exc.field}" if exc.field else where
            return [Problem(field, str(exc).removeprefix(where.removeprefix("spec.") + " "))]
        except (ValueError, OSError) as exc:
            return [Problem(where, str(exc).strip().splitlines()[0])]
    return []


def check_hardware(spec: GSPOJobSpec, gpus: int | None = None) -> list[Problem]:
    asked = spec.learner.gpus_per_replica
    if asked == 0:
        return []
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if asked > gpus:
        return [
            Problem(
                "spec.learner.gpusPerReplica",
                f"{asked} GPUs per learner pod asked "
                f"for, but this node has {gpus}; lower it, or run on nodes with "
                f"{asked} GPUs (set 0 to train on CPU)",
            )
        ]
    return []


# model.attnImplementation values that need a package beyond transformers: (module, install)
FLASH_ATTENTION = {
    "flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
    "flash_attention_3": ("flash_attn_interface", "build flash-attn's hopper/ directory"),
}


def check_attention(spec: GSPOJobSpec, cuda: bool | None = None) -> list[Problem]:
    """A flash attention kernel named in model.attnImplementation is installed, and there is
    a GPU to run it (`cuda`: whether one is; None: ask torch)."""
    import importlib.util

    impl = spec.model.attn_implementation
    if impl not in FLASH_ATTENTION:
        return []
    module, install = FLASH_ATTENTION[impl]
    field = "spec.model.attnImplementation"
    if importlib.util.find_spec(module) is None:
        return [
            Problem(
                field,
                f"{impl} needs the {module} package, which this learner's "
                f"image lacks; install it ({install}) or use sdpa",
            )
        ]
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        return [
            Problem(
                field,
                f"{impl} runs only on CUDA GPUs and this learner has none "
                "(learner.gpusPerReplica 0?); use sdpa",
            )
        ]
    return []


def preflight(spec: GSPOJobSpec, gpus: int | None = None) -> list[Problem]:
    """Every problem at once, cheapest first (`gpus`: this node's count; None: ask torch)."""
    return [
        *check_hardware(spec, gpus),
        *check_attention(spec),
        *check_reward(spec),
        *check_model(spec),
        *check_data(spec),
        *(Problem(field, message) for field, message in check_code_reward(spec)),
    ]
