"""The learner on a CUDA device: the batch, the loss inputs, the reference model and the
rank collectives on the engine's GPU. Skipped where no GPU is (this suite's CPU machine);
`pytest -m gpu tests/trainer` on a GPU machine runs them."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from learner_helpers import make_learner, params, tiny_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize(("stage", "dtype"), [(1, "float32"), (3, "bfloat16")])
def test_a_step_on_the_gpu_updates_the_policy(cache: Path, stage: int, dtype: str) -> None:
    manifest = tiny_spec(miniBatches=2, klCoef=0.01, maxStaleness=1)
    manifest["spec"]["model"]["dtype"] = dtype
    manifest["spec"]["learner"].update(zeroStage=stage, microBatchTokens=64)
    learner = make_learner(cache, None, manifest)
    assert learner.policy.device.type == "cuda"
    assert next(learner.policy.reference.parameters()).device == learner.policy.device
    before = params(learner)
    asyncio.run(learner.sync(0))
    for step in (1, 2):
        stats = asyncio.run(learner.train_step(step))
        for key in ("loss", "grad_norm", "kl", "importance_weight_mean", "entropy"):
            assert math.isfinite(stats[key]), key
    after = params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before)
