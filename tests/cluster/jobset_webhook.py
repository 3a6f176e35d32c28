"""JobSet's admission webhook for the local cluster: defaulting and validation of JobSets.

Written from kubernetes-sigs/jobset (snapshot 08dfbdfd, Aug 2026): pkg/webhooks/jobset_webhook.go
(Default, ValidateCreate, ValidateUpdate, validateFailurePolicy, validateCoordinator),
api/jobset/v1alpha2/jobset_types.go (CRD defaults and CEL rules), pkg/features/features.go
(gates) and pkg/util/placement/placement.go (job and pod name formats); the DNS checks follow
k8s.io/apimachinery/pkg/util/validation (IsDNS1035Label, IsDNS1123Subdomain, IsValidLabelValue)
and the error text follows apimachinery's field.Error / apierrors.NewInvalid formatting. Without
a webhook nothing defaults `network.enableDNSHostnames`, and the JobSet controller then creates
no headless Service and sets no pod subdomain: that is why the local cluster needs this module.

Implemented:
- `default_jobset` (the mutating webhook, plus the CRD's structural defaults that the API server
  applies before it: replicatedJobs[].groupName "default", replicatedJobs[].replicas 1,
  failurePolicy.restartStrategy "Recreate"): successPolicy {operator: All}, startupPolicy
  {startupPolicyOrder: AnyOrder}, every replicated Job's completionMode Indexed and pod
  restartPolicy OnFailure when unset, network.enableDNSHostnames and publishNotReadyAddresses
  true, failure policy rule names "failurePolicyRule<i>", volume claim retention Delete.
- `validate_jobset` (ValidateCreate with default feature gates: InPlaceRestart, RestartJob and
  ElasticJobSet off): InPlaceRestart strategy refused; dependsOn on the first replicated Job;
  subdomain (RFC 1123 subdomain and RFC 1035 label, too-long message rewritten as JobSet does);
  managedBy (domain-prefixed path, at most 63 characters); replicas*parallelism <= MaxInt32;
  groupName as an RFC 1035 label; the longest generated Job name `<js>-<rjob>-<replicas-1>`
  as an RFC 1035 label; for Indexed replicated Jobs with completions, the longest pod name
  `<js>-<rjob>-<replicas-1>-<completions-1>-abcde` (the 5-character random suffix included, so
  the deterministic part may be at most 57 characters); dependsOn names an earlier replicated
  Job; successPolicy targets exist; failure policy: RestartJob / RestartJobAndIgnoreMaxRestarts
  refused unless `restart_job_gate` (then replicas <= 1024), rule names (length 1..128, regex,
  unique), target replicated Jobs exist, onJobFailureReasons among the Job failure reasons;
  coordinator (replicated Job exists, job/pod index in range, Indexed with completions, label
  value valid). The CRD enum checks on failure policy actions and successPolicy operator are
  applied too (the API server does them before the webhook).
- `validate_jobset_update(old, new)`: replicatedJobs immutable (pod template labels,
  annotations, nodeSelector, tolerations and schedulingGates may change while the old or new
  JobSet is suspended), managedBy immutable, and the CRD's CEL "Value is immutable" rules on
  network, successPolicy, failurePolicy, startupPolicy and volumeClaimPolicies. The stand-in
  API server runs admission on create only, so nothing calls this on updates yet.
- `admit(obj)`: an admission hook for `ClusterApiServer.admission`; for kind JobSet it defaults
  the object in place (as the mutating webhook does) and returns the refusal message that
  kube-apiserver would send (`JobSet.jobset.x-k8s.io "<name>" is invalid: ...`), else None.
  `make_admit(restart_job_gate=True)` gives the hook with the RestartJob gate on.

Not implemented: volumeClaimPolicies validation (it reads existing PVCs), the in-place restart
and elastic-JobSet validations (their gates are off by default), JobSet's pod webhook
(exclusive placement), generateName on JobSets (names are validated as given).

The Job (batch/v1) checks kube-apiserver itself makes are in job_controller.py
(`default_job`, `validate_job`, `admit_job`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_CONTROLLER_NAME = "jobset.sigs.k8s.io/jobset-controller"
MAX_INT32 = 2**31 - 1
MAX_REPLICAS_WITH_RESTART_JOB = 1024

FAILURE_ACTIONS = (
    "FailJobSet",
    "RestartJobSet",
    "RestartJobSetAndIgnoreMaxRestarts",
    "RestartJob",
    "RestartJobAndIgnoreMaxRestarts",
)
RESTART_JOB_ACTIONS = ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
# The reasons of a batch/v1 Job's Failed condition that a failure policy rule may name.
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)

JOB_NAME_TOO_LONG = (
    "JobSet name is too long, job names generated for this JobSet will exceed 63 characters"
)
POD_NAME_TOO_LONG = (
    "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters"
)
SUBDOMAIN_TOO_LONG = ".spec.network.subdomain is too long, must be less than 63 characters"
GROUP_NAME_TOO_LONG = ".spec.replicatedJob[].groupName is too long, must be less than 63 characters"
RESTART_JOB_GATE_OFF = (
    "RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed "
    "when RestartJob feature gate is disabled"
)

_DNS1035_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL_FMT + "(\\." + _DNS1123_LABEL_FMT + ")*"
_LABEL_VALUE_FMT = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_RULE_NAME_FMT = "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
_HTTP_PATH_FMT = "^[A-Za-z0-9/\\-._~%!$&'()*+,;=:]+$"


# --- apimachinery's validation messages ---------------------------------------------------------


def _max_len_error(n: int) -> str:
    """apimachinery's MaxLenError text."""
    return f"must be no more than {n} characters"


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    """apimachinery's RegexError text, the examples joined exactly as it joins them."""
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    msg += " (e.g. "
    for i, example in enumerate(examples):
        if i:
            msg += " or "
        msg += f"'{example}', "
    return msg + f"regex used for validation is '{fmt}')"


def is_dns1035_label(value: str) -> list[str]:
    """RFC 1035 label: what Service names and JobSet's generated Job and pod names must be."""
    errs = []
    if len(value) > 63:
        errs.append(_max_len_error(63))
    if not re.fullmatch(_DNS1035_FMT, value):
        errs.append(
            _regex_error(
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                "start with an alphabetic character, and end with an alphanumeric character",
                _DNS1035_FMT,
                "my-name",
                "abc-123",
            )
        )
    return errs


def is_dns1123_subdomain(value: str) -> list[str]:
    """RFC 1123 subdomain: object names, and the pod subdomain JobSet sets."""
    errs = []
    if len(value) > 253:
        errs.append(_max_len_error(253))
    if not re.fullmatch(_DNS1123_SUBDOMAIN_FMT, value):
        errs.append(
            _regex_error(
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                "characters, '-' or '.', and must start and end with an alphanumeric character",
                _DNS1123_SUBDOMAIN_FMT,
                "example.com",
            )
        )
    return errs


def is_valid_label_value(value: str) -> list[str]:
    """A label value (the coordinator label carries a hostname.subdomain)."""
    errs = []
    if len(value) > 63:
        errs.append(_max_len_error(63))
    if not re.fullmatch(_LABEL_VALUE_FMT, value):
        errs.append(
            _regex_error(
                "a valid label must be an empty string or consist of alphanumeric characters, "
                "'-', '_' or '.', and must start and end with an alphanumeric character",
                _LABEL_VALUE_FMT,
                "MyValue",
                "my_value",
                "12345",
            )
        )
    return errs


def _go_value(value: Any) -> str:
    """How field.Invalid prints a bad value (strings quoted, null for a nil pointer)."""
    if value is None:
        return "null"
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def invalid(path: str, value: Any, detail: str) -> str:
    """field.Invalid(path, value, detail).Error()."""
    return f"{path}: Invalid value: {_go_value(value)}: {detail}"


def internal(message: str) -> str:
    """A plain error, which JobSet's webhook wraps as field.InternalError(nil, err)."""
    return f"<nil>: Internal error: {message}"


def invalid_message(kind: str, name: str, errors: list[str]) -> str:
    """apierrors.NewInvalid(...).Error(): the message a refused create carries."""
    unique = list(dict.fromkeys(errors))
    body = unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"
    return f'{kind} "{name}" is invalid: {body}'


# --- names JobSet generates (pkg/util/placement) ------------------------------------------------


def job_name(jobset_name: str, rjob_name: str, job_index: int) -> str:
    """The name JobSet gives each child Job."""
    return f"{jobset_name}-{rjob_name}-{job_index}"


def pod_name_prefix(jobset_name: str, rjob_name: str, job_index: int, pod_index: int) -> str:
    """The deterministic part of a child pod's name (its hostname, too)."""
    return f"{jobset_name}-{rjob_name}-{job_index}-{pod_index}"


# --- defaulting -----------------------------------------------------------------------------------


def default_jobset(obj: Obj) -> Obj:
    """Apply the CRD defaults and JobSet's mutating webhook to `obj`, in place; return it."""
    spec = obj.setdefault("spec", {})
    for rjob in spec.get("replicatedJobs") or []:
        # CRD structural defaults (kubebuilder:default), applied before any webhook runs.
        rjob.setdefault("groupName", "default")
        rjob.setdefault("replicas", 1)
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        if not job_spec.get("completionMode"):
            job_spec["completionMode"] = "Indexed"
        pod_spec = job_spec.setdefault("template", {}).setdefault("spec", {})
        if not pod_spec.get("restartPolicy"):
            pod_spec["restartPolicy"] = "OnFailure"
    if spec.get("successPolicy") is None:
        spec["successPolicy"] = {"operator": "All"}
    if spec.get("startupPolicy") is None:
        spec["startupPolicy"] = {"startupPolicyOrder": "AnyOrder"}
    network = spec.get("network")
    if network is None:
        network = spec["network"] = {}
    if network.get("enableDNSHostnames") is None:
        network["enableDNSHostnames"] = True
    if network.get("publishNotReadyAddresses") is None:
        network["publishNotReadyAddresses"] = True
    policy = spec.get("failurePolicy")
    if policy is not None:
        policy.setdefault("restartStrategy", "Recreate")  # CRD default
        for i, rule in enumerate(policy.get("rules") or []):
            if not rule.get("name"):
                rule["name"] = f"failurePolicyRule{i}"
    for claim_policy in spec.get("volumeClaimPolicies") or []:
        if claim_policy.get("retentionPolicy") is None:
            claim_policy["retentionPolicy"] = {"whenDeleted": "Delete"}
    return obj


# --- validation -----------------------------------------------------------------------------------


def validate_jobset(obj: Obj, restart_job_gate: bool = False) -> list[str]:
    """ValidateCreate of JobSet's webhook (plus the CRD enums): the refusals, as field errors."""
    errs: list[str] = []
    name = obj.get("metadata", {}).get("name", "")
    spec = obj.get("spec") or {}
    rjobs = spec.get("replicatedJobs") or []
    policy = spec.get("failurePolicy")

    if policy is not None and policy.get("restartStrategy") == "InPlaceRestart":
        errs.append(
            internal(
                "InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate "
                "is disabled"
            )
        )
    if rjobs and rjobs[0].get("dependsOn") is not None:
        errs.append(internal("DependsOn can't be set for the first ReplicatedJob"))

    subdomain = (spec.get("network") or {}).get("subdomain") or ""
    if subdomain:
        path = "spec.network.subdomain"
        errs += [invalid(path, subdomain, m) for m in is_dns1123_subdomain(subdomain)]
        for m in is_dns1035_label(subdomain):
            errs.append(invalid(path, subdomain, SUBDOMAIN_TOO_LONG if "no more than" in m else m))

    managed_by = spec.get("managedBy")
    if managed_by is not None:
        errs += _validate_domain_prefixed_path("spec.managedBy", managed_by)
        if len(managed_by) > 63:
            errs.append("spec.managedBy: Too long: may not be more than 63 bytes")

    names: list[str] = []
    for i, rjob in enumerate(rjobs):
        path = f"spec.replicatedJobs[{i}]"
        rname = rjob.get("name", "")
        names.append(rname)
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        replicas = int(rjob.get("replicas", 1))
        parallelism = job_spec.get("parallelism")
        parallelism = 1 if parallelism is None else int(parallelism)
        if parallelism * replicas > MAX_INT32:
            errs.append(
                internal(
                    f"the product of replicas and parallelism must not exceed {MAX_INT32} "
                    f"for replicatedJob '{rname}'"
                )
            )
        group = rjob.get("groupName", "default")
        for m in is_dns1035_label(group):
            message = GROUP_NAME_TOO_LONG if "no more than" in m else m
            errs.append(invalid(f"{path}.groupName", group, message))
        longest_job = job_name(name, rname, replicas - 1)
        for m in is_dns1035_label(longest_job):
            message = JOB_NAME_TOO_LONG if "no more than" in m else m
            errs.append(invalid(f"{path}.name", longest_job, message))
        completions = job_spec.get("completions")
        if job_spec.get("completionMode") == "Indexed" and completions is not None:
            longest_pod = pod_name_prefix(name, rname, replicas - 1, int(completions) - 1)
            for m in is_dns1035_label(longest_pod + "-abcde"):
                message = POD_NAME_TOO_LONG if "no more than" in m else m
                # JobSet reports the longest Job name as the bad value here, as it does.
                errs.append(invalid(f"{path}.name", longest_job, message))
        for dep in rjob.get("dependsOn") or []:
            if dep.get("name") not in names:
                errs.append(
                    internal(
                        f"replicatedJob: {rname} cannot depend on replicatedJob: {dep.get('name')}"
                    )
                )

    success = spec.get("successPolicy") or {}
    if success.get("operator") not in ("All", "Any"):
        errs.append(
            f"spec.successPolicy.operator: Unsupported value: {_go_value(success.get('operator'))}"
            ': supported values: "All", "Any"'
        )
    for target in success.get("targetReplicatedJobs") or []:
        if target not in names:
            errs.append(
                internal(
                    f"invalid replicatedJob name '{target}' does not appear in .spec.ReplicatedJobs"
                )
            )

    if policy is not None:
        errs += _validate_failure_policy(policy, rjobs, names, restart_job_gate)

    coordinator = spec.get("coordinator")
    if coordinator is not None:
        message = _validate_coordinator(coordinator, rjobs)
        if message:
            errs.append(internal(message))
        subdomain_or_name = subdomain or name
        value = (
            f"{name}-{coordinator.get('replicatedJob')}-{coordinator.get('jobIndex', 0)}-"
            f"{coordinator.get('podIndex', 0)}.{subdomain_or_name}"
        )
        label_errs = is_valid_label_value(value)
        if label_errs:
            errs.append(
                internal(
                    f'spec will lead to invalid label value "{value}" for coordinator label '
                    '"jobset.sigs.k8s.io/coordinator" (long JobSet / ReplicatedJob / SubDomain '
                    f"name?): {', '.join(label_errs)}"
                )
            )
    return errs


def _validate_domain_prefixed_path(path: str, value: str) -> list[str]:
    """IsDomainPrefixedPath, simplified: "<RFC 1123 subdomain>/<http path>"."""
    host, slash, rest = value.partition("/")
    if not slash:
        return [invalid(path, value, 'must be a domain-prefixed path (such as "acme.io/foo")')]
    errs = [invalid(path, host, m) for m in is_dns1123_subdomain(host)]
    if not re.fullmatch(_HTTP_PATH_FMT, "/" + rest):
        errs.append(invalid(path, rest, "Invalid path"))
    return errs


def _validate_failure_policy(
    policy: Obj, rjobs: list[Obj], names: list[str], restart_job_gate: bool
) -> list[str]:
    """validateFailurePolicy (plus the CRD's action enum)."""
    errs: list[str] = []
    rules = policy.get("rules") or []
    for i, rule in enumerate(rules):
        if rule.get("action") not in FAILURE_ACTIONS:  # the CRD's enum
            supported = ", ".join(f'"{a}"' for a in FAILURE_ACTIONS)
            errs.append(
                f"spec.failurePolicy.rules[{i}].action: Unsupported value: "
                f"{_go_value(rule.get('action'))}: supported values: {supported}"
            )
    if any(rule.get("action") in RESTART_JOB_ACTIONS for rule in rules):
        if not restart_job_gate:
            return [*errs, internal(RESTART_JOB_GATE_OFF)]
        if any(int(r.get("replicas", 1)) > MAX_REPLICAS_WITH_RESTART_JOB for r in rjobs):
            errs.append(
                internal(
                    "JobSet cannot have a failure policy rule with RestartJob or "
                    "RestartJobAndIgnoreMaxRestarts action and a replicated job with replicas > "
                    f"{MAX_REPLICAS_WITH_RESTART_JOB}"
                )
            )
    seen: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        rule_name = rule.get("name", "")
        if not 1 <= len(rule_name) <= 128:
            errs.append(
                internal(
                    f"invalid failure policy rule name of length {len(rule_name)}, the rule name "
                    "must be at least 1 characters long and at most 128 characters long"
                )
            )
        seen.setdefault(rule_name, []).append(i)
        if not re.match(_RULE_NAME_FMT, rule_name):
            errs.append(
                internal(
                    f"invalid failure policy rule name '{rule_name}', a failure policy rule name "
                    "must start with an alphabetic character, optionally followed by a string of "
                    "alphanumeric characters or '_,:', and must end with an alphanumeric "
                    "character or '_'"
                )
            )
        for target in rule.get("targetReplicatedJobs") or []:
            if target not in names:
                errs.append(
                    internal(
                        f"invalid replicatedJob name '{target}' in failure policy does not "
                        "appear in .spec.ReplicatedJobs"
                    )
                )
        for reason in rule.get("onJobFailureReasons") or []:
            if reason not in JOB_FAILURE_REASONS:
                errs.append(
                    internal(
                        f"invalid job failure reason '{reason}' in failure policy is not a "
                        "recognized job failure reason"
                    )
                )
    for rule_name, indexes in seen.items():
        if len(indexes) > 1:
            listed = "[" + " ".join(str(i) for i in indexes) + "]"
            errs.append(
                internal(
                    f"rule names are not unique, rules with indices {listed} all have the same "
                    f"name '{rule_name}'"
                )
            )
    return errs


def _validate_coordinator(coordinator: Obj, rjobs: list[Obj]) -> str | None:
    """validateCoordinator: the coordinator pod must exist in an Indexed replicated Job."""
    target = coordinator.get("replicatedJob")
    rjob = next((r for r in rjobs if r.get("name") == target), None)
    if rjob is None:
        return f"coordinator replicatedJob {target} does not exist"
    job_index = int(coordinator.get("jobIndex", 0))
    if not 0 <= job_index < int(rjob.get("replicas", 1)):
        return f"coordinator job index {job_index} is invalid for replicatedJob {target}"
    job_spec = (rjob.get("template") or {}).get("spec") or {}
    completions = job_spec.get("completions")
    if job_spec.get("completionMode") != "Indexed" or completions is None:
        return (
            "job for coordinator pod must be indexed completion mode, and completions number "
            "must be set"
        )
    pod_index = int(coordinator.get("podIndex", 0))
    if not 0 <= pod_index < int(completions):
        return (
            f"coordinator pod index {pod_index} is invalid for replicatedJob {target} "
            f"job index {job_index}"
        )
    return None


_TEMPLATE_MUTABLE_WHEN_SUSPENDED = (
    ("metadata", "annotations"),
    ("metadata", "labels"),
    ("spec", "nodeSelector"),
    ("spec", "tolerations"),
    ("spec", "schedulingGates"),
)
_CEL_IMMUTABLE = (
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "volumeClaimPolicies",
)


def validate_jobset_update(old: Obj, new: Obj) -> list[str]:
    """ValidateUpdate of JobSet's webhook plus the CRD's CEL immutability rules."""
    errs: list[str] = []
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    for field in _CEL_IMMUTABLE:
        if field in old_spec and old_spec.get(field) != new_spec.get(field):
            errs.append(f'spec.{field}: Invalid value: "object": Value is immutable')
    munged = copy.deepcopy(new_spec.get("replicatedJobs") or [])
    old_by_name = {r.get("name"): r for r in old_spec.get("replicatedJobs") or []}
    if old_spec.get("suspend") or new_spec.get("suspend"):
        for rjob in munged:
            before = old_by_name.get(rjob.get("name"))
            if before is None:
                continue
            pod_now = (
                rjob.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {})
            )
            pod_before = ((before.get("template") or {}).get("spec") or {}).get("template") or {}
            for part, key in _TEMPLATE_MUTABLE_WHEN_SUSPENDED:
                value = (pod_before.get(part) or {}).get(key)
                section = pod_now.setdefault(part, {})
                if value is None:
                    section.pop(key, None)
                else:
                    section[key] = copy.deepcopy(value)
                if not section:
                    pod_now.pop(part)
    if munged != (old_spec.get("replicatedJobs") or []):
        errs.append(invalid("spec.replicatedJobs", munged, "field is immutable"))
    if new_spec.get("managedBy") != old_spec.get("managedBy"):
        errs.append(invalid("spec.managedBy", new_spec.get("managedBy"), "field is immutable"))
    return errs


# --- the admission hook ---------------------------------------------------------------------------


def make_admit(restart_job_gate: bool = False) -> Callable[[Obj], str | None]:
    """An admission hook for `ClusterApiServer.admission` with the given RestartJob gate."""

    def admit_jobset(obj: Obj) -> str | None:
        """Default the JobSet in place, then refuse it with the validation errors, if any."""
        if obj.get("kind") != "JobSet" or obj.get("apiVersion") != JOBSET_API_VERSION:
            return None
        default_jobset(obj)
        errors = validate_jobset(obj, restart_job_gate=restart_job_gate)
        if not errors:
            return None
        name = obj.get("metadata", {}).get("name", "")
        return invalid_message("JobSet.jobset.x-k8s.io", name, errors)

    return admit_jobset


def admit(obj: Obj) -> str | None:
    """JobSet's webhooks as an admission hook (default feature gates): default, then validate."""
    return make_admit()(obj)
