"""A Hub model is downloaded by every rank before the load's first collective, and the ranks
meet on the control group (gloo, its long timeout) once they all have it: a slow download
never keeps a peer waiting on the default group, whose watchdog (NCCL's) would end it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants
from learner_helpers import tiny_spec

from gspo_api.validation import parse_spec
from gspo_trainer import engine


def spec_of(name: str, revision: str | None = None) -> Any:
    manifest = tiny_spec()
    manifest["spec"]["model"]["name"] = name
    if revision:
        manifest["spec"]["model"]["revision"] = revision
    return parse_spec(manifest["spec"])


def test_a_hub_model_is_fetched_at_its_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        "huggingface_hub.snapshot_download", lambda repo, **kw: calls.append((repo, kw))
    )
    engine.fetch_model(spec_of("Qwen/Qwen3-0.6B", "abc123"), "Qwen/Qwen3-0.6B")
    [(repo, kw)] = calls
    assert repo == "Qwen/Qwen3-0.6B" and kw["revision"] == "abc123"
    assert "*.safetensors" in kw["allow_patterns"] and "*.json" in kw["allow_patterns"]


def test_nothing_is_fetched_locally_offline_or_built_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        "huggingface_hub.snapshot_download", lambda *a, **kw: pytest.fail("downloaded")
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    engine.fetch_model(spec_of("Qwen/Qwen3-0.6B"), str(tmp_path))  # a local directory
    engine.fetch_model(spec_of("/models/absent"), "/models/absent")  # a path, not a repo
    engine.fetch_model(spec_of("builtin:tiny-qwen3"), "builtin:tiny-qwen3")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    engine.fetch_model(spec_of("Qwen/Qwen3-0.6B"), "Qwen/Qwen3-0.6B")


class _Loaded(Exception):
    pass


def test_the_learner_fetches_then_meets_the_ranks_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gspo_trainer.learner import Learner
    from gspo_trainer.ranks import Ranks

    order: list[str] = []
    monkeypatch.setattr(engine, "fetch_model", lambda spec, path: order.append("fetch"))
    monkeypatch.setattr(Ranks, "barrier", lambda self: order.append("barrier"))

    def load(*a: Any, **kw: Any) -> Any:
        order.append("load")
        raise _Loaded

    monkeypatch.setattr(engine, "load_model", load)
    with pytest.raises(_Loaded):
        qwen = "Qwen/Qwen3-0.6B"
        Learner.build(spec_of(qwen), None, checkpoint_dir=None, model_path=qwen)
    assert order == ["fetch", "barrier", "load"]
