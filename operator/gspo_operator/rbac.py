"""Every permission the operator needs, as ClusterRole rules: the chart's ClusterRole must grant
exactly these (a contract test compares them).

Grouped by who makes the call: kopf itself (watching GSPOJobs, storing its progress in
annotations, posting Events, observing CRDs and namespaces) and `kube` (the children).
"""

from __future__ import annotations

from gspo_api.spec import API_GROUP

Rule = dict[str, list[str]]

RULES: list[Rule] = [
    # kopf: discover the CRD and the namespaces to watch.
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # kopf: Events on every transition.
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    # A Pending checkpoint claim's reason is in its Events (the provisioner's message).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
    # kopf watches and annotates jobs; `ttlSecondsAfterFinished` deletes them.
    {
        "apiGroups": [API_GROUP],
        "resources": ["gspojobs"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    {
        "apiGroups": [API_GROUP],
        "resources": ["gspojobs/status"],
        "verbs": ["get", "patch", "update"],
    },
    # Every child's controller ownerReference sets blockOwnerDeletion; with the admission
    # plugin OwnerReferencesPermissionEnforcement (OpenShift) that needs update on the owner's
    # finalizers subresource (kubernetes plugin/pkg/admission/gc/gc_admission.go).
    {"apiGroups": [API_GROUP], "resources": ["gspojobs/finalizers"], "verbs": ["update"]},
    # The children (reconcile.py). Watched (list, watch) with a label selector so a change or
    # deletion by hand is seen at once; created, read back by name when the name is taken
    # (to check its owner) and repaired with a patch. JobSet runs, restarts and stops the pods;
    # the operator only reads them, suspends/resumes or deletes the JobSet. Secrets and
    # PodMonitors are read by name, never listed.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["jobset.x-k8s.io"],
        "resources": ["jobsets"],
        "verbs": ["create", "get", "list", "watch", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps", "services", "persistentvolumeclaims"],
        "verbs": ["create", "get", "list", "watch", "patch"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["create", "get", "list", "watch", "patch"],
    },
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get", "patch"]},
    {
        "apiGroups": ["monitoring.coreos.com"],
        "resources": ["podmonitors"],
        "verbs": ["create", "get", "patch"],
    },
    # Kueue's Workload of a queued JobSet: listed by its job-uid label to report why the job
    # waits, and patched (spec.active) to suspend or resume it the way Kueue expects.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list", "patch"]},
]


def allows(rules: list[Rule], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules
    )
