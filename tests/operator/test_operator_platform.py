"""What a platform team relies on, against the API stand-in with JobSet's and the Job
controller's stand-ins: API errors reach the job's status, children are never adopted from
another owner and are repaired when changed by hand, finished jobs cost nothing, and no
finalizer holds a deletion while the operator is down."""

from __future__ import annotations

import asyncio

import pytest
from kmock_apiserver import Fault
from operator_harness import NS, api_server, eventually, kubelet, pods_of, run_all, tiny_job
from test_operator_kmock import JOB, call, cond, create, events, has_event, job_status

from gspo_api.progress import LearnerProgress
from gspo_operator import api_errors

QUOTA = (
    'persistentvolumeclaims "tiny-checkpoints" is forbidden: exceeded quota: storage, '
    "requested: requests.storage=1Gi, used: requests.storage=0, limited: requests.storage=0"
)


def phases_seen(api) -> set[str]:
    """Every phase the job's status ever had (the API server's history of the object)."""
    return {
        (obj.get("status") or {}).get("phase")
        for _, key, _, obj in api.history
        if key[2] == "gspojobs" and obj["metadata"]["name"] == JOB
    }


async def created(api) -> None:
    await eventually(lambda: (c := cond(api, "Created")) and c["status"] == "True", what="Created")


# --- API errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plural", "code", "reason", "message", "expect_reason"),
    [
        ("persistentvolumeclaims", 403, "Forbidden", QUOTA, "Forbidden"),
        (
            "networkpolicies",
            404,
            "NotFound",
            "the server could not find the requested resource",
            "NotFound",
        ),
    ],
    ids=["403-quota", "404-kind-not-served"],
)
async def test_a_refusal_that_can_clear_blocks_the_job_until_it_clears(
    run_operator, progress, plural, code, reason, message, expect_reason
) -> None:
    async with api_server() as api, run_operator(api):
        api.faults.append(Fault("POST", plural, code, reason, message))
        await create(api, tiny_job(progress_port=progress.port))
        blocked = await eventually(
            lambda: (c := cond(api, "Blocked")) and c["status"] == "True" and c, what="Blocked"
        )
        assert blocked["reason"] == expect_reason and message in blocked["message"]
        assert job_status(api)["phase"] == "Blocked"
        await has_event(api, "Warning", expect_reason)
        assert not api.list_kind("Pod", NS)  # nothing runs while a child is refused

        api.faults.clear()  # the admin raised the quota / installed the kind
        await created(api)
        await eventually(lambda: cond(api, "Blocked")["status"] == "False", what="unblocked")
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
        assert job_status(api)["phase"] == "Pending"


@pytest.mark.parametrize("secret", ["tiny-job-token", "tiny-sync-token"])
async def test_a_refused_read_of_a_token_secret_blocks_the_job_naming_it(
    run_operator, progress, secret
) -> None:
    """The operator reads the job's Secret by name (Secrets are not watched) and, before
    creating it, the one an earlier release named J-sync-token (its pods may still hold that
    token). RBAC refusing either read blocks the job naming the Secret and the verb, where it
    used to back off and retry with only a log line; nothing runs meanwhile, and once the read
    is allowed the job goes on."""
    message = f'secrets "{secret}" is forbidden: User "gspo" cannot get resource "secrets"'
    async with api_server() as api, run_operator(api):
        api.faults.append(Fault("GET", "secrets", 403, "Forbidden", message, name=secret))
        await create(api, tiny_job(progress_port=progress.port))
        blocked = await eventually(
            lambda: (c := cond(api, "Blocked")) and c["status"] == "True" and c, what="Blocked"
        )
        assert blocked["reason"] == "Forbidden", blocked
        assert f"Secret {secret}" in blocked["message"] and message in blocked["message"]
        assert job_status(api)["phase"] == "Blocked"
        assert not api.list_kind("Pod", NS)

        api.faults.clear()
        await created(api)
        assert api.get("Secret", NS, "tiny-job-token") is not None
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")


async def test_an_invalid_child_422_fails_the_job_with_the_api_servers_words(
    run_operator, progress
) -> None:
    message = (
        'JobSet.jobset.x-k8s.io "tiny" is invalid: spec.replicatedJobs[0].template.spec.template'
        '.spec.affinity.nodeAffinity: Invalid value: "...": a required term is empty'
    )
    async with api_server() as api, run_operator(api):
        api.faults.append(Fault("POST", "jobsets", 422, "Invalid", message))
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: job_status(api).get("phase") == "Failed", what="Failed")
        failed = cond(api, "Failed")
        assert failed["reason"] == "Invalid" and "a required term is empty" in failed["message"]
        await has_event(api, "Warning", "Invalid")
        await asyncio.sleep(0.5)
        assert not api.list_kind("JobSet", NS) and not api.list_kind("Pod", NS)


@pytest.mark.parametrize(
    ("code", "reason", "retry_after_s"),
    [(429, "TooManyRequests", 1), (500, "InternalError", None), (503, "ServiceUnavailable", None)],
)
async def test_throttling_and_server_errors_back_off_and_change_nothing(
    run_operator, progress, code, reason, retry_after_s
) -> None:
    async with api_server() as api, run_operator(api):
        fault = Fault("POST", "configmaps", code, reason, "try later", 2, retry_after_s)
        api.faults.append(fault)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await create(api, tiny_job(progress_port=progress.port))
        await created(api)
        assert fault.times == 0  # both error answers were given, then the create went through
        if retry_after_s:  # the second try waited for Retry-After, however short the backoff
            assert loop.time() - start >= retry_after_s
        assert phases_seen(api) <= {None, "Pending"}
        assert not [e for e in events(api) if e[0] == "Warning"]


def test_verdicts_and_backoff() -> None:
    verdicts = {code: api_errors.classify(code) for code in (0, 400, 403, 404, 409, 422, 429, 503)}
    assert verdicts == {
        0: "transient", 400: "invalid", 403: "blocked", 404: "blocked", 409: "blocked",
        422: "invalid", 429: "transient", 503: "transient",
    }  # fmt: skip
    # Exponential, capped, jittered into [half, whole]; never before Retry-After.
    assert api_errors.backoff_s(1, uniform=lambda: 1.0) == 1.0
    assert api_errors.backoff_s(4, uniform=lambda: 0.0) == 4.0
    assert api_errors.backoff_s(30, uniform=lambda: 1.0) == api_errors.BACKOFF_CAP_S
    assert api_errors.backoff_s(1, retry_after_s=7, uniform=lambda: 1.0) == 7


# --- ownership ------------------------------------------------------------------------------


async def test_an_object_of_another_owner_is_never_adopted(run_operator, progress) -> None:
    async with api_server() as api, run_operator(api):
        stranger = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{JOB}-config", "namespace": NS, "labels": {"team": "a"}},
            "data": {"theirs": "yes"},
        }
        await api.create(stranger)
        await create(api, tiny_job(progress_port=progress.port))
        blocked = await eventually(lambda: cond(api, "Blocked"), what="Blocked")
        assert (
            blocked["reason"] == "Conflict"
            and "not controlled by this GSPOJob" in (blocked["message"])
        )
        await asyncio.sleep(0.5)
        assert api.get("ConfigMap", NS, f"{JOB}-config")["data"] == {"theirs": "yes"}
        assert not api.list_kind("JobSet", NS)

        await call(api, "DELETE", f"/api/v1/namespaces/{NS}/configmaps/{JOB}-config")
        await created(api)
        mine = api.get("ConfigMap", NS, f"{JOB}-config")
        uid = api.get("GSPOJob", NS, JOB)["metadata"]["uid"]
        assert mine["metadata"]["ownerReferences"][0]["uid"] == uid


async def test_children_deleted_or_changed_by_hand_are_put_back(run_operator, progress) -> None:
    async with api_server() as api, run_operator(api, resync_s=0.5):
        await create(api, tiny_job(progress_port=progress.port))
        await created(api)
        await eventually(lambda: api.get("JobSet", NS, JOB), what="JobSet")
        config = api.get("ConfigMap", NS, f"{JOB}-config")
        service = api.get("Service", NS, f"{JOB}-rollout-api")
        policy = api.get("NetworkPolicy", NS, f"{JOB}-pods")

        # Changed by hand: the fields the operator sets come back, the API server's stay.
        await api.patch("ConfigMap", NS, f"{JOB}-config", {"data": {"config.yaml": "x: 1"}})
        ports = [{"name": "http", "port": 1234, "protocol": "TCP"}]
        await api.patch("Service", NS, f"{JOB}-rollout-api", {"spec": {"ports": ports}})
        await api.patch("NetworkPolicy", NS, f"{JOB}-pods", {"spec": {"ingress": []}})
        await eventually(
            lambda: api.get("ConfigMap", NS, f"{JOB}-config")["data"] == config["data"],
            what="ConfigMap repaired",
        )
        await eventually(
            lambda: (
                api.get("Service", NS, f"{JOB}-rollout-api")["spec"]["ports"]
                == service["spec"]["ports"]
            ),
            what="Service repaired",
        )
        await eventually(
            lambda: api.get("NetworkPolicy", NS, f"{JOB}-pods")["spec"] == policy["spec"],
            what="NetworkPolicy repaired",
        )

        # Deleted by hand: every kind is created again (Secrets and PodMonitors, which no
        # watch covers, at the next resync).
        gone = {
            "ConfigMap": f"{JOB}-config",
            "Secret": f"{JOB}-job-token",
            "Service": f"{JOB}-rollout",
            "PersistentVolumeClaim": f"{JOB}-checkpoints",
            "NetworkPolicy": f"{JOB}-pods",
            "PodMonitor": JOB,
            "JobSet": JOB,
        }
        before = {kind: api.get(kind, NS, name)["metadata"]["uid"] for kind, name in gone.items()}
        for kind, name in gone.items():
            await api.delete(kind, NS, name)
        for kind, name in gone.items():
            await eventually(
                lambda kind=kind, name=name: (
                    (o := api.get(kind, NS, name)) and o["metadata"]["uid"] != before[kind]
                ),
                what=f"{kind} {name} re-created",
            )


async def test_a_child_deleted_before_the_watch_showed_it_is_created_again(
    run_operator, progress
) -> None:
    """The API server's watch can lag its writes: the operator counts what it created as
    there until its watch shows it. One deleted before that (the watch then shows its
    creation and deletion together) is created again at once, not when that memory expires
    (30 s later)."""
    async with api_server() as api, run_operator(api):
        async with api.lagging("configmaps"):
            await create(api, tiny_job(progress_port=progress.port))
            made = await eventually(
                lambda: api.get("ConfigMap", NS, f"{JOB}-config"), what="ConfigMap created"
            )
            await eventually(lambda: api.get("JobSet", NS, JOB), what="JobSet")
            await api.delete("ConfigMap", NS, f"{JOB}-config")
        await eventually(
            lambda: (
                (o := api.get("ConfigMap", NS, f"{JOB}-config"))
                and o["metadata"]["uid"] != made["metadata"]["uid"]
            ),
            timeout_s=10.0,
            what="ConfigMap created again",
        )


# --- event-driven, no finalizer -------------------------------------------------------------


async def test_a_running_job_costs_no_api_request_and_a_finished_one_no_poll(
    run_operator, progress
) -> None:
    async with api_server() as api, run_operator(api) as ctx:
        progress.value = LearnerProgress(step=3, policy_version=3)
        await create(api, tiny_job(progress_port=progress.port))
        await eventually(lambda: len(pods_of(api, "learner")) == 2, what="learner pods")
        await run_all(api)
        await eventually(lambda: job_status(api).get("step") == 3, what="step 3")

        # Running, nothing changing: the learner is polled, the API server is not asked.
        requests, polled = ctx.kube.requests_total, progress.polls
        await asyncio.sleep(1.5)
        assert ctx.kube.requests_total == requests
        assert progress.polls > polled

        # Finished: neither the API server nor the learner hears from the operator again.
        for pod in pods_of(api, "learner"):
            await kubelet(api, pod["metadata"]["name"], "Succeeded", exit_code=0)
        await eventually(lambda: job_status(api).get("phase") == "Succeeded", what="Succeeded")
        await asyncio.sleep(0.5)
        requests, polled = ctx.kube.requests_total, progress.polls
        await asyncio.sleep(1.5)
        assert (ctx.kube.requests_total, progress.polls) == (requests, polled)


async def test_no_finalizer_so_deleting_with_the_operator_down_never_hangs(
    run_operator, progress
) -> None:
    async with api_server() as api:
        async with run_operator(api):
            await create(api, tiny_job(progress_port=progress.port))
            await created(api)
            assert not api.get("GSPOJob", NS, JOB)["metadata"].get("finalizers")
        # The operator is down: the job goes at once, and its children with it.
        await call(api, "DELETE", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/{JOB}")
        assert api.get("GSPOJob", NS, JOB) is None
        assert not api.list_kind("ConfigMap", NS) and not api.list_kind("JobSet", NS)


async def test_the_finalizer_of_older_releases_is_removed(run_operator, progress) -> None:
    async with api_server() as api:
        doc = tiny_job(progress_port=progress.port)
        doc["metadata"]["finalizers"] = ["gspo.dev/finalizer"]
        await create(api, doc)
        async with run_operator(api):
            await eventually(
                lambda: not api.get("GSPOJob", NS, JOB)["metadata"].get("finalizers"),
                what="the old finalizer removed",
            )
