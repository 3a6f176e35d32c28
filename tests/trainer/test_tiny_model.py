"""The built-in tiny models: every learner rank can build its own copy."""

from __future__ import annotations

import pytest


def test_a_rank_other_than_0_writes_a_whole_model(tmp_path, monkeypatch) -> None:
    """On a cluster each learner pod builds the built-in model on its own disk; transformers
    writes a model only on torch.distributed rank 0, which left rank 1 a directory without a
    config (found by the local cluster: every learner pod but rank 0 failed to start)."""
    mixin = pytest.importorskip("transformers.distributed.mixin")
    from transformers import AutoConfig

    from gspo_trainer.tiny import materialize

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    path = materialize("builtin:tiny-qwen3", tmp_path, seed=0)
    assert AutoConfig.from_pretrained(path).model_type == "qwen3"
    assert (path / "model.safetensors").exists()
