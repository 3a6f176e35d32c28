"""The cluster admin's policy (chart values -> operator env -> ClusterPolicy): parsed at start-up
with errors naming the chart value, and enforced by `check_job` naming the field and the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_operator.manifest import (
    DEFAULT_METRICS_FROM,
    ENV_ALLOWED_IMAGES,
    ENV_ALLOWED_PRIORITY_CLASSES,
    ENV_METRICS_FROM,
    ENV_OPERATOR_NAMESPACE,
    ENV_OPERATOR_POD_LABELS,
    ClusterPolicy,
    PolicyError,
    check_job,
    image_matches,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
LEARNER_IMAGE = EXAMPLE["spec"]["learner"].get("image", "ghcr.io/gspo-dev/gspo-learner:0.1.0")


def problems(policy: ClusterPolicy, **sections: dict[str, Any]) -> list[str]:
    doc = copy.deepcopy(EXAMPLE)
    for section, fields in sections.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **fields}
    _, found = check_job(doc, policy)
    return [str(p) for p in found]


# --- from the environment ------------------------------------------------------------------


def test_no_env_is_the_charts_defaults() -> None:
    policy = ClusterPolicy.from_env({})
    assert policy == ClusterPolicy()
    assert policy.metrics_from == DEFAULT_METRICS_FROM
    assert policy.allowed_images == () and policy.allowed_priority_classes == ()


def test_every_value_is_read() -> None:
    peers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {
            "namespaceSelector": {},
            "podSelector": {
                "matchExpressions": [{"key": "app", "operator": "In", "values": ["a"]}]
            },
        },
    ]
    env = {
        ENV_METRICS_FROM: json.dumps(peers),
        ENV_OPERATOR_NAMESPACE: "gspo-system",
        ENV_OPERATOR_POD_LABELS: json.dumps({"app.kubernetes.io/name": "gspo-operator"}),
        ENV_ALLOWED_IMAGES: json.dumps(["ghcr.io/gspo-dev/*", "registry.corp/ml"]),
        ENV_ALLOWED_PRIORITY_CLASSES: json.dumps(["training-low"]),
    }
    policy = ClusterPolicy.from_env(env)
    assert policy.metrics_from == tuple(peers)
    assert policy.allowed_images == ("ghcr.io/gspo-dev/*", "registry.corp/ml")
    assert policy.allowed_priority_classes == ("training-low",)
    assert policy.operator_peer() == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gspo-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gspo-operator"}},
    }
    # An empty list is a choice (nobody scrapes), not "unset".
    assert ClusterPolicy.from_env({ENV_METRICS_FROM: "[]"}).metrics_from == ()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({ENV_METRICS_FROM: "{not json"}, "networkPolicy.metricsFrom) is not JSON"),
        ({ENV_METRICS_FROM: '{"podSelector": {}}'}, "must be a list of peers"),
        ({ENV_METRICS_FROM: "[{}]"}, "[0]: names no pods"),
        (
            {ENV_METRICS_FROM: '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]'},
            "[0]: unknown field(s) ipBlock",
        ),
        (
            {ENV_METRICS_FROM: '[{"podSelector": {"matchLabel": {"app": "p"}}}]'},
            "[0].podSelector.matchLabel: unknown field; use matchLabels or matchExpressions",
        ),
        (
            {ENV_METRICS_FROM: '[{"podSelector": {"matchLabels": {"app": "a b"}}}]'},
            "[0].podSelector.matchLabels: label value 'a b'",
        ),
        (
            {ENV_METRICS_FROM: '[{"podSelector": {"matchLabels": {"app": true}}}]'},
            "must be a string (quote it in YAML)",
        ),
        (
            {
                ENV_METRICS_FROM: '[{"namespaceSelector": {"matchExpressions": '
                '[{"key": "team", "operator": "Equals", "values": ["a"]}]}}]'
            },
            "[0].namespaceSelector.matchExpressions[0].operator: 'Equals' must be one of In,",
        ),
        (
            {
                ENV_METRICS_FROM: '[{"namespaceSelector": {"matchExpressions": '
                '[{"key": "team", "operator": "In"}]}}]'
            },
            "matchExpressions[0].values: In needs at least one value",
        ),
        ({ENV_OPERATOR_NAMESPACE: "Not_A_Namespace"}, "not a namespace name"),
        ({ENV_OPERATOR_POD_LABELS: "{}"}, "names no label"),
        ({ENV_ALLOWED_IMAGES: '"ghcr.io/*"'}, "policy.allowedImages) must be a list of strings"),
        ({ENV_ALLOWED_PRIORITY_CLASSES: '["ok", ""]'}, "[1] is '': give a non-empty string"),
    ],
)
def test_a_bad_value_stops_the_operator_naming_it(env: dict[str, str], expected: str) -> None:
    with pytest.raises(PolicyError) as caught:
        ClusterPolicy.from_env(env)
    message = str(caught.value)
    (name,) = env
    assert message.startswith(f"${name} (from "), message
    assert expected in message, message
    assert "fix it in the chart's values" in message


# --- images --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "pattern", "allowed"),
    [
        ("ghcr.io/gspo-dev/gspo-learner:0.1.0", "ghcr.io/gspo-dev/*", True),
        ("ghcr.io/gspo-dev/gspo-learner:0.1.0", "ghcr.io/gspo-dev", True),  # a prefix
        ("ghcr.io/gspo-dev/gspo-learner:0.1.0", "ghcr.io/gspo-dev/", True),
        ("ghcr.io/gspo-dev-evil/x:1", "ghcr.io/gspo-dev", False),  # not at a "/" boundary
        ("ghcr.io/gspo-dev-evil/x:1", "ghcr.io/gspo-dev/*", False),
        ("ghcr.io/gspo-dev/learner@sha256:abc", "ghcr.io/gspo-dev/learner", True),
        ("registry.corp/ml/learner:2", "registry.corp/ml/learner:?", True),
        ("registry.corp/learner:2", "*.corp/*", True),
        ("registry.corp/ml/learner:2", "*.corp/*", False),  # "*" never crosses a "/"
        ("evil.example/x.corp/learner:2", "*.corp/*", False),
        ("ghcr.io/gspo-dev/team/x:1", "ghcr.io/gspo-dev/*", False),
        ("ghcr.io/gspo-dev/team/x:1", "ghcr.io/gspo-dev/", True),
        ("python:3.12", "docker.io/library/*", True),  # as the runtime resolves it
        ("org/app:1", "docker.io/org/*", True),
        ("localhost:5000/app", "docker.io/*", False),
    ],
)
def test_image_patterns(image: str, pattern: str, allowed: bool) -> None:
    assert image_matches(image, pattern) is allowed


def test_images_outside_the_policy_are_refused_with_field_and_fix() -> None:
    policy = ClusterPolicy(allowed_images=("registry.corp/ml/*",))
    found = problems(policy)
    assert [p.split(":")[0] for p in found] == ["spec.learner.image", "spec.rollout.image"]
    assert (
        f"{LEARNER_IMAGE!r} is not allowed on this cluster (allowed: registry.corp/ml/*)"
        in (found[0])
    )
    assert "ask the admin to add it to the chart value policy.allowedImages" in found[0]
    mirrored = {"image": "registry.corp/ml/gspo-learner:0.1.0"}
    assert problems(policy, learner=mirrored, rollout={"image": "registry.corp/ml/r:1"}) == []
    # No rollout servers: their image is never pulled, so never checked.
    assert problems(policy, learner=mirrored, rollout={"replicas": 0}) == []
    assert problems(ClusterPolicy(allowed_images=("ghcr.io/gspo-dev/*",))) == []
    assert problems(ClusterPolicy()) == []  # empty: any image


# --- priority classes ----------------------------------------------------------------------


def test_priority_classes_outside_the_policy_are_refused_with_field_and_fix() -> None:
    policy = ClusterPolicy(allowed_priority_classes=("training-low", "training-mid"))
    (found,) = problems(policy)  # the example asks for training-high
    assert found.startswith("spec.runPolicy.scheduling.priorityClassName: 'training-high' is")
    assert "(allowed: training-low, training-mid)" in found
    assert "ask the admin to add it to the chart value policy.allowedPriorityClasses" in found
    low = {"scheduling": {"priorityClassName": "training-low"}}
    assert problems(policy, runPolicy=low) == []
    assert problems(policy, runPolicy={"scheduling": {}}) == []  # the cluster's default
    assert problems(ClusterPolicy()) == []  # empty: any PriorityClass


# --- `gspo validate`, offline, as on such a cluster -----------------------------------------


def test_validate_checks_against_the_clusters_policy(gspo) -> None:
    out = gspo(
        "validate",
        "examples/gspojob.yaml",
        "--allowed-image",
        "ghcr.io/gspo-dev/gspo-learner",
        "--allowed-image=ghcr.io/gspo-dev/gspo-rollout:*",
        "--allowed-priority-class",
        "training-low",
    )
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()
    assert line.startswith("examples/gspojob.yaml: spec.runPolicy.scheduling.priorityClassName:")
    out = gspo(
        "validate",
        "examples/gspojob.yaml",
        "--allowed-image=registry.corp/*",
        "--allowed-priority-class=training-high",
    )
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["spec.learner.image", "spec.rollout.image"]
    ok = gspo("validate", "examples/gspojob.yaml", "--allowed-priority-class=training-high")
    assert ok.returncode == 0, ok.stdout + ok.stderr
