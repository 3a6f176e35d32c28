"""GPUs are stated once, in gpusPerReplica: a GPU entry under resources that disagrees is
refused naming the field and the fix; one that agrees is accepted; the rendered pods ask for
requests == limits (the API server refuses an extended resource whose two differ)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from rendered_checks import check_rendered

from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import parse_spec
from gspo_operator.gpu_requests import (
    check_gpu_requests,
    gpu_resource_name,
    is_gpu_resource,
    render_resources,
)
from gspo_operator.render import render_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def doc_with(role: str, gpus: int, resources: dict[str, Any]) -> dict:
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"].update(namespace="team-a", uid="0b5e8a76-4a7f-4f3e-9d77-2f1c7f1f8e11")
    doc["spec"][role]["gpusPerReplica"] = gpus
    for section, values in resources.items():
        doc["spec"][role].setdefault("resources", {}).setdefault(section, {}).update(values)
    return doc


def gpu_problems(role: str, gpus: int, resources: dict[str, Any]) -> list[str]:
    # The models only, not parse_spec: the pure rule is checked on its own here.
    spec = GSPOJobSpec.model_validate(doc_with(role, gpus, resources)["spec"])
    return [str(p) for p in check_gpu_requests(spec)]


def containers(objs: list[dict]) -> dict[str, dict]:
    """Every rendered container by name (learner, rollout, ...)."""
    found: dict[str, dict] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for c in node.get("containers") or []:
                found[c["name"]] = c
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objs)
    return found


def test_the_example_names_no_gpu_resource_and_passes() -> None:
    assert check_gpu_requests(GSPOJobSpec.model_validate(EXAMPLE["spec"])) == []


@pytest.mark.parametrize("role", ["learner", "rollout"])
@pytest.mark.parametrize("section", ["requests", "limits"])
@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "amd.com/gpu"])
def test_a_gpu_entry_that_disagrees_is_refused_naming_field_and_fix(
    role: str, section: str, resource: str
) -> None:
    found = gpu_problems(role, 4, {section: {resource: 8}})
    assert found == [
        f"spec.{role}.resources.{section}[{resource}]: 8 disagrees with "
        f"spec.{role}.gpusPerReplica=4; remove spec.{role}.resources.{section}"
        f'["{resource}"]: the GPU count is spec.{role}.gpusPerReplica (the operator sets '
        "requests and limits from it)"
    ]


@pytest.mark.parametrize("value", [4, "4"])
def test_a_gpu_entry_that_agrees_is_accepted(value: int | str) -> None:
    both = {"requests": {"nvidia.com/gpu": value}, "limits": {"nvidia.com/gpu": value}}
    assert gpu_problems("learner", 4, both) == []


def test_a_gpu_on_a_cpu_pod_is_refused() -> None:
    found = gpu_problems("rollout", 0, {"limits": {"nvidia.com/gpu": 1}})
    assert len(found) == 1
    assert "1 disagrees with spec.rollout.gpusPerReplica=0" in found[0]


def test_two_kinds_of_gpu_in_one_pod_are_refused() -> None:
    found = gpu_problems(
        "learner", 8, {"requests": {"nvidia.com/gpu": 8}, "limits": {"amd.com/gpu": 8}}
    )
    assert found == [
        "spec.learner.resources: names 2 GPU resources (amd.com/gpu, nvidia.com/gpu); a pod "
        "uses one kind of GPU: keep one of them"
    ]


def test_only_resources_ending_in_slash_gpu_count_as_gpus() -> None:
    assert is_gpu_resource("nvidia.com/gpu")
    assert is_gpu_resource("amd.com/gpu")
    assert not is_gpu_resource("cpu")
    assert not is_gpu_resource("nvidia.com/mig-1g.10gb")
    assert gpu_resource_name({"requests": {"cpu": "1"}}) == "nvidia.com/gpu"
    assert gpu_resource_name({"limits": {"amd.com/gpu": "2"}}) == "amd.com/gpu"


# --- rendering -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "gpus", "expected"),
    [
        (  # GPUs from gpusPerReplica only: written into both sections
            {"requests": {"cpu": 4}},
            8,
            {"requests": {"cpu": "4", "nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}},
        ),
        (  # an agreeing request alone still renders requests == limits
            {"requests": {"nvidia.com/gpu": 2}},
            2,
            {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}},
        ),
        (  # the vendor's resource name is kept
            {"limits": {"amd.com/gpu": "2"}},
            2,
            {"requests": {"amd.com/gpu": "2"}, "limits": {"amd.com/gpu": "2"}},
        ),
        ({"requests": {"cpu": "1", "nvidia.com/gpu": 0}}, 0, {"requests": {"cpu": "1"}}),
        ({}, 0, {}),
    ],
)
def test_render_resources_puts_the_gpu_count_in_requests_and_limits(
    resources: dict, gpus: int, expected: dict
) -> None:
    assert render_resources(resources, gpus) == expected


@pytest.mark.parametrize(
    ("role", "gpus", "resources", "gpu_name"),
    [
        ("learner", 4, {}, "nvidia.com/gpu"),
        ("learner", 4, {"requests": {"nvidia.com/gpu": 4}}, "nvidia.com/gpu"),
        ("rollout", 2, {"limits": {"nvidia.com/gpu": "2"}}, "nvidia.com/gpu"),
        ("rollout", 2, {"requests": {"amd.com/gpu": 2}}, "amd.com/gpu"),
    ],
)
def test_rendered_pods_ask_for_equal_gpu_requests_and_limits(
    role: str, gpus: int, resources: dict, gpu_name: str
) -> None:
    doc = doc_with(role, gpus, resources)
    spec = parse_spec(doc["spec"])
    assert check_gpu_requests(spec) == []
    objs = render_job(doc, spec, token="t0ken")
    got = containers(objs)[role]["resources"]
    assert got["requests"][gpu_name] == got["limits"][gpu_name] == str(gpus)
    assert [k for k in got["requests"] if k.endswith("/gpu")] == [gpu_name]
    assert check_rendered(objs) == []
