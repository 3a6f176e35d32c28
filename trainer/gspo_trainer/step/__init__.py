"""The learner's step as stages with typed hand-offs: collect -> plan -> πold -> update ->
sync -> stats (see each module); `learner.Learner` runs them in order."""
