"""algorithm.warmupSteps counts training steps and the first update already moves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from learner_helpers import make_learner, tiny_spec

from gspo_trainer.engine import warmup_factor


def test_the_factor_rises_linearly_from_the_first_update() -> None:
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0  # no warm-up


def test_a_learner_warms_up_over_training_steps(tmp_path: Path) -> None:
    """warmupSteps 2 with 2 mini-batches: 4 updates of warm-up, the first at lr / 4."""
    lr = 1e-3
    manifest = tiny_spec(warmupSteps=2, miniBatches=2, learningRate=lr)
    learner = make_learner(tmp_path / "models", None, manifest)

    def current() -> float:
        return learner.engine.optimizer.param_groups[0]["lr"]

    assert current() == pytest.approx(lr / 4)  # what the first update will use
    asyncio.run(learner.sync(0))
    asyncio.run(learner.train_step(1))  # two updates: lr/4, lr/2
    assert current() == pytest.approx(lr * 3 / 4)
    asyncio.run(learner.train_step(2))  # 3/4, then the full lr
    assert current() == pytest.approx(lr)
