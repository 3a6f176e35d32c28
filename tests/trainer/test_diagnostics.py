"""Diagnostics that need the learner's own extra work run every metrics.diagnosticsEverySteps
on the first mini-batch: the log-prob mismatch and routing drift as the GSPO paper counts
it. With oldLogprobSource engine, the steps between skip the πold forward pass; with learner,
its forward on the first mini-batch, whose πold the update's own forward gives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_helpers import make_learner, tiny_spec

from gspo_trainer.moe import routing_drift


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_drift_is_the_share_of_activated_experts_that_changed_per_layer() -> None:
    old = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [0, 1]])]
    new = [torch.tensor([[0, 2], [2, 3]]), torch.tensor([[2, 3], [0, 1]])]
    # Layer 0: token 0 keeps expert 0, drops 1 (1 of 2); token 1 keeps both: 1 of 4 changed.
    # Layer 1: token 0 changes both, token 1 none: 2 of 4. Order inside a top-k does not count.
    assert routing_drift(old, new) == [0.25, 0.5]
    assert routing_drift([torch.tensor([[1, 0]])], [torch.tensor([[0, 1]])]) == [0.0]
    assert routing_drift(
        [torch.zeros(0, 2, dtype=torch.long)], [torch.zeros(0, 2, dtype=torch.long)]
    ) == [0.0]


def counted(learner: Any) -> list[int]:
    """Count the policy's forward passes (not the reference's) from now on."""
    calls = [0]
    forward = learner.policy.forward

    def count(*args: Any, **kw: Any) -> Any:
        if kw.get("model") is None:
            calls[0] += 1
        return forward(*args, **kw)

    learner.policy.forward = count
    return calls


def run_steps(learner: Any, steps: int) -> list[tuple[dict[str, Any], int]]:
    calls = counted(learner)
    asyncio.run(learner.sync(0))
    out = []
    for step in range(1, steps + 1):
        before = calls[0]
        stats = asyncio.run(learner.train_step(step))
        out.append((stats, calls[0] - before))
    return out


@pytest.mark.parametrize("source", ["learner", "engine"])
def test_diagnostics_run_at_step_one_and_every_n_steps(cache: Path, source: str) -> None:
    manifest = tiny_spec(miniBatches=2, oldLogprobSource=source)
    manifest["spec"]["metrics"]["diagnosticsEverySteps"] = 3
    learner = make_learner(cache, None, manifest)
    steps = run_steps(learner, 4)
    measured = [("routing_drift" in s, "logprob_mismatch" in s) for s, _ in steps]
    if source == "learner":  # its πold forward of the second mini-batch gives it every step
        assert measured == [(True, True), (False, True), (True, True), (False, True)]
    else:
        assert measured == [(True, True), (False, False), (True, True), (False, False)]
    for stats, _ in steps:
        if "routing_drift" in stats:
            assert 0.0 <= stats["routing_drift"] <= 1.0
            assert stats["logprob_mismatch"] < 1e-4  # same weights in the rollout source
    sample = learner.metrics.registry.get_sample_value
    assert sample("gspo_moe_layer_routing_drift", {"layer": "1"}) is not None
    # Forward passes of the policy a step: 2 updates (one a mini-batch); πold adds, between
    # diagnostics, 1 with the learner's recompute (the first mini-batch's is its update's own
    # forward) and none with the engine's; a diagnostics step recomputes the first
    # mini-batch's πold too (the learner's: both) and adds the drift forward.
    forwards = [n for _, n in steps]
    if source == "learner":
        assert forwards == [5, 3, 5, 3]
    else:
        assert forwards == [4, 2, 4, 2]


def test_engine_old_logprobs_train_to_the_same_weights_as_before(cache: Path) -> None:
    """Skipping the forward changes nothing the update sees: πold was the engine's anyway."""
    import copy

    manifest = tiny_spec(miniBatches=2, oldLogprobSource="engine")
    skipping = make_learner(cache, None, manifest)
    every = copy.deepcopy(manifest)
    every["spec"]["metrics"]["diagnosticsEverySteps"] = 1
    measuring = make_learner(cache, None, every)
    run_steps(skipping, 2)
    run_steps(measuring, 2)
    measured = dict(measuring.engine.module.named_parameters())
    for name, value in skipping.engine.module.named_parameters():
        assert torch.equal(value, measured[name]), name


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_first_mini_batchs_pi_old_from_its_update_trains_as_a_recompute_does(
    cache: Path, staleness: int
) -> None:
    """Between diagnostics the first mini-batch takes πold from its update's own forward, on
    the same weights a recompute would run on: the weights trained match a learner that
    recomputes it every step (diagnostics every step), on- and off-policy (the recompute is
    then the proximal policy, weighted against the engine's log-probs)."""
    import copy

    manifest = tiny_spec(miniBatches=2, maxStaleness=staleness)
    manifest["spec"]["metrics"]["diagnosticsEverySteps"] = 100
    skipping = make_learner(cache, None, manifest)
    every = copy.deepcopy(manifest)
    every["spec"]["metrics"]["diagnosticsEverySteps"] = 1
    measuring = make_learner(cache, None, every)
    steps = run_steps(skipping, 3)
    assert [n for _, n in steps][1:] == [3, 3]  # the skip happened
    run_steps(measuring, 3)
    measured = dict(measuring.engine.module.named_parameters())
    start = dict(make_learner(cache, None, manifest).engine.module.named_parameters())
    for name, value in skipping.engine.module.named_parameters():
        moved = (measured[name] - start[name]).abs().max()
        assert moved > 0, name  # the steps updated it
        torch.testing.assert_close(value, measured[name], rtol=0, atol=1e-6 * float(moved))
    # The experts' load is reported every step either way: from the update's forward where it
    # stood in for πold's, with the routing πold's forward records.
    loads = [
        [
            learner.metrics.registry.get_sample_value(
                "gspo_moe_expert_load", {"layer": str(layer), "expert": str(e)}
            )
            for layer in range(2)
            for e in range(4)
        ]
        for learner in (skipping, measuring)
    ]
    assert None not in loads[0] and loads[0] == pytest.approx(loads[1], abs=0.01)
