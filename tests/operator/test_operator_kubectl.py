"""A user's session: the real kubectl applies examples/gspojob.yaml to the API stand-in while the
operator runs, then gets, waits on conditions, describes and deletes.

Set GSPO_KUBECTL_TRANSCRIPT=FILE to keep the session's transcript (docs/operator.md shows one).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kubectl import KUBECTL, Kubectl
from operator_harness import NS, eventually, flagship_priority_class, kubelet

REPO = Path(__file__).resolve().parents[2]
JOB = "qwen3-30b-a3b-math"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


async def test_kubectl_apply_get_wait_describe_delete(api, run_operator, tmp_path) -> None:
    kubectl = Kubectl(api.base_url, tmp_path)
    api.add(flagship_priority_class())  # examples/gspojob-prerequisites.yaml
    async with run_operator(api, interval_s=0.3):
        out = await kubectl("apply", "--validate=false", "-f", "examples/gspojob.yaml")
        assert f"gspojob.gspo.dev/{JOB} created" in out
        await kubectl("wait", "--for=condition=Created", f"gspojob/{JOB}", "--timeout=30s")
        out = await kubectl("get", "gspo")
        header, row = out.strip().splitlines()[-2:]
        assert header.split() == ["NAME", "PHASE", "STEP", "REWARD", "ROLLOUT", "READY", "AGE"]
        assert row.split()[:2] == [JOB, "Pending"]

        # JobSet's Jobs made the pods; the kubelet starts them and the servers become ready.
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 6, what="6 pods")
        pods = await kubectl("get", "pods", "-l", f"gspo.dev/job-name={JOB}", "-o", "name")
        pods = sorted(pods.split())
        assert [p.rsplit("-", 1)[0] for p in pods] == [
            f"pod/{JOB}-learner-0-0",
            f"pod/{JOB}-learner-0-1",
            *(f"pod/{JOB}-rollout-{i}-0" for i in range(4)),
        ]
        for name in pods:
            await kubelet(api, name.removeprefix("pod/"), "Running")
        await kubectl("wait", "--for=condition=Running", f"gspojob/{JOB}", "--timeout=30s")
        await kubectl(
            "wait", "--for=jsonpath={.status.rolloutReady}=4/4", f"gspojob/{JOB}", "--timeout=30s"
        )
        out = await kubectl("get", "gspo")
        assert out.strip().splitlines()[-1].split()[:3] == [JOB, "Running", "4/4"]
        await eventually(lambda: len(api.list_kind("Event", NS)) >= 2)
        out = await kubectl("describe", "gspo", JOB)
        assert "Rollout Ready:" in out and "LearnerReady" in out
        assert "Created" in out.split("Events:")[-1]
        out = await kubectl(
            "get", "jobset,jobs,svc,cm,pvc,networkpolicy", "-l", f"gspo.dev/job-name={JOB}"
        )
        for name in (
            f"jobset.jobset.x-k8s.io/{JOB}",
            f"job.batch/{JOB}-learner-0",
            f"job.batch/{JOB}-rollout-3",
            f"{JOB}-rollout-api",
            f"{JOB}-config",
            f"{JOB}-checkpoints",
            f"{JOB}-pods",
        ):
            assert name in out

        # A learner pod fails: JobSet restarts the job's pods from the latest checkpoint.
        await kubelet(api, pods[1].removeprefix("pod/"), "Failed", exit_code=1)
        await kubectl(
            "wait", "--for=jsonpath={.status.restarts}=1", f"gspojob/{JOB}", "--timeout=30s"
        )
        out = await kubectl("get", "gspojob", JOB, "-o", "jsonpath={.status.phase}")
        assert out == "Restarting"

        out = await kubectl("delete", "-f", "examples/gspojob.yaml", "--timeout=30s")
        assert f'gspojob.gspo.dev "{JOB}" deleted' in out
        await eventually(lambda: not api.list_kind("Pod", NS), what="no orphan pods")
        out = await kubectl("get", "gspo")
        assert "No resources found" in out
    if path := os.environ.get("GSPO_KUBECTL_TRANSCRIPT"):
        Path(path).write_text("\n".join(kubectl.transcript))
