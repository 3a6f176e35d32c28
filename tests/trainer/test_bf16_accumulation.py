"""Under bf16 the gradient of a mini-batch accumulates in fp32 over its micro-batches (bf16
has 8 bits of mantissa: small micro-batch gradients would vanish into the sum), with every
ZeRO stage the learner offers; DeepSpeed's real optimizers, on CPU."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from learner_helpers import make_learner, tiny_spec


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_gradients_accumulate_in_fp32(cache: Path, stage: int) -> None:
    manifest = tiny_spec(miniBatches=1, maxSteps=1)
    manifest["spec"]["model"]["dtype"] = "bfloat16"
    manifest["spec"]["learner"].update(zeroStage=stage, microBatchTokens=64)  # 2+ micro-batches
    learner = make_learner(cache, None, manifest)
    engine = learner.engine
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    optimizer = engine.optimizer
    if stage == 1:
        assert type(optimizer).__name__ == "BF16_Optimizer"
        assert optimizer.grad_acc_dtype == torch.float32
        assert all(g.dtype == torch.float32 for g in optimizer.fp32_groups_gradients_flat)
    else:  # ZeRO-2 keeps a separate fp32 accumulator; ZeRO-3 fp32 gradient partitions
        assert optimizer.gradient_accumulation_dtype == torch.float32
        assert stage == 3 or optimizer.use_separate_grad_accum
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
