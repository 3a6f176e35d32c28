"""GSPO learner, rollout fleet and local launcher. Nothing heavy is imported here."""

__version__ = "0.1.0"
