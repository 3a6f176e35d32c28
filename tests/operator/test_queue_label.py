"""Kueue's queue-name label written on the GSPOJob itself (as Kubeflow's and KubeRay's users
write it on their jobs): Kueue knows no GSPOJob, so the operator carries it onto the JobSet
when the spec names no queue, and refuses a label that disagrees with the spec's queue.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from checkout import REPO
from operator_harness import eventually, kueue_api_server, operator, pods_of
from test_operator_kmock import JOB, call, cond, create, job_status
from test_operator_kueue import NS, QUEUE, ROOMY, queued_job

from gspo_operator import names, render
from gspo_operator.manifest import ClusterPolicy, check_job

LABEL_FIELD = f"metadata.labels[{names.QUEUE_LABEL}]"


def flagship(queue: str | None, label: str | None) -> dict:
    body = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())
    body["metadata"].update(namespace="default", uid="job-uid")
    body["spec"]["runPolicy"]["scheduling"].pop("queue")
    if queue:
        body["spec"]["runPolicy"]["scheduling"]["queue"] = queue
    if label:
        body["metadata"]["labels"] = {names.QUEUE_LABEL: label}
    return body


def jobset_queue(body: dict) -> str | None:
    spec, problems = check_job(copy.deepcopy(body), allow_overcommit=True)
    assert spec is not None, problems
    objs = render.render_job(body, spec, token="t", policy=ClusterPolicy())
    (js,) = [o for o in objs if o["kind"] == "JobSet"]
    return js["metadata"]["labels"].get(names.QUEUE_LABEL)


def test_the_label_on_the_job_queues_its_jobset() -> None:
    assert jobset_queue(flagship(queue=None, label="gpu-team")) == "gpu-team"
    assert jobset_queue(flagship(queue="gpu-team", label="gpu-team")) == "gpu-team"
    assert jobset_queue(flagship(queue=None, label=None)) is None


def test_a_label_that_disagrees_with_the_spec_is_refused_naming_both(gspo, tmp_path: Path) -> None:
    body = flagship(queue="gpu-team", label="other-team")
    _, problems = check_job(body, allow_overcommit=True)
    (problem,) = [p for p in problems if p.path == LABEL_FIELD]
    assert "spec.runPolicy.scheduling.queue" in problem.message
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(body))
    result = gspo("validate", str(manifest))
    assert result.returncode == 1, result.stdout + result.stderr
    assert LABEL_FIELD in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


async def test_removing_a_disagreeing_label_starts_the_job(progress) -> None:
    """A label edit does not bump metadata.generation (the API server bumps it for spec
    changes only), yet it changes the job's queue: following the refusal's advice (remove
    the label) starts the job, as fixing the spec would."""
    async with kueue_api_server() as (api, _), operator(api):
        for doc in ROOMY:
            api.add(doc)
        job = queued_job(metrics={"port": progress.port})
        job["metadata"]["labels"] = {names.QUEUE_LABEL: "other-team"}
        await create(api, job)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="refused")
        assert LABEL_FIELD in cond(api, "InvalidSpec")["message"]
        await call(
            api,
            "PATCH",
            f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}",
            json={"metadata": {"labels": {names.QUEUE_LABEL: QUEUE}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
        assert cond(api, "InvalidSpec")["status"] == "False"
