"""ZeRO-3 loading a layer at a time (zero3_load): rank 0 reads one group of keys at a time and
the other ranks read no weight, where transformers alone reads the whole checkpoint on every
rank. The loaded values are checked in test_zero3_loading.py; the memory in
bench/bench_zero3_load_memory.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gspo_trainer import zero3_load


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Qwen3-MoE saved as transformers 5 saves it (each expert's tensors apart)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    path = tmp_path_factory.mktemp("moe") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path / "model.safetensors"


def test_keys_group_by_decoder_layer() -> None:
    keys = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.10.mlp.gate.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert zero3_load.group_keys(keys) == [
        ["model.embed_tokens.weight"],
        keys[1:3],
        [keys[3]],
        [keys[4]],
        ["model.norm.weight"],
        ["lm_head.weight"],
    ]


def _fill_calls(checkpoint: Path, rank: int, monkeypatch) -> list[dict[str, Any]]:
    """fill_by_group as `rank` sees it, each call of transformers' fill recorded."""
    from transformers.modeling_utils import load_state_dict

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    shapes = load_state_dict(str(checkpoint), map_location="meta")
    files = dict.fromkeys(shapes, str(checkpoint))
    calls: list[dict[str, Any]] = []

    def fill(model: Any, part: dict[str, Any], load_config: Any) -> tuple[list[str], set[str]]:
        calls.append(part)
        return [], set(shapes) - set(part)

    errors, missing = zero3_load.fill_by_group(torch.nn.Module(), shapes, files, None, fill)
    assert errors == [] and missing == set()
    return calls


def test_rank_0_reads_one_layer_at_a_time(checkpoint: Path, monkeypatch) -> None:
    from safetensors.torch import load_file

    whole = load_file(str(checkpoint))
    calls = _fill_calls(checkpoint, 0, monkeypatch)
    assert len(calls) == 3 + 3  # three layers; embeddings, final norm, head
    seen = [k for part in calls for k in part]
    assert sorted(seen) == sorted(whole)  # every key once
    for part in calls:
        for key, value in part.items():
            assert value.device.type == "cpu" and torch.equal(value, whole[key]), key
    total = sum(t.nbytes for t in whole.values())
    largest = max(sum(t.nbytes for t in part.values()) for part in calls)
    assert largest < total / 2


def test_other_ranks_read_no_weight(checkpoint: Path, monkeypatch) -> None:
    calls = _fill_calls(checkpoint, 1, monkeypatch)
    assert len(calls) == 6
    assert all(value.device.type == "meta" for part in calls for value in part.values())


def test_from_pretrained_goes_through_the_groups(checkpoint: Path, monkeypatch) -> None:
    """The learner's ZeRO-3 load (engine._from_pretrained) fills group by group, and the
    functions it replaced in transformers are back afterwards."""
    from transformers import modeling_utils as mu

    from gspo_api.validation import parse_spec
    from gspo_trainer import engine as eng
    from gspo_trainer.jobs import tiny_manifest

    before = (mu.load_state_dict, mu._load_state_dict_into_zero3_model)
    groups: list[list[str]] = []
    real = zero3_load.fill_by_group

    def spy(model: Any, shapes: dict[str, Any], *args: Any) -> Any:
        groups.extend(zero3_load.group_keys(list(shapes)))
        return real(model, shapes, *args)

    monkeypatch.setattr(zero3_load, "fill_by_group", spy)
    manifest = tiny_manifest()
    manifest["spec"]["learner"]["zeroStage"] = 3
    spec = parse_spec(manifest["spec"])
    model = eng._from_pretrained(spec, str(checkpoint.parent), shard=True)
    assert len(groups) == 6
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    assert (mu.load_state_dict, mu._load_state_dict_into_zero3_model) == before
