"""The learner's step as stages with typed hand-offs: rollout -> plan -> old_policy (πold) ->
update -> weight_sync -> stats (see each module); `learner.Learner` runs them in order. A
stage's module, its timing (`<stage>_seconds` in the history, `gspo_stage_seconds{stage}` in
Prometheus, gspo_trainer.metrics.STAGES) and the docs use one name."""
