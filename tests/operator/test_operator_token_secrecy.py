"""The per-job weight-sync token stays in its Secret: never in logs, status, Events or metrics."""

from __future__ import annotations

import base64
import json
import logging

from operator_harness import NS, eventually, kubelet, tiny_job
from prometheus_client import generate_latest
from test_operator_kmock import LEARNERS, create, job_status, start_running

from gspo_operator import names
from gspo_trainer.progress import LearnerProgress

JOB = "tiny"


def _token(api) -> str:
    secret = api.get("Secret", NS, names.sync_token_secret(JOB))
    if "stringData" in secret:
        return secret["stringData"]["token"]
    return base64.b64decode(secret["data"]["token"]).decode()


def _generation(api) -> list[str]:
    pods = api.list_kind("Pod", NS)
    return [p["metadata"]["annotations"][names.RESTART_ANNOTATION] for p in pods]


async def test_sync_token_never_leaves_its_secret(api, run_operator, progress, caplog) -> None:
    caplog.set_level(logging.DEBUG)  # the most the operator ever says
    async with run_operator(api) as ctx:
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2, what="learner pods")
        progress.value = LearnerProgress(phase="Running", step=3, policy_version=3)
        await start_running(api, progress)
        await kubelet(api, LEARNERS[1], "Failed", exit_code=137)  # one group restart
        await eventually(lambda: job_status(api).get("restarts") == 1, what="a restart")
        await eventually(lambda: _generation(api) == ["1", "1"], what="a new learner group")
        await start_running(api, progress)
        for pod in LEARNERS:
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
    assert "Created Secret tiny-sync-token" in places["logs"]  # the logs were captured
    assert api.list_kind("Event", NS) and "gspo_operator_jobs" in metrics
    for where, text in places.items():
        assert token not in text, f"the sync token appears in the operator's {where}"
    others = api.list_kind("ConfigMap", NS) + api.list_kind("Deployment", NS)
    assert all(token not in json.dumps(o) for o in others)
