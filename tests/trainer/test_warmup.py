"""algorithm.warmupSteps counts training steps and the first update already moves; after it,
algorithm.lrSchedule (constant, linear, cosine) runs over the training steps left."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest
from learner_helpers import make_learner, tiny_spec

from gspo_trainer.engine import lr_factor


def test_the_factor_rises_linearly_from_the_first_update() -> None:
    assert [lr_factor(k, 4, 100) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 0, 100) == 1.0  # no warm-up


def test_linear_and_cosine_decay_over_the_updates_left_after_warm_up() -> None:
    # 2 warm-up updates, 10 in all: 8 decay from 1 (update 2) toward 0 (after update 9).
    linear = [lr_factor(k, 2, 10, "linear") for k in range(10)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    cosine = [lr_factor(k, 2, 10, "cosine") for k in range(10)]
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cosine[6] == pytest.approx(0.5)  # half-way through the decay
    assert all(a > b for a, b in itertools.pairwise(cosine[2:]))
    assert cosine[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_factor(20, 2, 10, "linear") == 0.0  # past maxSteps (resumed longer): stays 0
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        lr_factor(5, 2, 10, "step")


def test_a_learner_follows_the_cosine_schedule_in_training_steps(tmp_path: Path) -> None:
    lr = 1e-3
    manifest = tiny_spec(lrSchedule="cosine", maxSteps=2, miniBatches=2, learningRate=lr)
    learner = make_learner(tmp_path / "models", None, manifest)
    rates = []
    asyncio.run(learner.sync(0))
    for step in (1, 2):
        rates.append(learner.engine.optimizer.param_groups[0]["lr"])
        asyncio.run(learner.train_step(step))
    # 4 updates, no warm-up: steps 1 and 2 start at updates 0 and 2 of the decay.
    assert rates == pytest.approx([lr, lr * 0.5 * (1 + math.cos(math.pi / 2))])


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
