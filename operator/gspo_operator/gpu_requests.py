"""GPUs are stated once: `gpusPerReplica`.

A pod's GPU count comes from `spec.<role>.gpusPerReplica`; the operator writes it into both
`resources.requests` and `resources.limits`, because the API server refuses an extended
resource whose request differs from its limit. A user may still name a GPU resource
(`nvidia.com/gpu`, `amd.com/gpu`, any `*/gpu`) under resources, to pick the vendor's
resource name, but only with the same count: one that disagrees is refused, naming the
field and the fix. Pure functions of the spec; no Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gspo_api.rules import GPU_RESOURCE
from gspo_api.spec import GSPOJobSpec, LearnerConfig, RolloutConfig
from gspo_api.validation import Problem

SECTIONS = ("requests", "limits")


def is_gpu_resource(name: str) -> bool:
    """An extended resource that counts whole GPUs: nvidia.com/gpu, amd.com/gpu, ..."""
    return name.endswith("/gpu")


def _named_gpus(resources: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, Any]]:
    """(section, resource name, value) for every GPU entry the user wrote."""
    return [
        (section, name, value)
        for section in SECTIONS
        for name, value in (resources.get(section) or {}).items()
        if is_gpu_resource(name)
    ]


def gpu_resource_name(resources: Mapping[str, Mapping[str, Any]]) -> str:
    """The GPU resource a pod asks for: the one the user named, else nvidia.com/gpu."""
    named = sorted({name for _, name, _ in _named_gpus(resources)})
    return named[0] if len(named) == 1 else GPU_RESOURCE


def check_role_gpus(pods: LearnerConfig | RolloutConfig, path: str) -> list[Problem]:
    """Problems with the GPU entries of one role's resources (path: "spec.learner")."""
    resources = pods.resources.model_dump()
    gpus = pods.gpus_per_replica
    named = _named_gpus(resources)
    out: list[Problem] = []
    kinds = sorted({name for _, name, _ in named})
    if len(kinds) > 1:
        out.append(
            Problem(
                f"{path}.resources",
                f"names {len(kinds)} GPU resources ({', '.join(kinds)}); a pod uses one kind "
                "of GPU: keep one of them",
            )
        )
    for section, name, value in named:
        if str(value) == str(gpus):
            continue
        field = f'{path}.resources.{section}["{name}"]'
        out.append(
            Problem(
                f"{path}.resources.{section}[{name}]",
                f"{value} disagrees with {path}.gpusPerReplica={gpus}; remove {field}: the GPU "
                f"count is {path}.gpusPerReplica (the operator sets requests and limits from it)",
            )
        )
    return out


def check_gpu_requests(spec: GSPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """GPU entries under learner and rollout resources that disagree with gpusPerReplica."""
    return [
        *check_role_gpus(spec.learner, f"{prefix}.learner"),
        *check_role_gpus(spec.rollout, f"{prefix}.rollout"),
    ]


def render_resources(resources: Mapping[str, Mapping[str, Any]], gpus: int) -> dict[str, Any]:
    """A container's resources: the user's requests and limits, with the GPU count from
    gpusPerReplica in both (requests == limits, as the API server requires for extended
    resources) under the GPU resource the user named, else nvidia.com/gpu. With no GPUs
    (gpus == 0) no GPU entry is written."""
    gpu_name = gpu_resource_name(resources)
    out: dict[str, Any] = {}
    for section in SECTIONS:
        values = {
            k: str(v) for k, v in (resources.get(section) or {}).items() if not is_gpu_resource(k)
        }
        if gpus > 0:
            values[gpu_name] = str(gpus)
        if values:
            out[section] = values
    return out
