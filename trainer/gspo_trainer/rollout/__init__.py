"""Rollout fleet: vLLM servers, the client the learner uses, and weight sync."""
