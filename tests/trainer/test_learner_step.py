"""One learner step, in process, on the tiny MoE: what it updates, measures and exports."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from learner_helpers import make_learner, params, tiny_spec

from gspo_trainer.metrics import STEP_GAUGES


def boom(prompt: str, completion: str, answer: str) -> float:
    raise ValueError("bad reward")


def varied(prompt: str, completion: str, answer: str) -> float:
    """A reward with spread inside every group from the first step (so gradients are not 0)."""
    return float(sum(map(ord, completion)) % 7)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_a_step_updates_the_policy_and_reports_every_number(cache: Path) -> None:
    learner = make_learner(cache, None, tiny_spec(miniBatches=1))
    before = params(learner)
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    after = params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for key in ("reward_mean", "reward_std", "loss", "clip_fraction", "log_ratio_abs",
                "entropy", "response_length", "zero_advantage_fraction", "logprob_mismatch",
                "tokens_per_second", "routing_drift", "router_aux_loss", "grad_norm",
                "weight_sync_bytes"):  # fmt: skip
        assert key in stats and math.isfinite(stats[key]), key
        assert key in STEP_GAUGES
    # πold is the learner's recompute and one update per batch: s_i = 1, nothing clipped.
    assert stats["log_ratio_abs"] == pytest.approx(0.0, abs=1e-6)
    assert stats["clip_fraction"] == 0.0
    # The rollout source holds the same weights: engine and learner log-probs agree.
    assert stats["logprob_mismatch"] < 1e-4
    assert 0.0 <= stats["routing_drift"] <= 1.0
    assert 1.0 <= stats["response_length"] <= 4.0
    assert stats["weight_sync_bytes"] > 0
    sample = learner.metrics.registry.get_sample_value
    assert sample("gspo_step") == 1
    assert sample("gspo_reward_mean") == stats["reward_mean"]
    assert sample("gspo_moe_expert_load", {"layer": "0", "expert": "0"}) is not None
    # One series per MoE layer (the tiny MoE has 2), not one per routed token.
    assert sample("gspo_moe_expert_load", {"layer": "2", "expert": "0"}) is None
    loads = [sample("gspo_moe_expert_load", {"layer": "1", "expert": str(e)}) for e in range(4)]
    assert sum(loads) == pytest.approx(1.0)
    assert sample("gspo_stage_seconds_count", {"stage": "update"}) == 1


def test_mini_batches_move_the_ratio_and_the_clip_binds(cache: Path) -> None:
    learner = make_learner(cache, None, tiny_spec(miniBatches=4, learningRate=1e-3))
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    # After the first update the later mini-batches are scored by a moved policy.
    assert stats["log_ratio_abs"] > 1e-5


def test_a_raising_reward_scores_zero_and_the_run_goes_on(cache: Path) -> None:
    manifest = tiny_spec(maxSteps=2)
    manifest["spec"]["reward"] = {"kind": "python", "function": "test_learner_step:boom"}
    learner = make_learner(cache, None, manifest)
    assert asyncio.run(learner.run()) == 0
    assert learner.state.step == 2 and learner.state.phase == "Succeeded"
    sample = learner.metrics.registry.get_sample_value
    assert sample("gspo_reward_failures_total", {"reason": "error"}) == 2 * 16 * 8
    assert sample("gspo_reward_mean") == 0.0


def test_kl_to_the_starting_policy_is_measured_and_grows(cache: Path) -> None:
    # One update per batch: its only mini-batch is scored before any update.
    learner = make_learner(cache, None, tiny_spec(klCoef=0.05, learningRate=1e-3, miniBatches=1))
    assert learner.policy.reference is not None
    asyncio.run(learner.sync(0))
    first = asyncio.run(learner.train_step(1))
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # πθ still equals the reference
    asyncio.run(learner.sync(1))
    second = asyncio.run(learner.train_step(2))
    assert second["kl"] > 1e-6


def test_zero3_with_moe_leaf_blocks_takes_the_zero1_step(cache: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    runs = {}
    for stage in (1, 3):
        manifest = tiny_spec(maxSteps=2, miniBatches=2, learningRate=1e-3)
        manifest["spec"]["learner"]["zeroStage"] = stage
        manifest["spec"]["model"]["moe"]["routerAuxLossCoef"] = 0.0
        manifest["spec"]["reward"] = {"kind": "python", "function": "test_learner_step:varied"}
        learner = make_learner(cache, tmp_path / f"z{stage}", manifest)
        assert asyncio.run(learner.run()) == 0
        runs[stage] = AutoModelForCausalLM.from_pretrained(tmp_path / f"z{stage}" / "export")
    z1 = dict(runs[1].named_parameters())
    # Within a tenth of one lr step: Adam's near-zero-gradient noise (see the test below).
    for name, p in runs[3].named_parameters():
        torch.testing.assert_close(p, z1[name], rtol=1e-4, atol=1e-4, msg=name)


def test_micro_batches_cut_rows_within_the_token_budget() -> None:
    from gspo_trainer.step.batch import micro_count, micro_slices

    assert micro_count(16, 9, 16384) == 1
    assert micro_count(16, 9, 40) == 4  # 4 rows of 9 tokens fit in 40
    assert micro_count(5, 10, 25) == 3  # 2 rows per micro-batch, not 2.5
    assert micro_count(3, 100, 10) == 3  # a row longer than the budget goes alone
    parts = micro_slices(slice(8, 15), 3)
    assert [(p.start, p.stop) for p in parts] == [(8, 10), (10, 12), (12, 15)]
    assert micro_slices(slice(0, 2), 5) == [slice(0, 1), slice(1, 2)]


@pytest.mark.parametrize("stage", [1, 3])
def test_micro_batched_step_equals_the_whole_mini_batch(
    cache: Path, tmp_path: Path, stage: int
) -> None:
    """learner.microBatchTokens splits a mini-batch into accumulated micro-batches: the
    optimizer still steps once per mini-batch, on the same gradient."""
    from transformers import AutoModelForCausalLM

    runs = {}
    for budget in (16384, 8):  # 8 tokens: one response per micro-batch
        manifest = tiny_spec(maxSteps=2, miniBatches=2, learningRate=1e-3)
        manifest["spec"]["learner"].update(zeroStage=stage, microBatchTokens=budget)
        manifest["spec"]["model"]["moe"]["routerAuxLossCoef"] = 0.0  # a per-batch statistic
        manifest["spec"]["reward"] = {"kind": "python", "function": "test_learner_step:varied"}
        learner = make_learner(cache, tmp_path / f"b{budget}", manifest)
        assert asyncio.run(learner.run()) == 0
        runs[budget] = (learner.state.history, AutoModelForCausalLM.from_pretrained(
            tmp_path / f"b{budget}" / "export"))  # fmt: skip
    (whole_hist, whole), (micro_hist, micro) = runs[16384], runs[8]
    for a, b in zip(whole_hist, micro_hist, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["zero_advantage_fraction"] < 0.5
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["clip_fraction"] == pytest.approx(a["clip_fraction"], abs=1e-6)
    reference = dict(whole.named_parameters())
    # Adam turns float-order noise in near-zero gradients into moves of up to ~2e-5 (one
    # element of 2,048 with this batch's samples); a step is 1e-3, so a real difference
    # shows ten times above the 1e-4 allowed.
    for name, p in micro.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize(("level", "warned"), [("grpo", True), ("gspo", False)])
def test_grpo_on_a_moe_model_warns_that_the_paper_needs_routing_replay(
    cache: Path, caplog: pytest.LogCaptureFixture, level: str, warned: bool
) -> None:
    with caplog.at_level("WARNING", logger="gspo.learner"):
        make_learner(cache, None, tiny_spec(lossLevel=level))
    assert ("Routing Replay" in caplog.text) is warned
