"""What a GSPOJob may ask of its pods: refused before anything exists, naming field and fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from gspo_operator import names
from gspo_operator.manifest import ClusterPolicy, check_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


STOCK = ClusterPolicy()


def problems(policy: ClusterPolicy = STOCK, name: str | None = None, **sections) -> list[str]:
    doc = copy.deepcopy(EXAMPLE)
    if name is not None:
        doc["metadata"]["name"] = name
    for section, fields in sections.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **fields}
    _, found = check_job(doc, policy)
    return [str(p) for p in found]


def test_the_example_is_valid() -> None:
    assert problems() == []


# (learner settings over the example, words of the problem). The CRD's CEL rules refuse
# those they can see (tests/contract/test_crd_cel.py).
BAD_POD_SETTINGS = [
    ({"volumes": [{"name": "d"}]}, "spec.learner.volumes[0]: needs exactly one volume source"),
    (
        {"volumes": [{"name": "d", "emptyDir": {}, "nfs": {"server": "s", "path": "/"}}]},
        "got emptyDir, nfs",
    ),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "declare the volume there"),
    (
        {"volumes": [{"name": "config", "emptyDir": {}}], "volumeMounts": []},
        "'config' is a volume the operator adds",
    ),
    (
        {"volumeMounts": [{"name": "math-data", "mountPath": "/checkpoints"}]},
        "mount somewhere else",
    ),
    ({"env": [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {}}}]}, "keep one"),
    ({"env": [{"name": "A", "valueFrom": {"secretKeyRefs": {}}}]}, "needs exactly one of"),
    ({"envFrom": [{"secretRef": {}}]}, "configMapRef or secretRef with a name"),
    (
        {"resources": {"requests": {"nvidia.com/gpu": 4}}},
        "spec.learner.resources.requests[nvidia.com/gpu]: 4 disagrees with "
        "learner.gpusPerReplica=8",
    ),
]


@pytest.mark.parametrize(("learner", "expected"), BAD_POD_SETTINGS)
def test_bad_pod_settings_are_refused_with_the_field(learner: dict, expected: str) -> None:
    found = problems(learner=learner)
    assert any(expected in p for p in found), found


def test_host_path_is_refused_unless_the_cluster_allows_it() -> None:
    learner = {
        "volumes": [{"name": "host", "hostPath": {"path": "/mnt/data"}}],
        "volumeMounts": [{"name": "host", "mountPath": "/mnt/data"}],
    }
    (refused,) = problems(learner=learner)
    assert refused.startswith("spec.learner.volumes[0].hostPath: hostPath volumes are not allowed")
    assert "allowHostPath" in refused
    assert problems(ClusterPolicy(allow_host_path=True), learner=learner) == []


def test_learner_restart_scope_needs_the_jobset_gate() -> None:
    (refused,) = problems(runPolicy={"restartScope": "learner"})
    assert "RestartJob feature gate" in refused and "jobset.restartJobGate" in refused
    assert (
        problems(ClusterPolicy(restart_job_gate=True), runPolicy={"restartScope": "learner"}) == []
    )


def test_long_names_are_refused_with_the_limit_jobset_enforces() -> None:
    limit = names.max_job_name(2, 4)
    assert problems(name="a" * limit) == []
    (refused,) = problems(name="a" * (limit + 1))
    assert refused.startswith("metadata.name:") and f"to {limit} characters" in refused
    # More servers make longer pod names: the limit follows the replicas.
    assert problems(name="a" * limit, rollout={"replicas": 12}) != []


def test_existing_claim_settings_conflict_is_refused() -> None:
    found = problems(checkpoint={"claimName": "mine", "accessModes": ["ReadWriteMany"]})
    assert any(p.startswith("spec.checkpoint.claimName:") for p in found), found
