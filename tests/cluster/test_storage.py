"""The storage stand-in: a claim binds only on a class whose driver supports its access modes,
and otherwise stays Pending with the provisioner's Event (messages from the sources named in
storage.py); then the flagship example's checkpoint claim on stock GKE classes, end to end
through the operator: it binds on the Filestore class the example names, and on the PD
default class the job's status says why it waits."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from apiserver import ClusterApiServer
from checkout import REPO
from operator_harness import (
    NS,
    _keep_running,
    api_server,
    eventually,
    flagship_priority_class,
    operator,
)
from storage import EKS_CLASSES, GKE_CLASSES, StorageController

Obj = dict[str, Any]
EXAMPLE = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())


@pytest.fixture
async def api() -> AsyncIterator[ClusterApiServer]:
    async with ClusterApiServer() as server:
        yield server


def claim(name: str, modes: list[str], cls: str | None = None) -> Obj:
    spec: Obj = {"accessModes": modes, "resources": {"requests": {"storage": "2Ti"}}}
    if cls is not None:
        spec["storageClassName"] = cls
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def consumer(claim_name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"uses-{claim_name}", "namespace": NS},
        "spec": {
            "containers": [{"name": "c", "image": "x"}],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim_name}}],
        },
    }


def events(api: ClusterApiServer, name: str) -> list[tuple[str, str, str]]:
    return [
        (e["type"], e["reason"], e["message"])
        for e in api.list_kind("Event", NS)
        if e["involvedObject"]["name"] == name
    ]


def phase(api: ClusterApiServer, name: str) -> str | None:
    return (api.get("PersistentVolumeClaim", NS, name) or {}).get("status", {}).get("phase")


async def test_claims_bind_only_where_the_driver_supports_their_access_modes(api) -> None:
    for sc in [*GKE_CLASSES, *EKS_CLASSES]:
        api.add(copy.deepcopy(sc))
    storage = StorageController(api)
    cases = {
        "rwx-on-pd": claim("rwx-on-pd", ["ReadWriteMany"]),  # GKE's default class: PD
        "rwx-on-filestore": claim("rwx-on-filestore", ["ReadWriteMany"], "standard-rwx"),
        "rwx-on-ebs": claim("rwx-on-ebs", ["ReadWriteMany"], "gp2"),
        "rwx-on-efs": claim("rwx-on-efs", ["ReadWriteMany"], "efs-sc"),
        "rwo-on-ebs": claim("rwo-on-ebs", ["ReadWriteOnce"], "gp2"),
        "no-such-class": claim("no-such-class", ["ReadWriteOnce"], "fast"),
    }
    for obj in cases.values():
        api.add(obj)
    await storage.sync_all()
    # WaitForFirstConsumer classes wait for a pod that names the claim.
    assert (
        "Normal",
        "WaitForFirstConsumer",
        "waiting for first consumer to be created before binding",
    ) in events(api, "rwx-on-filestore")
    assert phase(api, "rwx-on-filestore") is None
    for name in ("rwx-on-pd", "rwx-on-filestore", "rwx-on-ebs", "rwo-on-ebs"):
        api.add(consumer(name))
    for _ in range(3):
        await storage.sync_all()

    for name in ("rwx-on-filestore", "rwx-on-efs", "rwo-on-ebs"):
        assert phase(api, name) == "Bound", (name, events(api, name))
        bound = api.get("PersistentVolumeClaim", NS, name)
        pv = api.get("PersistentVolume", "", bound["spec"]["volumeName"])
        assert pv["spec"]["claimRef"]["uid"] == bound["metadata"]["uid"]
        assert pv["spec"]["accessModes"] == bound["status"]["accessModes"]
    assert api.get("PersistentVolumeClaim", NS, "rwx-on-pd")["spec"]["storageClassName"] == (
        "standard-rwo"
    )  # the default class, as the DefaultStorageClass admission plugin sets it
    refused = {
        "rwx-on-pd": 'failed to provision volume with StorageClass "standard-rwo": rpc error: '
        "code = InvalidArgument desc = VolumeCapabilities is invalid: specified multi writer "
        "with mount access type",
        "rwx-on-ebs": 'failed to provision volume with StorageClass "gp2": rpc error: code = '
        "InvalidArgument desc = Volume capabilities not supported",
        "no-such-class": 'storageclass.storage.k8s.io "fast" not found',
    }
    for name, message in refused.items():
        assert phase(api, name) is None, name
        assert ("Warning", "ProvisioningFailed", message) in events(api, name), events(api, name)


async def test_without_a_default_class_a_claim_without_one_waits_with_the_reason(api) -> None:
    api.add(claim("plain", ["ReadWriteOnce"]))
    await StorageController(api).sync_all()
    message = "no persistent volumes available for this claim and no storage class is set"
    assert events(api, "plain") == [("Warning", "FailedBinding", message)]


@contextlib.asynccontextmanager
async def gke_cluster() -> AsyncIterator[ClusterApiServer]:
    """The operator's API stand-in with JobSet, the Job controller and GKE's storage."""
    async with api_server() as server:
        for sc in GKE_CLASSES:
            server.add(copy.deepcopy(sc))
        server.add(flagship_priority_class())
        stop = asyncio.Event()
        storage = StorageController(server)
        task = asyncio.create_task(_keep_running(storage, stop))
        try:
            yield server
        finally:
            stop.set()
            await task
        assert not storage.errors, storage.errors


def flagship(name: str, **checkpoint: Any) -> Obj:
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["checkpoint"].update(checkpoint)
    return doc


async def test_the_flagship_claim_binds_on_filestore_and_pd_says_why_not() -> None:
    from test_operator_kmock import create

    def running_condition(job: str) -> dict:
        st = (api.get("GSPOJob", NS, job) or {}).get("status") or {}
        return next((c for c in st.get("conditions") or [] if c["type"] == "Running"), {})

    async with gke_cluster() as api, operator(api):
        assert EXAMPLE["spec"]["checkpoint"]["storageClassName"] == "standard-rwx"
        await create(api, flagship("math"))
        # The default class (PD) cannot make the ReadWriteMany claim two learner pods share.
        await create(api, flagship("math-pd", storageClassName="standard-rwo"))
        await eventually(lambda: phase(api, "math-checkpoints") == "Bound", what="Filestore")
        cond = await eventually(
            lambda: (
                running_condition("math-pd").get("reason") == "ClaimPending"
                and running_condition("math-pd")
            ),
            what="math-pd's claim reason in its status",
        )
        assert cond["message"] == (
            "checkpoint claim math-pd-checkpoints is Pending: ProvisioningFailed: failed to "
            'provision volume with StorageClass "standard-rwo": rpc error: code = '
            "InvalidArgument desc = VolumeCapabilities is invalid: specified multi writer with "
            "mount access type"
        )
        assert running_condition("math").get("reason") != "ClaimPending"


async def test_pods_wait_for_their_claim_to_bind(tmp_path) -> None:
    """The node's scheduler (volume_binding) holds a pod until its claims are Bound: on the PD
    class the ReadWriteMany claim never binds and the pod says so; on Filestore it runs."""
    from kubelet import ProcessKubelet
    from netns import unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(f"the local cluster's node needs network namespaces: {reason}")
    async with ClusterApiServer() as api:
        for sc in GKE_CLASSES:
            api.add(copy.deepcopy(sc))
        node = ProcessKubelet(api, tmp_path / "node", volume_binding=True)
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(node.run(stop)),
            asyncio.create_task(_keep_running(StorageController(api), stop)),
        ]
        try:
            for name, cls in (("on-pd", "standard-rwo"), ("on-filestore", "standard-rwx")):
                await api.create(claim(name, ["ReadWriteMany"], cls))
                pod = consumer(name)
                pod["spec"]["restartPolicy"] = "Never"
                pod["spec"]["containers"][0]["command"] = ["python", "-c", "print('wrote')"]
                await api.create(pod)

            def scheduled(name: str) -> dict:
                st = (api.get("Pod", NS, f"uses-{name}") or {}).get("status") or {}
                return next(
                    (c for c in st.get("conditions") or [] if c["type"] == "PodScheduled"), {}
                )

            await eventually(
                lambda: (
                    (api.get("Pod", NS, "uses-on-filestore") or {}).get("status", {}).get("phase")
                    == "Succeeded"
                ),
                what="the pod on Filestore ran",
            )
            cond = await eventually(
                lambda: scheduled("on-pd").get("status") == "False" and scheduled("on-pd"),
                what="the pod on PD unschedulable",
            )
            assert cond["message"] == (
                "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
            )
            assert phase(api, "on-pd") is None and phase(api, "on-filestore") == "Bound"
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await node.close()
