"""The operator (real kopf tasks) against the API stand-in, with JobSet's and the Job
controller's stand-ins creating the pods from its JobSet, and pod status set by hand."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
from cel_admission import predating_rules
from operator_harness import (
    NS,
    api_server,
    eventually,
    free_port,
    kubelet,
    pods_of,
    run_all,
    tiny_job,
)

from gspo_api.progress import LearnerProgress
from gspo_operator import names
from gspo_operator.crd import render_crd

JOB = "tiny"
# The operator's children (the pods' headless Service "tiny" too: the operator makes it).
CHILD_KINDS = {
    "ConfigMap": 1,
    "Secret": 1,
    "PersistentVolumeClaim": 1,
    "Service": 3,
    "JobSet": 1,
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
    """The operator's children: objects it created (labelled with the job, owned by it)."""
    out: dict[str, list[dict]] = {}
    for kind in CHILD_KINDS:
        out[kind] = [
            o
            for o in api.list_kind(kind, NS)
            if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/managed-by")
            == "gspo-operator"
        ]
    return out


def learners(api, attempt: int | None = None) -> list[dict]:
    return pods_of(api, "learner", attempt)


def names_of(pods: list[dict]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


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


async def start_running(api, attempt: int = 0) -> None:
    """Once JobSet's Jobs made the pods (2 learners, 2 servers), run them all."""
    await eventually(lambda: len(learners(api, attempt)) == 2, what=f"learner pods ({attempt})")
    await eventually(lambda: len(pods_of(api, "rollout")) == 2, what="rollout pods")
    await run_all(api)
    await eventually(lambda: job_status(api).get("phase") == "Running", what="phase Running")


async def test_create_runs_and_reports_progress(api, run_operator, progress) -> None:
    health = free_port()
    async with run_operator(api, liveness_port=health) as ctx:
        assert await liveness(health) == 200  # the probe the chart points at
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(learners(api)) == 2, what="learner pods")
        await eventually(lambda: job_status(api).get("phase") == "Pending", what="Pending")
        kids = children(api)
        assert {k: len(v) for k, v in kids.items()} == CHILD_KINDS
        uid = api.get("GSPOJob", NS, JOB)["metadata"]["uid"]
        for kind, objs in kids.items():
            for obj in objs:
                if kind == "PersistentVolumeClaim":  # kept after the job, marked as its own
                    assert obj["metadata"]["annotations"][names.JOB_UID_ANNOTATION] == uid
                    continue
                assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert cond(api, "Created")["status"] == "True"
        # JobSet made the Jobs, the Job controller the pods: rank 0's host name is the
        # learner's MASTER_ADDR host.
        assert {j["metadata"]["name"] for j in api.list_kind("Job", NS)} == {
            f"{JOB}-learner-0", f"{JOB}-rollout-0", f"{JOB}-rollout-1"
        }  # fmt: skip
        hosts = sorted(p["spec"]["hostname"] for p in learners(api))
        assert hosts == [f"{JOB}-learner-0-0", f"{JOB}-learner-0-1"]

        progress.value = LearnerProgress(
            phase="Running", step=7, reward=0.5, last_checkpoint="step-000005", policy_version=7
        )
        await start_running(api)
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

        # Succeeded: every learner pod exits 0; JobSet completes and stops the servers.
        for pod in names_of(learners(api)):
            await kubelet(api, pod, "Succeeded", exit_code=0)
        await eventually(lambda: job_status(api).get("phase") == "Succeeded", what="Succeeded")
        await eventually(lambda: not pods_of(api, "rollout"), what="servers stopped")
        assert job_status(api)["completionTime"]


async def test_invalid_spec_fails_without_children(api, run_operator) -> None:
    api.add(predating_rules(render_crd()))  # no CEL rules: the API server admits the job
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
        await eventually(lambda: len(learners(api)) == 2, what="learner pods")
        assert cond(api, "InvalidSpec")["status"] == "False"
        assert cond(api, "Failed") is None and "completionTime" not in job_status(api)


async def test_learner_failure_restarts_the_jobset_then_max_restarts_fails(
    api, run_operator, progress
) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        first = set(names_of(learners(api)))

        await kubelet(api, names_of(learners(api))[1], "Failed", exit_code=137, message="OOM")
        await eventually(lambda: job_status(api).get("restarts") == 1, what="a restart")
        await eventually(lambda: len(learners(api, 1)) == 2, what="a new learner group")
        assert not first & set(names_of(learners(api, 1)))
        assert job_status(api)["phase"] == "Restarting"
        assert "OOM" in cond(api, "Restarting")["message"]
        await has_event(api, "Warning", "LearnerRestart")
        await start_running(api, attempt=1)
        await eventually(lambda: cond(api, "Restarting")["status"] == "False", what="recovered")

        await kubelet(api, names_of(learners(api, 1))[0], "Failed", exit_code=1)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        assert cond(api, "Failed")["reason"] == "BackoffLimitExceeded"
        running = lambda: [p for p in learners(api, 1) if p["status"]["phase"] == "Running"]  # noqa: E731
        await eventually(lambda: not running(), what="the learner group stopped")


async def test_learner_exit_2_fails_at_once_with_the_learners_words(
    api, run_operator, progress
) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        words = "gspo learner: spec.data.source: /data/x.jsonl does not exist"
        await kubelet(api, names_of(learners(api))[0], "Failed", exit_code=2, message=words)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        failed = cond(api, "Failed")
        assert failed["reason"] == "InvalidConfig" and words in failed["message"]
        assert job_status(api)["restarts"] == 0  # not retried


async def test_rollout_pod_failure_replaces_the_server_alone(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        learner_names = names_of(learners(api))
        (victim, _other) = names_of(pods_of(api, "rollout"))
        await kubelet(api, victim, "Failed", exit_code=1)
        await eventually(lambda: job_status(api).get("rolloutReady") == "1/2")
        assert cond(api, "RolloutReady")["status"] == "False"
        await eventually(lambda: len(pods_of(api, "rollout")) == 3, what="a replacement")
        assert names_of(learners(api)) == learner_names
        assert job_status(api)["phase"] == "Running" and job_status(api)["restarts"] == 0
        await run_all(api)
        await eventually(lambda: job_status(api).get("rolloutReady") == "2/2", what="replaced")


async def test_suspend_and_resume(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        await patch_spec(api, {"runPolicy": {"suspend": True}})
        await eventually(lambda: job_status(api).get("phase") == "Suspended", what="Suspended")
        await eventually(lambda: not api.list_kind("Pod", NS), what="every pod gone")
        assert api.get("JobSet", NS, JOB)["spec"]["suspend"] is True
        await patch_spec(api, {"runPolicy": {"suspend": False}})
        await eventually(lambda: len(learners(api)) == 2, what="pods recreated")
        await eventually(lambda: cond(api, "Suspended")["status"] == "False", what="resumed")
        await start_running(api)


async def test_refuse_changes_a_jobset_cannot_take(api, run_operator, progress) -> None:
    api.add(predating_rules(render_crd()))  # no CEL rules: the API server takes the edit
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        await patch_spec(api, {"algorithm": {"learningRate": 0.5}, "rollout": {"replicas": 3}})
        refused = await eventually(lambda: cond(api, "InvalidSpec"), what="refusal")
        assert refused["reason"] == "SpecChangeRefused"
        assert "spec.algorithm.learningRate" in refused["message"]
        assert "spec.rollout.replicas" in refused["message"]
        assert (
            "learningRate: 1.0e-06"
            in api.get("ConfigMap", NS, f"{JOB}-config")["data"]["gspojob.yaml"]
        )
        assert job_status(api)["phase"] == "Running"
        await has_event(api, "Warning", "SpecChangeRefused")
        await patch_spec(api, {"algorithm": {"learningRate": 1e-6}, "rollout": {"replicas": 2}})
        await eventually(lambda: cond(api, "InvalidSpec")["status"] == "False", what="accepted")


async def test_restarting_the_operator_duplicates_nothing(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(learners(api)) == 2)
        await eventually(lambda: job_status(api).get("phase") == "Pending")
    before = {k: sorted(o["metadata"]["uid"] for o in v) for k, v in children(api).items()}
    secret = copy.deepcopy(api.get("Secret", NS, f"{JOB}-job-token"))
    # While the operator is away, the pods start.
    await run_all(api)
    async with run_operator(api):
        await eventually(lambda: job_status(api).get("phase") == "Running", what="Running")
        after = {k: sorted(o["metadata"]["uid"] for o in v) for k, v in children(api).items()}
        assert after == before
        assert api.get("Secret", NS, f"{JOB}-job-token") == secret  # never rotated
        # Deleting the job leaves no orphans (ownerReferences; the stand-in runs the GC) but
        # the checkpoint claim, kept by default (checkpoint.retainClaim).
        await call(api, "DELETE", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}")
        kept = {"PersistentVolumeClaim": 1}
        await eventually(
            lambda: {k: len(v) for k, v in children(api).items() if v} == kept, what="no orphans"
        )
        await eventually(lambda: not api.list_kind("Pod", NS), what="no pods")


async def test_a_jobset_deleted_by_hand_is_recreated(api, run_operator, progress) -> None:
    async with run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        uid = api.get("JobSet", NS, JOB)["metadata"]["uid"]
        await api.delete("JobSet", NS, JOB)
        await eventually(
            lambda: (
                (api.get("JobSet", NS, JOB) or {}).get("metadata", {}).get("uid") not in (None, uid)
            ),
            what="a new JobSet",
        )
        await start_running(api)


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
        # Everything goes with the job but the checkpoint claim (checkpoints, the HF export).
        await eventually(
            lambda: (
                {k: len(v) for k, v in children(api).items() if v} == {"PersistentVolumeClaim": 1}
            ),
            what="no orphans, the claim kept",
        )


async def test_a_cluster_without_the_prometheus_operator_still_runs_jobs(
    run_operator, progress
) -> None:
    async with api_server(without=("PodMonitor",)) as api, run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        await start_running(api)
        await has_event(api, "Normal", "PodMonitorSkipped")
        assert cond(api, "Created")["status"] == "True"


async def test_a_cluster_without_jobset_says_how_to_fix_it(run_operator, progress) -> None:
    async with api_server(without=("JobSet", "Job")) as api, run_operator(api):
        await create(api, tiny_job(progress_port=progress.port))
        created = await eventually(
            lambda: (c := cond(api, "Created")) and c["status"] == "False" and c, what="condition"
        )
        assert created["reason"] == "JobSetMissing" and "install JobSet" in created["message"]
        assert job_status(api)["phase"] == "Pending"
        assert api.get("ConfigMap", NS, f"{JOB}-config") is not None


async def test_a_job_that_cannot_fit_its_gpus_fails_before_any_pod(api, run_operator) -> None:
    """The memory plan before any child exists: one learner GPU of 1 GiB (the node selector's
    GPU feature discovery label) cannot hold even the runtime's allowance. Annotated to allow
    the overcommit, the job starts with a warning event."""
    api.add(predating_rules(render_crd()))
    doc = tiny_job(learner={"gpusPerReplica": 1, "replicas": 1})
    doc["spec"]["runPolicy"]["scheduling"] = {"nodeSelector": {"nvidia.com/gpu.memory": "1024"}}
    async with run_operator(api):
        await create(api, doc)
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        message = cond(api, "InvalidSpec")["message"]
        assert message.startswith("spec.learner: the learner needs ")
        assert "the GPU has 1.0 GiB" in message and "gspo.dev/allow-overcommit" in message
        assert all(not v for v in children(api).values())
        url = f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}"
        annotate = {"metadata": {"annotations": {"gspo.dev/allow-overcommit": "true"}}}
        headers = {"Content-Type": "application/merge-patch+json"}
        await call(api, "PATCH", url, json=annotate, headers=headers)
        await has_event(api, "Warning", "MemoryOvercommit")
        await eventually(lambda: job_status(api).get("phase") == "Pending", what="started")
