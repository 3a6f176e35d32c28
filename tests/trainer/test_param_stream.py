"""The policy a layer at a time (ParamStream), as a weight sync and an HF export read it:
under ZeRO-3 never more than one layer gathered, the same tensors as the whole model, and a
pass left early still taken part in by every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkout import checkout_env
from learner_helpers import staged_spec

from gspo_trainer import checkpoint as ckpt
from gspo_trainer.engine import build_engine, load_model, resolve_model_path
from gspo_trainer.param_stream import ParamStream, group_key
from gspo_trainer.ranks import Ranks
from gspo_trainer.rollout.weight_sync import CheckpointNamed, checkpoint_named_tensors

WORKER = Path(__file__).with_name("param_stream_worker.py")


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """A ZeRO-3 engine on the tiny MoE, its tokenizer, and the weights it started from."""
    spec = staged_spec(3)
    path = resolve_model_path(spec, str(tmp_path_factory.mktemp("models")))
    model, tok = load_model(spec, path)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return build_engine(spec, model), tok, start


def gathered(module: Any) -> set[str]:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return {n for n, p in module.named_parameters() if p.ds_status == ZeroParamStatus.AVAILABLE}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("model.layers.7.mlp.experts.gate_up_proj", "model.layers.7"),
        ("model.layers.12.self_attn.q_proj.weight", "model.layers.12"),
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_parameters_are_gathered_with_their_layer(name: str, key: str) -> None:
    assert group_key(name) == key


def test_a_pass_gathers_one_layer_at_a_time_and_gives_the_whole_model(zero3) -> None:  # type: ignore[no-untyped-def]
    engine, _, start = zero3
    module = engine.module
    stream = ParamStream.of(engine, Ranks())
    assert stream.zero3 and not gathered(module)
    # Names, full shapes and dtypes without gathering anything (the sender plans on them).
    assert [(n, s) for n, s, _ in stream.metas()] == [(n, tuple(t.shape)) for n, t in start.items()]
    assert not gathered(module)
    seen = {}
    for name, t in stream:
        held = gathered(module)
        assert held and {group_key(n) for n in held} == {group_key(name)}, held
        seen[name] = t.clone()
    assert not gathered(module)
    assert list(seen) == list(start)
    for name, t in start.items():
        assert torch.equal(seen[name], t), name
    layer = max(
        sum(t.numel() * t.element_size() for n, t in start.items() if group_key(n) == k)
        for k in {group_key(n) for n in start}
    )
    assert stream.largest_group_bytes() == layer
    assert stream.nbytes() == sum(t.numel() * t.element_size() for t in start.values())


def test_a_pass_left_early_lets_its_layer_go(zero3) -> None:  # type: ignore[no-untyped-def]
    engine, _, _ = zero3
    stream = ParamStream.of(engine, Ranks())
    tensors = iter(stream)
    next(tensors), next(tensors)
    assert gathered(engine.module)
    tensors.close()
    assert not gathered(engine.module)


def test_checkpoint_names_are_planned_from_shapes_alone(zero3) -> None:  # type: ignore[no-untyped-def]
    engine, _, start = zero3
    renamed = CheckpointNamed(ParamStream.of(engine, Ranks()))
    expected = [(n, tuple(t.shape), t.dtype) for n, t in checkpoint_named_tensors(start.items())]
    assert any(".experts.0.gate_proj." in n for n, _, _ in expected)
    assert renamed.metas() == expected
    assert [(n, tuple(t.shape), t.dtype) for n, t in renamed] == expected


def test_an_export_in_shards_is_what_save_pretrained_writes(zero3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    engine, tok, start = zero3
    stream = ParamStream.of(engine, Ranks())
    layer = stream.largest_group_bytes()
    out = ckpt.export_hf(stream.layers(), engine.module, tok, tmp_path / "export", layer)
    index = json.loads((out / ckpt.SAFE_INDEX).read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    written = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            written.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        assert shard.stat().st_size <= layer + 64 * 1024  # the header beside one shard's bytes
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in written.values()
    )
    # The same tensors under the same names as transformers' own save_pretrained.
    plain = AutoModelForCausalLM.from_pretrained(out)
    plain.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(written)
        for k in f.keys():  # noqa: SIM118
            assert torch.equal(f.get_tensor(k), written[k]), k
    for name, p in plain.named_parameters():
        assert torch.equal(p, start[name]), name


@pytest.mark.e2e
def test_the_other_rank_gathers_along_with_every_pass_rank_0_makes(tmp_path: Path) -> None:
    """Two ranks, ZeRO-3: rank 0 leaves a pass after two tensors (a sync that lost a server),
    then reads a whole one; rank 1 follows both, and rank 0's tensors are the whole model.
    Then an export fails on rank 0 before its first layer: both ranks end it with the
    export's error, having run the same gathers (the whole-model gather after it agrees)."""
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        str(out),
        str(tmp_path / "models"),
    ]
    env = checkout_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] += f":{WORKER.parent}"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {
        "passes_followed": 2,
        "equal": True,
        "partitioned": True,
        "export_failed_on_both": True,
    }
