"""A learner the kubelet keeps evicting for node memory pressure. The Job's podFailurePolicy
matches the DisruptionTarget condition whatever its reason, so JobSet restarts the group with
RestartJobSetAndIgnoreMaxRestarts every time and never fails it (the JobSet and Job controller
stand-ins do as their sources do); the operator fails the job past
runPolicy.maxDisruptionRestarts and stops its pods."""

from __future__ import annotations

from operator_harness import NS, eventually, pods_of, tiny_job

# What the kubelet's eviction manager writes on a pod it evicts (pkg/kubelet/eviction).
PRESSURE = (
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. "
    "Container learner was using 180Gi, request is 0, has larger consumption of memory. "
)


async def evict(api, pod: dict) -> None:
    await api.patch_status(
        "Pod",
        NS,
        pod["metadata"]["name"],
        {
            "phase": "Failed",
            "reason": "Evicted",
            "message": PRESSURE,
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": PRESSURE,
                }
            ],
        },
    )


def status_of(api) -> dict:
    return (api.get("GSPOJob", NS, "tiny") or {}).get("status") or {}


async def test_a_learner_evicted_again_and_again_fails_past_the_cap(api, run_operator) -> None:
    async with run_operator(api):
        await api_create(api, tiny_job(runPolicy={"backoffLimit": 1, "maxDisruptionRestarts": 2}))
        for attempt in range(3):
            learners = await eventually(
                lambda a=attempt: pods_of(api, "learner", a), what=f"learners of attempt {attempt}"
            )
            await evict(api, learners[0])
            if attempt < 2:  # within the cap: restarted, not failed (and not counted by JobSet)
                await eventually(
                    lambda a=attempt: (
                        api.get("JobSet", NS, "tiny")["status"].get("restarts") == a + 1
                    ),
                    what=f"restart {attempt + 1}",
                )
                assert status_of(api).get("phase") != "Failed"
        st = await eventually(
            lambda: status_of(api).get("phase") == "Failed" and status_of(api),
            what="the job failed past the cap",
        )
        (failed,) = [c for c in st["conditions"] if c["type"] == "Failed"]
        assert failed["reason"] == "DisruptionLimitExceeded", failed
        assert "after 3 disruptions" in failed["message"], failed
        await eventually(lambda: api.get("JobSet", NS, "tiny") is None, what="JobSet deleted")


async def api_create(api, doc: dict) -> None:
    from test_operator_kmock import create

    await create(api, doc)
