"""Dynamic provisioning in the local cluster: StorageClasses, the PV controller and CSI
provisioners that refuse the access modes their driver does not support.

A claim the cluster cannot provision stays Pending for ever, and nothing on the claim but its
Events says why. This stand-in makes the claims of the local cluster behave so: a claim binds
only on a class whose driver supports its access modes, and otherwise stays Pending with the
Events a real cluster records. Written from (the drivers' sources read at the commits named;
the PV controller's and external-provisioner's messages checked against `kubectl describe
pvc` output recorded on PD, EBS and EFS clusters, their sources not read at a pinned version):
- kubernetes pkg/controller/volume/persistentvolume/pv_controller.go: a claim without
  a class and no default class gets Warning FailedBinding "no persistent volumes available for
  this claim and no storage class is set"; a class that does not exist, Warning
  ProvisioningFailed `storageclass.storage.k8s.io "<name>" not found`; a class with
  volumeBindingMode WaitForFirstConsumer, Normal WaitForFirstConsumer "waiting for first
  consumer to be created before binding" until a pod uses the claim; then Normal
  ExternalProvisioning "Waiting for a volume to be created either by the external provisioner
  '<provisioner>' or manually by the system administrator. ..." and the annotation
  volume.kubernetes.io/storage-provisioner. A claim without storageClassName gets the default
  class (annotation storageclass.kubernetes.io/is-default-class: "true"), as the
  DefaultStorageClass admission plugin and the retroactive default assignment (1.28+) do.
- kubernetes-csi/external-provisioner (pkg/controller/controller.go) with
  sig-storage-lib-external-provisioner (controller/controller.go): Normal Provisioning
  `External provisioner is provisioning volume for claim "<ns>/<name>"`; on a CreateVolume
  error Warning ProvisioningFailed `failed to provision volume with StorageClass "<class>":
  <gRPC error>`, retried with exponential backoff (--retry-interval-start 1 s, doubling, up to
  --retry-interval-max 5 min) and aggregated by the event recorder (count, lastTimestamp);
  on success a PersistentVolume `pvc-<claim uid>` (capacity, access modes, claimRef, class,
  csi.driver, reclaim policy from the class), Normal ProvisioningSucceeded "Successfully
  provisioned volume pvc-<uid>", and the claim Bound (spec.volumeName, status.phase,
  accessModes, capacity). Access modes map to CSI access modes as it maps them
  (ReadWriteOnce SINGLE_NODE_WRITER, ReadWriteMany MULTI_NODE_MULTI_WRITER, ReadOnlyMany
  MULTI_NODE_READER_ONLY, ReadWriteOncePod SINGLE_NODE_SINGLE_WRITER), mount access type
  (volumeMode Filesystem).
- The drivers' CreateVolume checks of those modes (DRIVERS): GCE PD CSI
  (kubernetes-sigs/gcp-compute-persistent-disk-csi-driver b560165c, Aug 2026, after v1.26:
  pkg/gce-pd-csi-driver/utils.go validateVolumeCapability) refuses multi-writer with mount
  access: `rpc error: code = InvalidArgument desc = VolumeCapabilities is invalid: specified
  multi writer with mount access type`; AWS EBS CSI (kubernetes-sigs/aws-ebs-csi-driver
  v1.64.0, pkg/driver/controller.go isValidCapability) accepts SINGLE_NODE_WRITER alone for
  mounts: `rpc error: code = InvalidArgument desc = Volume capabilities not supported`;
  Filestore CSI (filestore.csi.storage.gke.io) and EFS CSI (efs.csi.aws.com) serve
  ReadWriteOnce, ReadOnlyMany and ReadWriteMany. `local.gspo.dev` is the local cluster's own
  (every mode: the kubelet stand-in shares one directory per claim).

Not modelled: pre-provisioned PersistentVolumes and binding to them (every claim is
provisioned), volumeMode Block (so EBS's io2 multi-attach and PD's multi-writer block
volumes), capacity limits (Filestore's 1 TiB minimum, EBS's per-type maximums), topology and
the selected-node annotation's node (WaitForFirstConsumer waits for any pod that names the
claim, scheduled or not), deletion and the reclaim policy's effect on the disk, expansion,
snapshots and data sources, the provisioner's leader election and retries after success.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from dataclasses import dataclass
from typing import Any

import kmock
from apiserver import ClusterApiServer
from reconciler import Reconciler

Obj = dict[str, Any]

DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROVISIONER_ANNOTATION = "volume.kubernetes.io/storage-provisioner"
PV_CONTROLLER = "persistentvolume-controller"
RETRY_START_S, RETRY_MAX_S = 1.0, 300.0  # external-provisioner's --retry-interval-start/-max
# external-provisioner's getAccessMode (controller.go): Kubernetes mode -> CSI mode.
CSI_MODES = {
    "ReadWriteOnce": "SINGLE_NODE_WRITER",
    "ReadWriteMany": "MULTI_NODE_MULTI_WRITER",
    "ReadOnlyMany": "MULTI_NODE_READER_ONLY",
    "ReadWriteOncePod": "SINGLE_NODE_SINGLE_WRITER",
}


@dataclass(frozen=True)
class Driver:
    """A CSI driver's answer to CreateVolume for a mounted (Filesystem) volume."""

    name: str
    modes: frozenset[str]  # Kubernetes access modes it provisions
    refusal: str  # the gRPC error it returns for any other mode


RWO_ROX_RWX = frozenset({"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"})
DRIVERS = {
    d.name: d
    for d in (
        Driver(
            "pd.csi.storage.gke.io",
            frozenset({"ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"}),
            "rpc error: code = InvalidArgument desc = VolumeCapabilities is invalid: "
            "specified multi writer with mount access type",
        ),
        Driver(
            "ebs.csi.aws.com",
            frozenset({"ReadWriteOnce"}),
            "rpc error: code = InvalidArgument desc = Volume capabilities not supported",
        ),
        Driver("filestore.csi.storage.gke.io", RWO_ROX_RWX, ""),
        Driver("efs.csi.aws.com", RWO_ROX_RWX, ""),
        Driver("local.gspo.dev", frozenset({*RWO_ROX_RWX, "ReadWriteOncePod"}), ""),
    )
}


def storage_class(
    name: str,
    provisioner: str,
    *,
    default: bool = False,
    binding: str = "Immediate",
    reclaim: str = "Delete",
) -> Obj:
    meta: Obj = {"name": name}
    if default:
        meta["annotations"] = {DEFAULT_CLASS_ANNOTATION: "true"}
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": meta,
        "provisioner": provisioner,
        "reclaimPolicy": reclaim,
        "volumeBindingMode": binding,
    }


# The classes a stock cluster has (GKE: standard-rwo, the PD default, and the Filestore
# classes of its Filestore CSI add-on; EKS: gp2 by default, efs-sc as EFS's docs create it).
GKE_CLASSES = [
    storage_class(
        "standard-rwo", "pd.csi.storage.gke.io", default=True, binding="WaitForFirstConsumer"
    ),
    storage_class("standard-rwx", "filestore.csi.storage.gke.io", binding="WaitForFirstConsumer"),
]
EKS_CLASSES = [
    storage_class("gp2", "ebs.csi.aws.com", default=True, binding="WaitForFirstConsumer"),
    storage_class("efs-sc", "efs.csi.aws.com"),
]
LOCAL_CLASSES = [storage_class("local", "local.gspo.dev", default=True)]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StorageController(Reconciler):
    """The PV controller and one external provisioner per driver, over every claim."""

    def __init__(self, api: ClusterApiServer, *, period_s: float = 0.1) -> None:
        super().__init__(api, period_s)
        self._retry: dict[str, tuple[float, float]] = {}  # claim uid -> (next try, interval)
        self._events: dict[tuple[str, str], str] = {}  # (claim uid, reason) -> Event name

    async def sync_all(self) -> None:
        await self.sync_each("PersistentVolumeClaim", self.sync_claim)

    async def sync_claim(self, claim: Obj) -> None:
        meta, spec = claim["metadata"], claim.get("spec") or {}
        if (claim.get("status") or {}).get("phase") == "Bound" or meta.get("deletionTimestamp"):
            return
        name = spec.get("storageClassName")
        if name is None:
            default = self._default_class()
            if default is None:
                message = (
                    "no persistent volumes available for this claim and no storage class is set"
                )
                await self._event(claim, "Warning", "FailedBinding", message, PV_CONTROLLER)
                return
            name = default["metadata"]["name"]
            await self.api.patch(
                "PersistentVolumeClaim",
                meta["namespace"],
                meta["name"],
                {"spec": {"storageClassName": name}},
            )
        sc = self.api.get("StorageClass", "", name) if name else None
        if sc is None:
            if name:
                message = f'storageclass.storage.k8s.io "{name}" not found'
                await self._event(claim, "Warning", "ProvisioningFailed", message, PV_CONTROLLER)
            else:
                message = (
                    "no persistent volumes available for this claim and no storage class is set"
                )
                await self._event(claim, "Warning", "FailedBinding", message, PV_CONTROLLER)
            return
        if sc.get("volumeBindingMode") == "WaitForFirstConsumer" and not self._consumed(claim):
            message = "waiting for first consumer to be created before binding"
            await self._event(claim, "Normal", "WaitForFirstConsumer", message, PV_CONTROLLER)
            return
        provisioner = sc["provisioner"]
        if (meta.get("annotations") or {}).get(PROVISIONER_ANNOTATION) != provisioner:
            await self.api.patch(
                "PersistentVolumeClaim",
                meta["namespace"],
                meta["name"],
                {"metadata": {"annotations": {PROVISIONER_ANNOTATION: provisioner}}},
            )
        message = (
            f"Waiting for a volume to be created either by the external provisioner "
            f"'{provisioner}' or manually by the system administrator. If volume creation is "
            "delayed, please verify that the provisioner is running and correctly registered."
        )
        await self._event(claim, "Normal", "ExternalProvisioning", message, PV_CONTROLLER)
        driver = DRIVERS.get(provisioner)
        if driver is not None:  # a provisioner this cluster does not run: Pending for ever
            await self._provision(claim, sc, driver)

    async def _provision(self, claim: Obj, sc: Obj, driver: Driver) -> None:
        meta = claim["metadata"]
        loop_now = time.monotonic()
        next_try, interval = self._retry.get(meta["uid"], (0.0, RETRY_START_S))
        if loop_now < next_try:
            return
        source = f"{driver.name}_local-node_{uuid.uuid5(uuid.NAMESPACE_DNS, driver.name).hex[:8]}"
        message = (
            f'External provisioner is provisioning volume for claim "{meta["namespace"]}/'
            f'{meta["name"]}"'
        )
        await self._event(claim, "Normal", "Provisioning", message, source)
        modes = list((claim.get("spec") or {}).get("accessModes") or [])
        refused = [m for m in modes if m not in driver.modes]
        if refused:
            self._retry[meta["uid"]] = (loop_now + interval, min(interval * 2, RETRY_MAX_S))
            message = (
                f'failed to provision volume with StorageClass "{sc["metadata"]["name"]}": '
                f"{driver.refusal}"
            )
            await self._event(claim, "Warning", "ProvisioningFailed", message, source)
            return
        await self._bind(claim, sc, driver, source)

    async def _bind(self, claim: Obj, sc: Obj, driver: Driver, source: str) -> None:
        meta, spec = claim["metadata"], claim.get("spec") or {}
        volume = f"pvc-{meta['uid']}"
        size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": volume,
                "annotations": {"pv.kubernetes.io/provisioned-by": driver.name},
            },
            "spec": {
                "capacity": {"storage": size},
                "accessModes": list(spec.get("accessModes") or []),
                "persistentVolumeReclaimPolicy": sc.get("reclaimPolicy", "Delete"),
                "storageClassName": sc["metadata"]["name"],
                "volumeMode": spec.get("volumeMode", "Filesystem"),
                "csi": {"driver": driver.name, "volumeHandle": volume},
                "claimRef": {
                    "kind": "PersistentVolumeClaim",
                    "apiVersion": "v1",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        with contextlib.suppress(kmock.KubernetesError):  # made by an earlier pass
            await self.api.create(pv)
        await self.api.patch_status("PersistentVolume", "", volume, {"phase": "Bound"})
        message = f"Successfully provisioned volume {volume}"
        await self._event(claim, "Normal", "ProvisioningSucceeded", message, source)
        await self.api.patch(
            "PersistentVolumeClaim",
            meta["namespace"],
            meta["name"],
            {"spec": {"volumeName": volume}},
        )
        await self.api.patch_status(
            "PersistentVolumeClaim",
            meta["namespace"],
            meta["name"],
            {
                "phase": "Bound",
                "accessModes": list(spec.get("accessModes") or []),
                "capacity": {"storage": size},
            },
        )
        self._retry.pop(meta["uid"], None)

    def _default_class(self) -> Obj | None:
        defaults = [
            sc
            for sc in self.api.list_kind("StorageClass")
            if (sc["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
        ]
        # Several defaults: Kubernetes (1.26+) takes the newest.
        return max(
            defaults, key=lambda sc: sc["metadata"].get("creationTimestamp", ""), default=None
        )

    def _consumed(self, claim: Obj) -> bool:
        meta = claim["metadata"]
        for pod in self.api.list_kind("Pod", meta["namespace"]):
            for vol in (pod.get("spec") or {}).get("volumes") or []:
                if (vol.get("persistentVolumeClaim") or {}).get("claimName") == meta["name"]:
                    return True
        return False

    async def _event(
        self, claim: Obj, type_: str, reason: str, message: str, component: str
    ) -> None:
        """A core/v1 Event on the claim; a repeat of the same one bumps its count, as the
        event recorder's aggregation does."""
        meta = claim["metadata"]
        key = (meta["uid"], reason)
        now = _now()
        name = self._events.get(key)
        existing = self.api.get("Event", meta["namespace"], name) if name else None
        if existing is not None and existing.get("message") == message:
            if type_ == "Warning":  # progress Events are recorded once per claim here
                await self.api.patch(
                    "Event",
                    meta["namespace"],
                    existing["metadata"]["name"],
                    {"count": int(existing.get("count") or 1) + 1, "lastTimestamp": now},
                )
            return
        name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
        self._events[key] = name
        await self.api.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": type_,
                "reason": reason,
                "message": message,
                "source": {"component": component},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )
