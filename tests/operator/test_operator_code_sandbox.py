"""A job with code rewards says in its status whether model-written programs are sandboxed:
reward.sandbox.isolation none is a CodeSandboxed=False condition, never silent."""

from __future__ import annotations

import copy

from test_operator_status import NOW, RAW, cond, observed, pods, servers, step

from gspo_api.validation import parse_spec


def status_with(reward: dict) -> dict:
    raw = copy.deepcopy(RAW)
    raw["reward"] = reward
    obs = observed(pods("Running"), servers(raw["rollout"]["replicas"]))
    return step(parse_spec(raw), obs, None, NOW).status


def test_isolation_none_is_a_warning_condition_and_namespaces_a_true_one() -> None:
    none = status_with({"kind": "code", "sandbox": {"isolation": "none"}})
    unsandboxed = cond(none, "CodeSandboxed")
    assert unsandboxed["status"] == "False" and unsandboxed["reason"] == "IsolationNone"
    assert "reach the network" in unsandboxed["message"]
    component = {"functions": [{"name": "tests", "kind": "code"}]}
    assert cond(status_with(component), "CodeSandboxed")["status"] == "True"
    math = status_with({"kind": "math"})
    assert all(c["type"] != "CodeSandboxed" for c in math["conditions"])
