"""Fixtures of the operator tests (helpers live in operator_harness, a uniquely named module)."""

from operator_harness import api, progress, run_operator

__all__ = ["api", "progress", "run_operator"]
