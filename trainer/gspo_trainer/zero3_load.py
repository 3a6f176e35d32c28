"""A checkpoint into a ZeRO-3 model one decoder layer at a time, read by rank 0 alone.

transformers 5.19 loads a model built under deepspeed.zero.Init like this
(`PreTrainedModel._load_pretrained_model`, the is_deepspeed_zero3_enabled branch): every rank
reads every checkpoint shard into one merged state dict (`load_state_dict`, map_location
"cpu"), then `integrations.deepspeed._load_state_dict_into_zero3_model` applies the weight
conversions (Qwen3-MoE: each layer's per-expert tensors stacked into the fused gate_up_proj and
down_proj, a second copy of every expert) and fills module after module under
GatheredParameters, on rank 0 only. So every rank holds the whole model in host memory, and
the experts twice, though only rank 0 ever reads a weight (transformers issues 47514, 43257):
~57 GB a rank for Qwen3-30B-A3B, eight ranks a pod, and again for the KL reference.

While `streamed()` is open, the same from_pretrained reads shapes only (transformers' own
`load_state_dict` with map_location "meta"), and the fill runs group by group: one decoder
layer's keys (`...layers.<i>.`), or one of the others (embeddings, final norm, head). Each
group goes through transformers' own fill, conversions included, with its tensors read from
the safetensors file on rank 0 and meta tensors of the same shapes on the other ranks (every
rank gathers the same parameters; buffers, which every rank copies, are read everywhere). A
rank's host memory during the load: its partition, one gathered layer, and on rank 0 the
group as read and as converted. A checkpoint in another format than safetensors loads as
transformers loads it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def group_keys(keys: list[str]) -> list[list[str]]:
    """The checkpoint's keys in load groups, in file order: one per decoder layer (all of its
    experts together, as the conversions need them), one per other key."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        match = LAYER.match(key)
        groups.setdefault(match.group(1) if match else key, []).append(key)
    return list(groups.values())


@contextlib.contextmanager
def streamed() -> Iterator[None]:
    """While open, transformers' ZeRO-3 from_pretrained loads group by group (module
    docstring). Nothing else in transformers changes; on leaving, its functions are back."""
    from transformers import modeling_utils as mu

    read, fill = mu.load_state_dict, mu._load_state_dict_into_zero3_model
    files: dict[str, str] = {}  # checkpoint key -> its safetensors file

    def shapes_only(checkpoint_file: Any, map_location: Any = "cpu", **kw: Any) -> Any:
        path = str(checkpoint_file)
        if not path.endswith(".safetensors"):
            return read(checkpoint_file, map_location, **kw)
        meta = read(checkpoint_file, "meta", **kw)
        files.update(dict.fromkeys(meta, path))
        return meta

    def by_group(model: Any, state_dict: dict[str, Any], load_config: Any = None) -> Any:
        if not files:
            return fill(model, state_dict, load_config)
        return fill_by_group(model, state_dict, files, load_config, fill)

    mu.load_state_dict, mu._load_state_dict_into_zero3_model = shapes_only, by_group
    try:
        yield
    finally:
        mu.load_state_dict, mu._load_state_dict_into_zero3_model = read, fill


def fill_by_group(
    model: Any,
    shapes: dict[str, Any],
    files: dict[str, str],
    load_config: Any,
    fill: Callable[..., tuple[list[str], set[str]]],
) -> tuple[list[str], set[str]]:
    """transformers' ZeRO-3 fill, once per group of keys; (error messages, missing keys) as
    one call over the whole state dict would return them."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    buffers = _buffer_keys(model)
    errors: list[str] = []
    missing: set[str] | None = None
    for keys in group_keys(list(shapes)):
        real = keys if rank == 0 else [k for k in keys if k in buffers]
        part = {k: shapes[k] for k in keys} | _read(real, files, shapes)
        found, lacking = fill(model, part, load_config)
        errors += found
        missing = set(lacking) if missing is None else missing & set(lacking)
        del part
    return errors, missing or set()


def _buffer_keys(model: Any) -> set[str]:
    """Buffer names as a checkpoint may write them: with and without the base model prefix."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    names = {name for name, _ in model.named_buffers()}
    return names | {n.removeprefix(prefix) for n in names}


def _read(keys: list[str], files: dict[str, str], shapes: dict[str, Any]) -> dict[str, Any]:
    """`keys` read from their safetensors files, each file opened only for this group (its
    mapping is let go with it, so the pages read do not stay in this process)."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    by_file: dict[str, list[str]] = {}
    for key in keys:
        if key in files:
            by_file.setdefault(files[key], []).append(key)
        else:
            out[key] = shapes[key]
    for path, wanted in by_file.items():
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in wanted})
    return out
