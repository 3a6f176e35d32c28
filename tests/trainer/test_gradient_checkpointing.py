"""model.gradientCheckpointing really recomputes: each decoder layer runs again in backward."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gspo_api.validation import parse_spec
from gspo_trainer import engine as eng
from gspo_trainer.jobs import tiny_manifest


@pytest.mark.parametrize("checkpointing", [True, False])
def test_each_layer_runs_again_in_backward_only_with_checkpointing(
    tmp_path: Path, checkpointing: bool
) -> None:
    manifest = copy.deepcopy(tiny_manifest())
    manifest["spec"]["model"].update(
        name="builtin:tiny-qwen3-moe", gradientCheckpointing=checkpointing
    )
    spec = parse_spec(manifest["spec"])
    model, _ = eng.load_model(spec, eng.resolve_model_path(spec, str(tmp_path)))
    engine = eng.build_engine(spec, model)
    assert engine.module.training
    calls: list[int] = []
    layers = engine.module.model.layers
    # Pre-hooks: torch's non-reentrant checkpoint stops a recompute as soon as it has what
    # backward needs, so a layer's forward may never reach its (post-)forward hooks again.
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    out = engine(input_ids=ids)
    assert sorted(calls) == list(range(len(layers)))  # the forward: once each
    engine.backward(out.logits.float().logsumexp(-1).mean())
    expected = 2 if checkpointing else 1
    assert sorted(calls) == sorted(list(range(len(layers))) * expected)
