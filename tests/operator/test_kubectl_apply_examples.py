"""The real kubectl applies every example to the API stand-in, which prunes and validates custom
resources as kube-apiserver does (schema_admission.py): every field written is stored, under
kubectl's default strict field validation and with validation off (the server then prunes
silently, so the test reads the object back); and the flagship example's volumes reach the
pods JobSet's and the Job controller's stand-ins create from the operator's JobSet.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from apiserver import ClusterApiServer
from jobset_webhook import admit
from kubectl import KUBECTL, Kubectl
from operator_harness import NS, eventually, pods_of

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(
    p.relative_to(REPO).as_posix()
    for p in (REPO / "examples").glob("*.yaml")
    if any(d and d.get("kind") == "GSPOJob" for d in yaml.safe_load_all(p.read_text()))
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


def missing(written: Any, stored: Any, path: str = "") -> list[str]:
    """Paths of what `written` holds that `stored` lacks or holds otherwise (the server may
    add defaults; it may not drop or change what was written)."""
    if isinstance(written, dict) and isinstance(stored, dict):
        return [p for k, v in written.items() for p in missing(v, stored.get(k), f"{path}.{k}")]
    if isinstance(written, list) and isinstance(stored, list) and len(written) == len(stored):
        return [
            p
            for i, (a, b) in enumerate(zip(written, stored, strict=True))
            for p in missing(a, b, f"{path}[{i}]")
        ]
    return [] if written == stored else [path or "."]


def test_missing_names_what_the_server_dropped() -> None:
    written = {"spec": {"v": [{"pvc": {"claimName": "x"}}], "n": 1}}
    assert missing(written, {"spec": {"v": [{"pvc": {}}], "n": 1, "added": 2}}) == [
        ".spec.v[0].pvc.claimName"
    ]
    assert missing(written, written) == []


@pytest.fixture
async def stand_in() -> AsyncIterator[ClusterApiServer]:
    """The local cluster's API stand-in alone (no operator, no controllers)."""
    server = ClusterApiServer(admission=[admit])
    async with server, kmock.Server(server) as http:
        server.base_url = str(http.url).rstrip("/")
        yield server


@pytest.mark.parametrize("validate", ["strict", "false"])
async def test_kubectl_apply_of_every_example_keeps_every_field(
    stand_in, tmp_path, validate: str
) -> None:
    kubectl = Kubectl(stand_in.base_url, tmp_path)
    for example in EXAMPLES:
        out = await kubectl("apply", f"--validate={validate}", "-f", example, ok=False)
        assert "created" in out and "Error" not in out and "Warning" not in out, out
        for doc in yaml.safe_load_all((REPO / example).read_text()):
            if not doc or doc.get("kind") != "GSPOJob":
                continue
            name = doc["metadata"]["name"]
            stored = json.loads(await kubectl("get", "gspojob", name, "-o", "json"))
            assert missing(doc["spec"], stored["spec"]) == [], f"{example}: {name}"
        await kubectl("delete", "-f", example, "--wait=false")


async def test_the_flagship_examples_volumes_reach_its_pods(api, run_operator, tmp_path) -> None:
    example = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
    volumes = {v["name"]: v for v in example["spec"]["learner"]["volumes"]}
    mounts = example["spec"]["learner"]["volumeMounts"]
    kubectl = Kubectl(api.base_url, tmp_path)
    async with run_operator(api, interval_s=0.3):
        await kubectl("apply", "-f", "examples/gspojob-prerequisites.yaml")
        await kubectl("apply", "-f", "examples/gspojob.yaml")
        learners = await eventually(
            lambda: (
                len(pods_of(api, "learner")) == example["spec"]["learner"]["replicas"]
                and pods_of(api, "learner")
            ),
            what="the learner pods",
        )
        for pod in learners:
            have = {v["name"]: v for v in pod["spec"]["volumes"]}
            for name, volume in volumes.items():
                assert have.get(name) == volume, (pod["metadata"]["name"], have.get(name))
            container = pod["spec"]["containers"][0]
            for mount in mounts:
                assert any(
                    m["name"] == mount["name"] and m["mountPath"] == mount["mountPath"]
                    for m in container["volumeMounts"]
                ), (pod["metadata"]["name"], mount)
        assert api.get("Pod", NS, learners[0]["metadata"]["name"]) is not None


async def test_a_pod_the_api_server_refuses_is_in_the_job_status(
    api, run_operator, tmp_path
) -> None:
    """The flagship example applied before its prerequisites: the API server's Priority
    admission refuses every pod (no PriorityClass training-high), the Job controller records
    FailedCreate on the learner Job, and the GSPOJob's status quotes it instead of "0/2 learner
    pods running". Applying examples/gspojob-prerequisites.yaml lets the pods be created."""
    kubectl = Kubectl(api.base_url, tmp_path)
    name = "qwen3-30b-a3b-math"

    def condition(type_: str) -> dict[str, Any]:
        job = api.get("GSPOJob", NS, name) or {}
        conditions = (job.get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), {})

    def running_condition() -> dict[str, Any]:
        return condition("Running")

    async with run_operator(api, interval_s=0.3):
        await kubectl("apply", "-f", "examples/gspojob.yaml")
        refused = await eventually(
            lambda: running_condition().get("reason") == "FailedCreate" and running_condition(),
            what="the FailedCreate reason in the job's status",
        )
        assert refused["message"].startswith("0/2 learner pods created; Job qwen3-30b-a3b-math-")
        assert (
            'Error creating: pods "qwen3-30b-a3b-math-learner-0-0-" is forbidden: '
            "no PriorityClass with name training-high was found" in refused["message"]
        ), refused
        servers = await eventually(
            lambda: (
                condition("RolloutReady").get("reason") == "FailedCreate"
                and condition("RolloutReady")
            ),
            what="the rollout servers' FailedCreate in the job's status",
        )
        assert servers["message"].startswith("0/4 rollout servers ready; Job "), servers
        assert servers["message"].count("no PriorityClass with name training-high") == 4, servers
        described = await kubectl("describe", "gspojob", name)
        assert "no PriorityClass with name training-high was found" in described
        await kubectl("apply", "-f", "examples/gspojob-prerequisites.yaml")
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="the learner pods")
        await eventually(
            lambda: (
                running_condition().get("reason") != "FailedCreate"
                and condition("RolloutReady").get("reason") != "FailedCreate"
            ),
            what="the FailedCreate reasons to go once the pods exist",
        )
