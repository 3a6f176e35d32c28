"""Two jobs whose child names meet: JobSet uses any Service named like its subdomain,
whoever owns it (createHeadlessSvcIfNecessary, jobset_controller.go; the JobSet stand-in does
the same), so job `exp-rollout` would take job `exp`'s rollout Service for its pods' DNS.
The operator creates that Service itself and refuses a name another object holds."""

from __future__ import annotations

from operator_harness import NS, eventually, tiny_job

from gspo_api.validation import parse_spec
from gspo_operator import names, reconcile, render
from gspo_operator.children import ChildView
from gspo_operator.kube import Kube


def status_of(api, job: str) -> dict:
    return (api.get("GSPOJob", NS, job) or {}).get("status") or {}


def blocked(api, job: str) -> str | None:
    st = status_of(api, job)
    if st.get("phase") != "Blocked":
        return None
    (cond,) = [c for c in st["conditions"] if c["type"] == "Blocked"]
    return f"{cond['reason']}: {cond['message']}"


async def create(api, doc: dict) -> None:
    from test_operator_kmock import create as post

    await post(api, doc)


def config_map_of(job: dict) -> dict:
    """The job's ConfigMap, as the operator renders it."""
    objects = render.render_job(job, parse_spec(job["spec"]), token="unused")
    return next(o for o in objects if o["kind"] == "ConfigMap")


async def test_a_job_named_like_another_jobs_service_is_refused(api, run_operator) -> None:
    async with run_operator(api):
        # exp's rollout Service first, then a job whose pods' Service would have that name.
        await create(api, tiny_job("exp"))
        await eventually(lambda: api.get("JobSet", NS, "exp"), what="exp's JobSet")
        await create(api, tiny_job("exp-rollout"))
        why = await eventually(lambda: blocked(api, "exp-rollout"), what="exp-rollout Blocked")
        assert why.startswith("Conflict: Service exp-rollout already exists and is not "), why
        assert api.get("JobSet", NS, "exp-rollout") is None  # no JobSet took exp's Service
        service = api.get("Service", NS, names.rollout_headless_service("exp"))
        assert service["spec"]["selector"] == names.selector("exp", names.ROLLOUT)

        # The other order: the pods' Service first, then the job whose rollout Service it is.
        await create(api, tiny_job("run-rollout"))
        await eventually(lambda: api.get("JobSet", NS, "run-rollout"), what="the JobSet")
        await create(api, tiny_job("run"))
        why = await eventually(lambda: blocked(api, "run"), what="run Blocked")
        assert "Service run-rollout already exists" in why, why
        assert status_of(api, "exp").get("phase") != "Blocked"
        assert status_of(api, "run-rollout").get("phase") != "Blocked"


async def test_a_kept_claim_is_not_taken_by_the_next_job_of_that_name(api, run_operator) -> None:
    """The checkpoint claim outlives its job (retainClaim, the default); a new job of the same
    name is told how to resume from it rather than silently writing into it."""
    from test_operator_kmock import call

    claim = names.checkpoint_claim("exp")
    async with run_operator(api):
        await create(api, tiny_job("exp"))
        await eventually(lambda: api.get("JobSet", NS, "exp"), what="exp's JobSet")
        await call(api, "DELETE", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/exp")
        await eventually(lambda: api.get("JobSet", NS, "exp") is None, what="JobSet gone")
        assert api.get("PersistentVolumeClaim", NS, claim) is not None

        await create(api, tiny_job("exp"))
        # Until the garbage collector has deleted every other child of the old job, one of
        # those may be what blocks it first.
        why = await eventually(
            lambda: "PersistentVolumeClaim" in (blocked(api, "exp") or "") and blocked(api, "exp"),
            what="the new exp Blocked by the kept claim",
        )
        assert why.startswith(f"Conflict: PersistentVolumeClaim {claim} already exists and is ")
        assert "an earlier GSPOJob of this name keeps its checkpoint claim" in why, why
        assert f"to resume from its checkpoints set spec.checkpoint.claimName: {claim}," in why
        assert "delete that claim (its checkpoints go with it)" in why
        await call(api, "DELETE", f"/apis/gspo.dev/v1alpha1/namespaces/{NS}/gspojobs/exp")
        await eventually(lambda: api.get("GSPOJob", NS, "exp") is None, what="exp gone")
        await create(api, tiny_job("exp", checkpoint={"claimName": claim}))
        await eventually(lambda: api.get("JobSet", NS, "exp"), what="the resumed job's JobSet")
        assert blocked(api, "exp") is None


async def test_an_earlier_jobs_config_map_is_not_the_new_jobs_accepted_spec(
    api, run_operator
) -> None:
    """Deleted and re-created with another spec while the garbage collector has not yet deleted
    the old job's ConfigMap: the new job runs its own spec, not the old one's."""
    old = tiny_job("exp", algorithm={**tiny_job()["spec"]["algorithm"], "learningRate": 0.5})
    old["metadata"].update(namespace=NS, uid="uid-of-the-deleted-exp")
    leftover = config_map_of(old)
    leftover["metadata"]["finalizers"] = ["example.com/hold"]  # the collector is not done yet
    await api.create(leftover)
    async with run_operator(api):
        await create(api, tiny_job("exp"))
        why = await eventually(lambda: blocked(api, "exp"), what="Blocked by the leftover")
        cm = names.config_map("exp")
        earlier = f"Conflict: ConfigMap {cm} belongs to an earlier GSPOJob of this name"
        assert why.startswith(earlier), why
        conditions = {c["type"]: c for c in status_of(api, "exp")["conditions"]}
        assert "InvalidSpec" not in conditions, conditions["InvalidSpec"]["message"]
        patch = {"metadata": {"finalizers": None}}  # the collector catches up
        await api.patch("ConfigMap", NS, names.config_map("exp"), patch)
        await eventually(lambda: api.get("JobSet", NS, "exp"), what="exp's JobSet")
        data = api.get("ConfigMap", NS, names.config_map("exp"))["data"]
        assert "learningRate: 0.5" not in next(iter(data.values()))


def test_a_child_just_made_for_an_earlier_job_of_the_name_is_not_the_new_jobs() -> None:
    """The operator remembers what it created until its watch shows it; a child of a job that
    was deleted (its children collected before the watch showed them) is no child of the next
    job of that name."""

    ctx = reconcile.Context(kube=Kube.for_host("http://127.0.0.1:1"))
    old = tiny_job("exp")
    old["metadata"].update(namespace=NS, uid="uid-of-the-deleted-exp")
    config_map = config_map_of(old)
    reconcile._expect(ctx, (NS, "exp"), config_map, created=True)
    assert reconcile._children_seen(ctx, (NS, "exp"), "uid-of-the-deleted-exp")  # its own
    assert reconcile._children_seen(ctx, (NS, "exp"), "uid-of-the-new-exp") == {}


async def test_what_an_earlier_job_of_the_name_saw_by_name_is_not_the_new_jobs() -> None:
    """Secrets are not watched: the operator reads them by name and counts what it created as
    there until the next resync. A job deleted and created again under its name must not
    inherit that view: the earlier job's Secret, deleted by the garbage collector with no
    event, blocked the new job as a stranger's until the resync (10 minutes by default)."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "exp-job-token"}}
    stored: dict[str, dict] = {}

    class Kube:
        async def get(self, api_version: str, kind: str, namespace: str, name: str):
            return stored.get(name)

    ctx = reconcile.Context(kube=Kube(), resync_s=600.0)
    assert await reconcile._unwatched_children(ctx, (NS, "exp"), "uid-old", [secret]) == {}
    # The earlier job created it (counted as there); deleted with its job since.
    seen = await reconcile._unwatched_children(ctx, (NS, "exp"), "uid-old", [secret])
    assert seen[("Secret", "exp-job-token")] is not None
    assert await reconcile._unwatched_children(ctx, (NS, "exp"), "uid-new", [secret]) == {}


def test_a_child_of_an_earlier_job_of_the_name_is_named_as_such() -> None:
    """The garbage collector deletes a deleted job's children after it (background
    propagation, kubectl's default): a job created again at once meets them, and is told
    that it goes on once they are gone, not to delete a stranger's object."""
    owner = {"apiVersion": "gspo.dev/v1alpha1", "kind": "GSPOJob", "name": "exp",
             "uid": "uid-old", "controller": True}  # fmt: skip
    earlier = {"kind": "Secret", "metadata": {"name": "exp-job-token", "ownerReferences": [owner]}}
    message = reconcile._foreign("Secret exp-job-token", ChildView.from_object(earlier), "exp")
    assert "belongs to an earlier GSPOJob of this name (uid uid-old)" in message, message
    assert "goes on once Secret exp-job-token is gone" in message
    stranger = {**owner, "name": "other"}
    other = {
        "kind": "Secret",
        "metadata": {"name": "exp-job-token", "ownerReferences": [stranger]},
    }
    message = reconcile._foreign("Secret exp-job-token", ChildView.from_object(other), "exp")
    assert "is not controlled by this GSPOJob" in message


def test_a_hand_edit_before_the_watch_showed_the_create_is_not_hidden_by_it() -> None:
    """What the operator created counts as there until its watch shows it. An edit by hand
    that the watch shows first (the object changed before the operator saw its ADDED event)
    is what exists: the operator repairs it now, not 30 s later when its memory expires."""
    ctx = reconcile.Context(kube=Kube.for_host("http://127.0.0.1:1"))
    job = tiny_job("exp")
    job["metadata"].update(namespace=NS, uid="uid-exp")
    made = config_map_of(job)
    reconcile._expect(ctx, (NS, "exp"), made, created=True)
    edited = ChildView.from_object({**made, "data": {"config.yaml": "x: 1"}})
    ctx.indices = {"children": {(NS, "exp"): [edited]}}
    seen = reconcile._children_seen(ctx, (NS, "exp"), "uid-exp")
    assert seen[("ConfigMap", names.config_map("exp"))] == edited


def test_a_child_repaired_then_deleted_is_missing_once_the_watch_shows_the_deletion() -> None:
    """What the operator repaired counts as repaired until its watch shows the repair. A
    deletion the watch shows first ends that: the child is missing (created again at the
    next reconcile), not repaired and there for 30 s more."""
    ctx = reconcile.Context(kube=Kube.for_host("http://127.0.0.1:1"))
    job = tiny_job("exp")
    job["metadata"].update(namespace=NS, uid="uid-exp")
    repaired = config_map_of(job)
    reconcile._expect(ctx, (NS, "exp"), repaired, created=False)
    child = ("ConfigMap", names.config_map("exp"))
    assert child in reconcile._children_seen(ctx, (NS, "exp"), "uid-exp")  # the watch lags
    reconcile.child_deleted(ctx, (NS, "exp"), child)
    assert reconcile._children_seen(ctx, (NS, "exp"), "uid-exp") == {}
