"""The job's token stays in its Secret: never in logs, status, Events or metrics."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from operator_harness import NS, eventually, kubelet, tiny_job
from prometheus_client import generate_latest
from test_operator_kmock import create, job_status, learners, names_of, start_running

from gspo_api.progress import LearnerProgress
from gspo_operator import names

JOB = "tiny"


def _token(api) -> str:
    secret = api.get("Secret", NS, names.token_secret(JOB))
    if "stringData" in secret:
        return secret["stringData"]["token"]
    return base64.b64decode(secret["data"]["token"]).decode()


async def test_the_jobs_token_never_leaves_its_secret(api, run_operator, progress, caplog) -> None:
    caplog.set_level(logging.DEBUG)  # the most the operator ever says
    async with run_operator(api) as ctx:
        await create(api, tiny_job(progress_port=progress.port))
        progress.value = LearnerProgress(phase="Running", step=3, policy_version=3)
        await start_running(api)
        await kubelet(api, names_of(learners(api))[1], "Failed", exit_code=137)  # a restart
        await eventually(lambda: job_status(api).get("restarts") == 1, what="a restart")
        await start_running(api, attempt=1)
        for pod in names_of(learners(api, 1)):
            await kubelet(api, pod, "Succeeded", exit_code=0)
        await eventually(lambda: job_status(api).get("phase") == "Succeeded", what="Succeeded")
        metrics = generate_latest(ctx.metrics.registry).decode()

    token = _token(api)
    assert len(token) >= 32
    # The pods get it by reference only.
    for pod in api.list_kind("Pod", NS):
        assert token not in json.dumps(pod)
    places = {
        "logs": "\n".join(r.getMessage() for r in caplog.records),
        "status": json.dumps(api.get("GSPOJob", NS, JOB)),
        "events": json.dumps(api.list_kind("Event", NS)),
        "metrics": metrics,
    }
    assert "Created Secret tiny-job-token" in places["logs"]  # the logs were captured
    assert api.list_kind("Event", NS) and "gspo_operator_jobs" in metrics
    for where, text in places.items():
        assert token not in text, f"the job's token appears in the operator's {where}"
    others = api.list_kind("ConfigMap", NS) + api.list_kind("JobSet", NS) + api.list_kind("Job", NS)
    assert all(token not in json.dumps(o) for o in others)


@pytest.mark.parametrize("owned", [True, False])
async def test_a_job_of_an_earlier_release_keeps_its_token(api, run_operator, owned) -> None:
    """A job an earlier release ran, whose pods read the Secret it named J-sync-token: the
    Secret this release creates holds the same token, so either opens the same servers. An
    earlier Secret of that name that is another object's lends nothing."""
    await create(api, tiny_job())
    uid = api.get("GSPOJob", NS, JOB)["metadata"]["uid"] if owned else "another-uid"
    owner = {"apiVersion": "gspo.dev/v1alpha1", "kind": "GSPOJob", "name": JOB, "uid": uid}
    earlier = names.token_secret_earlier(JOB)
    api.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": earlier,
                "namespace": NS,
                "ownerReferences": [{**owner, "controller": True}],
            },
            "data": {"token": base64.b64encode(b"earlier-t0ken").decode()},
        }
    )
    async with run_operator(api):
        await eventually(lambda: api.get("Secret", NS, names.token_secret(JOB)) is not None)
        assert (_token(api) == "earlier-t0ken") is owned
