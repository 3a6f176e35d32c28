"""The operator (real kopf tasks) against the API stand-in, with a simulated kubelet."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
from operator_harness import NS, eventually, free_port, kubelet, tiny_job

from gspo_trainer.progress import LearnerProgress

JOB = "tiny"
LEARNERS = [f"{JOB}-learner-0", f"{JOB}-learner-1"]
CHILD_KINDS = {
    "ConfigMap": 1,
    "Secret": 1,
    "PersistentVolumeClaim": 1,
    "Service": 3,
    "Pod": 2,
    "Deployment": 1,
    "NetworkPolicy": 1,
    "PodMonitor": 1,
}


def job_status(api) -> dict:
    return (api.get("GSPOJob", NS, JOB) or {}).get("status") or {}


def cond(api, type_: str) -> dict | None:
    for c in job_status(api).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def children(api) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for kind in CHILD_KINDS:
        out[kind] = api.list_kind(kind, NS)
    return out


def events(api) -> list[tuple[str, str]]:
    return [(e.get("type"), e.get("reason")) for e in api.list_kind("Event", NS)]


async def liveness(port: int) -> int:
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    return resp.status
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.1)
    raise AssertionError(f"nothing listens on :{port}/healthz")


async def has_event(api, type_: str, reason: str) -> None:
    await eventually(lambda: (type_, reason) in events(api), what=f"a {type_} {reason} Event")


async def call(api, method: str, path: str, **kw) -> int:
    """One request on a fresh connection (kopf cancels the server tasks it outlives)."""
    async with (
        aiohttp.ClientSession(api.base_url) as session,
        session.request(method, path, **kw) as resp,
    ):
        assert resp.status < 300, await resp.text()
        return resp.status


async def create(api, doc: dict) -> None:
    await call(api, "POST", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs", json=doc)


async def patch_spec(api, patch: dict) -> None:
    url = f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}"
    headers = {"Content-Type": "application/merge-patch+json"}
    await call(api, "PATCH", url, json={"spec": patch}, headers=headers)


async def start_running(api, progress) -> None:
    await eventually(lambda: api.get("Deployment", NS, f"{JOB}-rollout"), what="Deployment")
    for pod in LEARNERS:
        await kubelet(api, pod, "Running")
    await api.patch_status("Deployment", NS, f"{JOB}-rollout", {"readyReplicas": 2})
    await eventually(lambda: job_status(api).get("phase") == "Running", what="phase Running")


async def test_create_runs_and_reports_progress(api, run_operator, progress) -> None:
    health = free_port()
    async with run_operator(api, liveness_port=health) as ctx:
        assert await liveness(health) == 200  # the probe the chart points at
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2, what="learner pods")
        await eventually(lambda: job_status(api).get("phase") == "Pending", what="Pending")
        kids = children(api)
        assert {k: len(v) for k, v in kids.items()} == CHILD_KINDS
        uid = api.get("GSPOJob", NS, JOB)["metadata"]["uid"]
        for objs in kids.values():
            for obj in objs:
                assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert cond(api, "Created")["status"] == "True"

        progress.value = LearnerProgress(
            phase="Running", step=7, reward=0.5, last_checkpoint="step-000005", policy_version=7
        )
        await start_running(api, progress)
        st = await eventually(lambda: job_status(api).get("step") == 7 and job_status(api))
        assert st["rolloutReady"] == "2/2" and st["reward"] == 0.5
        assert st["lastCheckpoint"] == "step-000005" and st["policyVersion"] == 7
        for type_ in ("LearnerReady", "RolloutReady", "WeightsSynced", "Running"):
            assert cond(api, type_)["status"] == "True", type_
        await has_event(api, "Normal", "Running")
        text = ctx.metrics.registry.get_sample_value
        assert text("gspo_operator_jobs", {"phase": "Running"}) == 1
        assert (
            text(
                "controller_runtime_reconcile_total", {"controller": "gspojob", "result": "success"}
            )
            > 0
        )

        # Succeeded: every learner pod exits 0; the rollout fleet is scaled to zero.
        for pod in LEARNERS:
            await kubelet(api, pod, "Succeeded", exit_code=0)
        await eventually(lambda: job_status(api).get("phase") == "Succeeded", what="Succeeded")
        await eventually(
            lambda: api.get("Deployment", NS, f"{JOB}-rollout")["spec"]["replicas"] == 0
        )
        assert job_status(api)["completionTime"]


async def test_invalid_spec_fails_without_children(api, run_operator) -> None:
    doc = tiny_job()
    doc["spec"]["algorithm"]["groupSize"] = 1
    async with run_operator(api):
        await create(api, doc)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        await has_event(api, "Warning", "InvalidSpec")
        message = cond(api, "InvalidSpec")["message"]
        assert "spec.algorithm.groupSize" in message
        assert all(not v for v in children(api).values())
        # Fixing the manifest starts the job.
        await patch_spec(api, {"algorithm": {"groupSize": 4}})
        await eventually(lambda: job_status(api).get("phase") == "Pending", what="started")
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2, what="learner pods")
        assert cond(api, "InvalidSpec")["status"] == "False"
        assert cond(api, "Failed") is None and "completionTime" not in job_status(api)


async def test_learner_failure_restarts_group_then_backoff_fails(
    api, run_operator, progress
) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2)
        await start_running(api, progress)
        first_uids = {p["metadata"]["uid"] for p in api.list_kind("Pod", NS)}

        await kubelet(api, LEARNERS[1], "Failed", exit_code=137)
        await eventually(lambda: job_status(api).get("restarts") == 1, what="a restart")

        def regrouped():
            pods = api.list_kind("Pod", NS)
            uids = {p["metadata"]["uid"] for p in pods}
            gens = {p["metadata"]["annotations"]["gspo.dev/restart"] for p in pods}
            return len(pods) == 2 and not uids & first_uids and gens == {"1"}

        await eventually(regrouped, what="both learner pods replaced")
        assert job_status(api)["phase"] == "Restarting"
        await has_event(api, "Warning", "LearnerRestart")
        await start_running(api, progress)
        assert cond(api, "Restarting")["status"] == "False"

        await kubelet(api, LEARNERS[0], "Failed", exit_code=1)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        assert cond(api, "Failed")["reason"] == "BackoffLimitExceeded"
        await eventually(
            lambda: not [p for p in api.list_kind("Pod", NS) if p["status"]["phase"] == "Running"]
        )


async def test_rollout_pod_failure_does_not_restart_the_learner(
    api, run_operator, progress
) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2)
        await start_running(api, progress)
        uids = {p["metadata"]["uid"] for p in api.list_kind("Pod", NS)}
        await api.patch_status("Deployment", NS, f"{JOB}-rollout", {"readyReplicas": 1})
        await eventually(lambda: job_status(api).get("rolloutReady") == "1/2")
        assert cond(api, "RolloutReady")["status"] == "False"
        assert job_status(api)["phase"] == "Running" and job_status(api)["restarts"] == 0
        assert {p["metadata"]["uid"] for p in api.list_kind("Pod", NS)} == uids


async def test_suspend_and_resume(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2)
        await start_running(api, progress)
        await patch_spec(api, {"runPolicy": {"suspend": True}})
        await eventually(lambda: job_status(api).get("phase") == "Suspended", what="Suspended")
        await eventually(lambda: not api.list_kind("Pod", NS), what="learner pods gone")
        dep = lambda: api.get("Deployment", NS, f"{JOB}-rollout")["spec"]["replicas"]  # noqa: E731
        await eventually(lambda: dep() == 0)
        await patch_spec(api, {"runPolicy": {"suspend": False}})
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2, what="pods recreated")
        await eventually(lambda: dep() == 2)
        await eventually(lambda: cond(api, "Suspended")["status"] == "False", what="resumed")
        await start_running(api, progress)


async def test_scale_in_place_and_refuse_immutable_changes(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2)
        await start_running(api, progress)
        await patch_spec(api, {"rollout": {"replicas": 3}})
        dep = lambda: api.get("Deployment", NS, f"{JOB}-rollout")["spec"]["replicas"]  # noqa: E731
        await eventually(lambda: dep() == 3, what="rollout scaled to 3")
        cm = api.get("ConfigMap", NS, f"{JOB}-config")
        assert "replicas: 3" in cm["data"]["gspojob.yaml"]

        await patch_spec(api, {"algorithm": {"learningRate": 0.5}})
        refused = await eventually(lambda: cond(api, "InvalidSpec"), what="refusal")
        assert refused["reason"] == "SpecChangeRefused"
        assert "spec.algorithm.learningRate" in refused["message"]
        assert (
            "learningRate: 1.0e-06"
            in api.get("ConfigMap", NS, f"{JOB}-config")["data"]["gspojob.yaml"]
        )
        assert job_status(api)["phase"] == "Running"
        await has_event(api, "Warning", "SpecChangeRefused")
        await patch_spec(api, {"algorithm": {"learningRate": 1e-6}})
        await eventually(lambda: cond(api, "InvalidSpec")["status"] == "False", what="accepted")


async def test_restarting_the_operator_duplicates_nothing(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(api.list_kind("Pod", NS)) == 2)
        await eventually(lambda: job_status(api).get("phase") == "Pending")
    before = {k: sorted(o["metadata"]["uid"] for o in v) for k, v in children(api).items()}
    secret = copy.deepcopy(api.get("Secret", NS, f"{JOB}-sync-token"))
    # While the operator is away, a learner pod disappears and the others start.
    await api.patch_status("Pod", NS, LEARNERS[0], {"phase": "Running"})
    async with run_operator(api):
        await kubelet(api, LEARNERS[1], "Running")
        await eventually(lambda: job_status(api).get("phase") == "Pending")
        await kubelet(api, LEARNERS[0], "Running")
        await eventually(lambda: job_status(api).get("phase") == "Running", what="Running")
        after = {k: sorted(o["metadata"]["uid"] for o in v) for k, v in children(api).items()}
        assert after == before
        assert api.get("Secret", NS, f"{JOB}-sync-token") == secret  # never rotated
        # Deleting the job leaves no orphans (ownerReferences; the stand-in runs the GC).
        await call(api, "DELETE", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}")
        await eventually(lambda: all(not v for v in children(api).values()), what="no orphans")


async def test_deadline_fails_and_ttl_deletes(api, run_operator, progress) -> None:
    async with run_operator(api):
        doc = tiny_job(
            progress_port=progress.port,
            runPolicy={"activeDeadlineSeconds": 1, "ttlSecondsAfterFinished": 1},
        )
        await create(api, doc)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="deadline")
        assert cond(api, "Failed")["reason"] == "DeadlineExceeded"
        await eventually(
            lambda: api.get("GSPOJob", NS, JOB) is None,
            timeout_s=30,
            what="ttl deletion",
        )
        await eventually(lambda: all(not v for v in children(api).values()), what="no orphans")
