"""The step pipeline: the synchronous path computes what it always did; with
algorithm.maxStaleness the next steps' collection overlaps the update, lags by at most that
many versions, never overlaps a weight sync, and a resume draws the prompts it would have."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from learner_helpers import WrappedFleet, make_learner, params, run, tiny_spec

from gspo_trainer.rollout.local import LocalRollout
from gspo_trainer.rollout.types import SamplingParams, step_seed


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


# Per-tensor sums (float64) of the policy after 3 steps of tiny_spec(maxSteps=3), seed 0, by
# the synchronous step as it was before the step was cut into stages (the same parameters
# bit for bit there: sha256 of every tensor compared). A change to what the synchronous step
# computes moves these by far more than the tolerance (one Adam step moves a weight by ~lr).
SYNC_SUMS_AFTER_3_STEPS: dict[str, float] = {
    "lm_head.weight": 0.7184533608160564,
    "model.embed_tokens.weight": -0.9304357667642762,
    "model.layers.0.input_layernorm.weight": 64.0011818408966,
    "model.layers.0.mlp.experts.down_proj": 0.35046947883893154,
    "model.layers.0.mlp.experts.gate_up_proj": 1.9883703504760888,
    "model.layers.0.mlp.gate.weight": -0.3114515243723872,
    "model.layers.0.post_attention_layernorm.weight": 63.99612087011337,
    "model.layers.0.self_attn.k_norm.weight": 32.00169664621353,
    "model.layers.0.self_attn.k_proj.weight": 1.1478598956673522,
    "model.layers.0.self_attn.o_proj.weight": 1.120031426733476,
    "model.layers.0.self_attn.q_norm.weight": 32.00138080120087,
    "model.layers.0.self_attn.q_proj.weight": -3.1794729346620443,
    "model.layers.0.self_attn.v_proj.weight": 0.005309521384333493,
    "model.layers.1.input_layernorm.weight": 63.99252665042877,
    "model.layers.1.mlp.experts.down_proj": 5.065811821448733,
    "model.layers.1.mlp.experts.gate_up_proj": -6.653732131337165,
    "model.layers.1.mlp.gate.weight": 0.05327581257006386,
    "model.layers.1.post_attention_layernorm.weight": 63.98922425508499,
    "model.layers.1.self_attn.k_norm.weight": 32.00215023756027,
    "model.layers.1.self_attn.k_proj.weight": 0.17966779444395797,
    "model.layers.1.self_attn.o_proj.weight": 1.1599148105524364,
    "model.layers.1.self_attn.q_norm.weight": 32.0016405582428,
    "model.layers.1.self_attn.q_proj.weight": -0.3189928357824101,
    "model.layers.1.self_attn.v_proj.weight": -1.2071027152924216,
    "model.norm.weight": 63.99504637718201,
}


class Traced(WrappedFleet):
    """Wraps the in-process rollout source: when each generation and sync ran, for which
    step (known by its seed), and which policy version the source held meanwhile."""

    def __init__(self, inner: LocalRollout, seed: int, steps: int) -> None:
        self.inner = inner
        self.step_of = {step_seed(seed, s): s for s in range(1, steps + 1)}
        self.events: list[tuple[str, int, float, float]] = []  # (kind, step|version, start, end)
        self.prompts: dict[int, list[list[int]]] = {}

    async def generate(self, prompts: Any, params: SamplingParams) -> Any:
        t0 = time.perf_counter()
        out = await self.inner.generate(prompts, params)
        step = self.step_of.get(params.seed or -1, 0)
        self.events.append(("generate", step, t0, time.perf_counter()))
        self.prompts[step] = [list(p) for p in prompts]
        return out

    async def sync_weights(self, named: Any, version: int) -> Any:
        t0 = time.perf_counter()
        out = await self.inner.sync_weights(named, version)
        self.events.append(("sync", version, t0, time.perf_counter()))
        return out

    def spans(self, kind: str) -> dict[int, tuple[float, float]]:
        return {n: (a, b) for k, n, a, b in self.events if k == kind}


def traced_learner(
    cache: Path, ckpt: Path | None, manifest: dict[str, Any]
) -> tuple[Any, Traced, dict]:
    learner = make_learner(cache, ckpt, manifest)
    alg = manifest["spec"]["algorithm"]
    traced = Traced(learner.rollout, alg.get("seed", 0), alg["maxSteps"])  # type: ignore[arg-type]
    learner.rollout = traced
    learned: dict[int, tuple[float, float]] = {}
    inner = learner._learn

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args)
        learned[learner.state.step + 1] = (t0, time.perf_counter())  # the step it serves
        return out

    learner._learn = timed  # type: ignore[method-assign]
    return learner, traced, learned


def padded(manifest: dict[str, Any], pack: bool = False) -> dict[str, Any]:
    """The sums above were recorded with the rows run padded (learner.packSequences false)."""
    manifest["spec"]["learner"]["packSequences"] = pack
    return manifest


def test_the_synchronous_step_computes_what_it_did_before_the_stages(cache: Path) -> None:
    import torch

    learner = make_learner(cache, None, padded(tiny_spec(maxSteps=3)))
    assert run(learner) == 0
    sums = {n: float(p.double().sum()) for n, p in params(learner).items()}
    assert sums.keys() == SYNC_SUMS_AFTER_3_STEPS.keys()
    for name, want in SYNC_SUMS_AFTER_3_STEPS.items():
        assert sums[name] == pytest.approx(want, rel=1e-6, abs=1e-6), name
    assert all(torch.isfinite(p).all() for p in params(learner).values())


def test_the_packed_step_computes_what_the_padded_one_did(cache: Path) -> None:
    """learner.packSequences (the default) runs the same step without padding: the same sums
    up to float order (1e-6 apart here), far inside what one changed update moves them."""
    learner = make_learner(cache, None, padded(tiny_spec(maxSteps=3), pack=True))
    assert learner.policy.packs()
    assert run(learner) == 0
    sums = {n: float(p.double().sum()) for n, p in params(learner).items()}
    for name, want in SYNC_SUMS_AFTER_3_STEPS.items():
        assert sums[name] == pytest.approx(want, rel=1e-5, abs=1e-5), name


def test_synchronous_collection_waits_for_the_update(cache: Path) -> None:
    learner, traced, learned = traced_learner(cache, None, tiny_spec(maxSteps=3))
    assert run(learner) == 0
    generated = traced.spans("generate")
    for step in (1, 2):  # step + 1 is sampled only once step's update is done
        assert generated[step + 1][0] >= learned[step][1]
    assert [r["staleness"] for r in learner.state.history] == [0, 0, 0]
    assert not any("importance_weight_mean" in r for r in learner.state.history)


def test_one_step_of_staleness_overlaps_collection_with_the_update(cache: Path) -> None:
    learner, traced, learned = traced_learner(cache, None, tiny_spec(maxSteps=4, maxStaleness=1))
    assert run(learner) == 0
    generated, synced = traced.spans("generate"), traced.spans("sync")
    for step in (1, 2, 3):  # step + 1 is sampled while step updates
        assert generated[step + 1][0] < learned[step][1]
    # Never a generation during a weight sync: no rollout mixes two versions.
    for g0, g1 in generated.values():
        for s0, s1 in synced.values():
            assert g1 <= s0 or s1 <= g0
    history = learner.state.history
    # Step 1 samples the starting weights; each later step those one update behind.
    assert [r["staleness"] for r in history] == [0, 1, 1, 1]
    for r in history:  # the decoupled objective's weights, measured every step
        assert 0 < r["importance_weight_mean"] <= r["importance_weight_max"]
        assert 0 <= r["importance_truncated_fraction"] <= 1
    # Sampled by the very weights it updates, step 1's weights are 1 (up to the engine's
    # rounding); one update later they move.
    assert history[0]["importance_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert learner.metrics.registry.get_sample_value("gspo_staleness") == 1


def test_a_resume_draws_the_prompts_an_unbroken_run_trains_on(cache: Path, tmp_path: Path) -> None:
    import shutil

    manifest = tiny_spec(maxSteps=5, maxStaleness=2)
    manifest["spec"]["checkpoint"] = {"everySteps": 2, "exportHf": False}
    straight, traced, _ = traced_learner(cache, tmp_path / "a", manifest)
    assert run(straight) == 0
    # Its step-2 checkpoint was written with steps 3 and 4 drawn and collected ahead.
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-000002", tmp_path / "b" / "step-000002")
    resumed, traced_again, _ = traced_learner(cache, tmp_path / "b", manifest)
    assert run(resumed) == 0
    assert resumed.state.history[0]["step"] == 3
    for step in (3, 4, 5):
        assert traced_again.prompts[step] == traced.prompts[step]
