"""Admission at the API server: the real kubectl against the API stand-in, which applies the
CRD's defaults and CEL rules as kube-apiserver does (cel_admission.py).

A manifest the operator would refuse is refused at `kubectl apply`, with the rule's words and
nothing stored; a frozen field of a stored job cannot be patched, a mutable one can; and a
job the operator refused at creation (for a reason only it can see) is still fixed by an edit.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
import yaml
from apiserver import ClusterApiServer
from kubectl import KUBECTL, Kubectl
from operator_harness import NS, eventually, pods_of, tiny_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
JOB = EXAMPLE["metadata"]["name"]
FROZEN = (
    "cannot change spec.algorithm of a job that exists; only spec.runPolicy.suspend, "
    "spec.runPolicy.activeDeadlineSeconds, spec.runPolicy.ttlSecondsAfterFinished change in "
    "flight; revert the edit, or delete and re-create the job"
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


@pytest.fixture
async def bare() -> AsyncIterator[ClusterApiServer]:
    """The API stand-in alone: admission is the API server's, no operator or controller needed."""
    server = ClusterApiServer()
    async with server, kmock.Server(server) as http:
        server.base_url = str(http.url).rstrip("/")
        yield server


async def test_kubectl_apply_of_a_bad_manifest_is_refused_and_nothing_is_stored(
    bare, tmp_path
) -> None:
    api = bare
    kubectl = Kubectl(api.base_url, tmp_path)
    bad = copy.deepcopy(EXAMPLE)
    bad["spec"]["algorithm"]["groupSize"] = 1
    bad["spec"]["learner"]["resources"] = {"requests": {"nvidia.com/gpu": 4}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = await kubectl("apply", "--validate=false", "-f", str(path), ok=False)
    assert out.startswith(f'The GSPOJob "{JOB}" is invalid: '), out
    assert (
        '* spec.algorithm.groupSize: Invalid value: "object": leaves every response with zero '
        "advantage (advantages compare responses to the same prompt); set it to 2 or more\n"
    ) in out
    assert "* spec.learner.resources.requests[nvidia.com/gpu]: Invalid value" in out
    assert api.get("GSPOJob", NS, JOB) is None
    assert all(obj.get("kind") != "GSPOJob" for _, _, _, obj in api.history)  # never stored


async def test_kubectl_patch_of_a_frozen_field_is_refused(bare, tmp_path) -> None:
    api = bare
    kubectl = Kubectl(api.base_url, tmp_path)
    out = await kubectl("apply", "--validate=false", "-f", "examples/gspojob.yaml")
    assert f"gspojob.gspo.dev/{JOB} created" in out
    stored = api.get("GSPOJob", NS, JOB)["spec"]
    assert stored["weightSync"]["method"] == "broadcast"  # a default, filled in

    edit = json.dumps({"spec": {"algorithm": {"learningRate": 0.5}}})
    out = await kubectl("patch", "gspojob", JOB, "--type=merge", "-p", edit, ok=False)
    assert out.startswith(
        f'The GSPOJob "{JOB}" is invalid: spec.algorithm: Invalid value: "object": {FROZEN}'
    ), out
    assert api.get("GSPOJob", NS, JOB)["spec"] == stored

    # kubectl apply of the edited manifest is a patch too, and refused alike.
    edited = copy.deepcopy(EXAMPLE)
    edited["spec"]["algorithm"]["learningRate"] = 0.5
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    out = await kubectl("apply", "--validate=false", "-f", str(tmp_path / "edited.yaml"), ok=False)
    assert FROZEN in out, out
    assert api.get("GSPOJob", NS, JOB)["spec"] == stored

    suspend = json.dumps({"spec": {"runPolicy": {"suspend": True}}})
    out = await kubectl("patch", "gspojob", JOB, "--type=merge", "-p", suspend)
    assert f"gspojob.gspo.dev/{JOB} patched" in out
    assert api.get("GSPOJob", NS, JOB)["spec"]["runPolicy"]["suspend"] is True


async def test_a_job_the_operator_refused_is_fixed_by_an_edit(api, run_operator, tmp_path) -> None:
    """restartScope: learner passes the CRD (only the operator knows the cluster's JobSet) and
    is refused by the operator; the frozen field may still change, and the job then starts."""
    kubectl = Kubectl(api.base_url, tmp_path)
    doc = tiny_job(runPolicy={"restartScope": "learner"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    name = doc["metadata"]["name"]

    def status() -> dict:
        return (api.get("GSPOJob", NS, name) or {}).get("status") or {}

    async with run_operator(api):
        await kubectl("apply", "--validate=false", "-f", str(tmp_path / "job.yaml"))
        await eventually(lambda: status().get("phase") == "Failed", what="refused: Failed")
        fix = json.dumps({"spec": {"runPolicy": {"restartScope": "all"}}})
        out = await kubectl("patch", "gspojob", name, "--type=merge", "-p", fix)
        assert f"gspojob.gspo.dev/{name} patched" in out
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
        # Once the job runs, the same field is frozen.
        back = json.dumps({"spec": {"runPolicy": {"restartScope": "learner"}}})
        await eventually(lambda: status().get("phase") == "Pending", what="started")
        out = await kubectl("patch", "gspojob", name, "--type=merge", "-p", back, ok=False)
        assert "cannot change spec.runPolicy.backoffLimit, " in out
        assert "spec.runPolicy.restartScope" in out
