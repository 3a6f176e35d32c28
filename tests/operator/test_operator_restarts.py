"""The operator stopped and restarted 10 times during a job's life duplicates nothing, orphans
nothing, restarts no learner, and the job still reaches Succeeded (see operator_restarts)."""

from __future__ import annotations

import random

import pytest
from operator_restarts import run_trial


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [0, 1])
async def test_ten_operator_restarts_during_a_job(seed: int) -> None:
    trial = await run_trial(random.Random(seed), restarts=10)
    assert trial.restarts == 10
    assert trial.problems == []
    assert (trial.duplicates, trial.orphans, trial.missing, trial.learner_restarts) == (0, 0, 0, 0)
    assert trial.phase == "Succeeded"
