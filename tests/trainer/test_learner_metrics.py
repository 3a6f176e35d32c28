"""Learner metrics: step stats land in their gauges; a non-finite loss is flagged and counted."""

from __future__ import annotations

import pytest

from gspo_trainer.metrics import STEP_GAUGES, LearnerMetrics


def test_step_stats_land_in_their_gauges() -> None:
    m = LearnerMetrics()
    m.observe_step(5, {"reward_mean": 0.25, "clip_fraction": 0.1, "not_a_metric": 3.0})
    get = m.registry.get_sample_value
    assert get("gspo_step") == 5
    assert get(STEP_GAUGES["reward_mean"][0]) == 0.25
    assert get(STEP_GAUGES["clip_fraction"][0]) == 0.1
    assert get("gspo_last_step_timestamp_seconds") > 0


def test_nonfinite_loss_is_flagged_then_cleared() -> None:
    m = LearnerMetrics()
    get = m.registry.get_sample_value
    m.observe_step(1, {"loss": float("nan")})
    assert get("gspo_loss_finite") == 0
    assert get("gspo_nonfinite_loss_steps_total") == 1
    m.observe_step(2, {"loss": 0.5})
    assert get("gspo_loss_finite") == 1
    assert get("gspo_nonfinite_loss_steps_total") == 1


def test_stage_timings_and_unknown_stage() -> None:
    m = LearnerMetrics()
    m.observe_seconds("rollout", 1.5)
    assert m.registry.get_sample_value("gspo_stage_seconds_sum", {"stage": "rollout"}) == 1.5
    with pytest.raises(ValueError, match="unknown stage 'rolout'"):
        m.observe_seconds("rolout", 1.0)


def test_expert_load_is_labelled_by_layer_and_expert() -> None:
    m = LearnerMetrics()
    m.observe_expert_load({0: [0.5, 0.25, 0.25, 0.0]})
    labels = {"layer": "0", "expert": "1"}
    assert m.registry.get_sample_value("gspo_moe_expert_load", labels) == 0.25


@pytest.mark.parametrize("every", [7, 50])
def test_the_learner_exports_its_checkpoint_interval(tmp_path, every: int) -> None:  # type: ignore[no-untyped-def]
    """GSPOCheckpointTooOld scales its threshold by gspo_checkpoint_every_steps; unset, the
    alert collapsed to its floor. The learner sets it from the spec as it starts."""
    from learner_helpers import make_learner, tiny_spec

    manifest = tiny_spec()
    manifest["spec"]["checkpoint"]["everySteps"] = every
    learner = make_learner(tmp_path / "models", None, manifest)
    assert learner.metrics.registry.get_sample_value("gspo_checkpoint_every_steps") == every
