"""Reading and checking GSPOJob manifests: the operator's checks, and `gspo validate`'s.

`check_job` is exactly what the operator runs before it creates anything, so a manifest that
`gspo validate` passes is one the operator accepts. `ClusterPolicy` is what the cluster admin
set in the chart's values; the operator reads it from its environment at start-up and refuses
to start on a value it cannot use, naming the chart value (a typo must not silently widen
access).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gspo_api.spec import API_GROUP, API_VERSION, KIND, GSPOJobSpec
from gspo_api.validation import Problem, SpecError, check_spec, parse_spec
from gspo_operator import names
from gspo_operator.gpu_requests import check_gpu_requests
from gspo_operator.memory_check import check_memory, overcommit_allowed

API = f"{API_GROUP}/{API_VERSION}"
ENV_ALLOW_HOST_PATH = "GSPO_ALLOW_HOST_PATH"
ENV_RESTART_JOB_GATE = "GSPO_JOBSET_RESTART_JOB_GATE"
ENV_METRICS_FROM = "GSPO_METRICS_FROM"  # JSON list of NetworkPolicyPeers
ENV_OPERATOR_NAMESPACE = "GSPO_OPERATOR_NAMESPACE"  # the downward API's metadata.namespace
ENV_OPERATOR_POD_LABELS = "GSPO_OPERATOR_POD_LABELS"  # JSON object: the operator pods' labels
ENV_ALLOWED_IMAGES = "GSPO_ALLOWED_IMAGES"  # JSON list of image prefixes or glob patterns
ENV_ALLOWED_PRIORITY_CLASSES = "GSPO_ALLOWED_PRIORITY_CLASSES"  # JSON list of names
ENV_POD_MONITOR_LABELS = "GSPO_POD_MONITOR_LABELS"  # JSON object: labels of each job's PodMonitor

Peer = dict[str, Any]  # a NetworkPolicyPeer: namespaceSelector and/or podSelector

PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}  # prometheus-operator's label
# Who may scrape the jobs' metrics ports unless the admin says otherwise: Prometheus pods in
# any namespace (the chart's default networkPolicy.metricsFrom is the same peer).
DEFAULT_METRICS_FROM: tuple[Peer, ...] = (
    {"namespaceSelector": {}, "podSelector": {"matchLabels": PROMETHEUS_POD_LABELS}},
)
# The chart's operator pods carry this label (its selector labels); without the operator's
# exact identity in the environment (`gspo render`, tests), the NetworkPolicy admits such pods.
DEFAULT_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "gspo-operator"}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace since 1.21

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_PEER_KEYS = ("namespaceSelector", "podSelector")


class PolicyError(ValueError):
    """A chart value (passed as an environment variable) the operator cannot use.

    The operator refuses to start on one rather than guess: a misspelt selector that admitted
    nobody would break every job's status, one that admitted everybody would undo the policy.
    """

    def __init__(self, env: str, source: str, message: str) -> None:
        self.env, self.source = env, source
        super().__init__(
            f"${env} (from {source}) {message}; fix it in the chart's values and upgrade the "
            "release"
        )


@dataclass(frozen=True)
class ClusterPolicy:
    """What the cluster admin allows (the chart's values, passed to the operator as env).

    Frozen but holding dicts (the NetworkPolicy peers): not hashable, and callers must copy
    a peer before changing it (`render` does).
    """

    allow_host_path: bool = False  # hostPath volumes give pods a node's filesystem
    restart_job_gate: bool = False  # the cluster's JobSet runs with the RestartJob feature gate
    # Who, besides the job's own pods, reaches the learner's metrics port and the rollout
    # port (both serve /metrics): the chart value networkPolicy.metricsFrom.
    metrics_from: tuple[Peer, ...] = DEFAULT_METRICS_FROM
    # The operator reads each learner's /progress on the metrics port, so its own pods are
    # always admitted there: these say which pods those are.
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = field(
        default_factory=lambda: dict(DEFAULT_OPERATOR_POD_LABELS)
    )
    allowed_images: tuple[str, ...] = ()  # prefixes or globs; empty: any image
    allowed_priority_classes: tuple[str, ...] = ()  # empty: any PriorityClass
    # Labels each job's PodMonitor carries so the cluster's Prometheus selects it
    # (kube-prometheus-stack's selects `release: <its Helm release>` and ignores the rest):
    # the chart values monitoring.labels and monitoring.podMonitorLabels.
    pod_monitor_labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ClusterPolicy:
        """The policy the chart passed; PolicyError naming the chart value when one is bad."""

        def on(name: str) -> bool:
            return env.get(name, "").lower() in ("1", "true", "yes")

        metrics_from = DEFAULT_METRICS_FROM
        if env.get(ENV_METRICS_FROM, "").strip():
            metrics_from = parse_peers(env[ENV_METRICS_FROM])
        namespace = env.get(ENV_OPERATOR_NAMESPACE, "").strip() or None
        if namespace is not None and not _is_dns_label(namespace):
            raise PolicyError(
                ENV_OPERATOR_NAMESPACE,
                "the Deployment's downward API, metadata.namespace",
                f"is {namespace!r}, not a namespace name",
            )
        labels: Mapping[str, str] = DEFAULT_OPERATOR_POD_LABELS
        if env.get(ENV_OPERATOR_POD_LABELS, "").strip():
            labels = parse_operator_labels(env[ENV_OPERATOR_POD_LABELS])
        return cls(
            allow_host_path=on(ENV_ALLOW_HOST_PATH),
            restart_job_gate=on(ENV_RESTART_JOB_GATE),
            metrics_from=metrics_from,
            operator_namespace=namespace,
            operator_pod_labels=dict(labels),
            allowed_images=_parse_names(
                env.get(ENV_ALLOWED_IMAGES, ""), ENV_ALLOWED_IMAGES, "policy.allowedImages"
            ),
            allowed_priority_classes=_parse_names(
                env.get(ENV_ALLOWED_PRIORITY_CLASSES, ""),
                ENV_ALLOWED_PRIORITY_CLASSES,
                "policy.allowedPriorityClasses",
            ),
            pod_monitor_labels=parse_pod_monitor_labels(env.get(ENV_POD_MONITOR_LABELS, "")),
        )

    def operator_peer(self) -> Peer:
        """The operator's pods as a NetworkPolicyPeer: in its own namespace when known (the
        chart passes it), else pods with its labels in any namespace."""
        namespaces: Peer = {}
        if self.operator_namespace:
            namespaces = {"matchLabels": {NAMESPACE_NAME_LABEL: self.operator_namespace}}
        return {
            "namespaceSelector": namespaces,
            "podSelector": {"matchLabels": dict(self.operator_pod_labels)},
        }


def _is_dns_label(text: str) -> bool:
    return len(text) <= 63 and _DNS_LABEL.fullmatch(text) is not None


def _label_key_problem(key: object) -> str | None:
    """Why `key` is not a Kubernetes label key ([prefix/]name), or None."""
    if not isinstance(key, str):
        return f"label key {key!r} must be a string"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"label key {key!r}: the prefix must be a DNS subdomain"
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return (
            f"label key {key!r}: the name must be 1-63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def _label_value_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"label value {value!r} must be a string (quote it in YAML)"
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        return (
            f"label value {value!r} must be at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def _labels_problem(labels: object) -> str | None:
    if not isinstance(labels, Mapping):
        return f"must be a mapping of label keys to values, got {type(labels).__name__}"
    for key, value in labels.items():
        if (why := _label_key_problem(key) or _label_value_problem(value)) is not None:
            return why
    return None


def _selector_problems(selector: object, where: str) -> list[str]:
    """A LabelSelector's problems, each prefixed with where it is ({} selects everything)."""
    if not isinstance(selector, Mapping):
        return [f"{where}: must be a label selector (matchLabels / matchExpressions)"]
    out = []
    for key in selector:
        if key not in ("matchLabels", "matchExpressions"):
            out.append(f"{where}.{key}: unknown field; use matchLabels or matchExpressions")
    if "matchLabels" in selector and (why := _labels_problem(selector["matchLabels"])):
        out.append(f"{where}.matchLabels: {why}")
    expressions = selector.get("matchExpressions", [])
    if not isinstance(expressions, list):
        return [*out, f"{where}.matchExpressions: must be a list"]
    for i, expr in enumerate(expressions):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping):
            out.append(f"{at}: must be a mapping with key, operator and values")
            continue
        if extra := sorted(set(expr) - {"key", "operator", "values"}):
            out.append(f"{at}: unknown field(s) {', '.join(map(str, extra))}")
        if (why := _label_key_problem(expr.get("key"))) is not None:
            out.append(f"{at}.key: {why}")
        op, values = expr.get("operator"), expr.get("values") or []
        if op not in _SELECTOR_OPERATORS:
            out.append(f"{at}.operator: {op!r} must be one of {', '.join(_SELECTOR_OPERATORS)}")
        elif not isinstance(values, list):
            out.append(f"{at}.values: must be a list of strings")
        elif op in ("In", "NotIn") and not values:
            out.append(f"{at}.values: {op} needs at least one value")
        elif op in ("Exists", "DoesNotExist") and values:
            out.append(f"{at}.values: {op} takes no values; remove them")
        elif bad := [v for v in values if _label_value_problem(v)]:
            out.append(f"{at}.values: {_label_value_problem(bad[0])}")
    return out


def peer_problems(peers: object) -> list[str]:
    """Why `peers` is not a list of NetworkPolicyPeers with namespace and/or pod selectors.

    ipBlock is refused: the metrics ports are scraped by pods, and an address range would
    outlive the pods it was written for.
    """
    if not isinstance(peers, list):
        return [f"must be a list of peers (namespaceSelector / podSelector), got {peers!r}"]
    out = []
    for i, peer in enumerate(peers):
        if not isinstance(peer, Mapping):
            out.append(f"[{i}]: must be a mapping with namespaceSelector and/or podSelector")
            continue
        if extra := sorted(set(peer) - set(_PEER_KEYS)):
            out.append(
                f"[{i}]: unknown field(s) {', '.join(map(str, extra))}; a peer has "
                "namespaceSelector and/or podSelector"
            )
        if not any(k in peer for k in _PEER_KEYS):
            out.append(
                f"[{i}]: names no pods; give namespaceSelector and/or podSelector "
                "(namespaceSelector: {} is every namespace)"
            )
        for key in _PEER_KEYS:
            if key in peer:
                out.extend(_selector_problems(peer[key], f"[{i}].{key}"))
    return out


def parse_peers(text: str) -> tuple[Peer, ...]:
    """$GSPO_METRICS_FROM: the chart value networkPolicy.metricsFrom as JSON."""
    source = "the chart value networkPolicy.metricsFrom"
    try:
        peers = json.loads(text)
    except ValueError as exc:
        raise PolicyError(ENV_METRICS_FROM, source, f"is not JSON: {exc}") from exc
    if problems := peer_problems(peers):
        raise PolicyError(ENV_METRICS_FROM, source, "is wrong: " + "; ".join(problems))
    return tuple(json.loads(json.dumps(p)) for p in peers)  # plain, private copies


def parse_operator_labels(text: str) -> dict[str, str]:
    """$GSPO_OPERATOR_POD_LABELS: the operator pods' labels, as a JSON object (non-empty: an
    empty selector would admit every pod of the operator's namespace)."""
    source = "the chart's selector labels"
    try:
        labels = json.loads(text)
    except ValueError as exc:
        raise PolicyError(ENV_OPERATOR_POD_LABELS, source, f"is not JSON: {exc}") from exc
    if (why := _labels_problem(labels)) is not None:
        raise PolicyError(ENV_OPERATOR_POD_LABELS, source, f"is wrong: {why}")
    if not labels:
        raise PolicyError(ENV_OPERATOR_POD_LABELS, source, "names no label")
    return dict(labels)


def parse_pod_monitor_labels(text: str) -> dict[str, str]:
    """$GSPO_POD_MONITOR_LABELS: the labels every job's PodMonitor carries (empty: none)."""
    if not text.strip():
        return {}
    source = "the chart values monitoring.labels and monitoring.podMonitorLabels"
    try:
        labels = json.loads(text)
    except ValueError as exc:
        raise PolicyError(ENV_POD_MONITOR_LABELS, source, f"is not JSON: {exc}") from exc
    if (why := _labels_problem(labels)) is not None:
        raise PolicyError(ENV_POD_MONITOR_LABELS, source, f"is wrong: {why}")
    return dict(labels)


def _parse_names(text: str, env: str, value: str) -> tuple[str, ...]:
    """A JSON list of non-empty strings (an empty variable is an empty list)."""
    if not text.strip():
        return ()
    source = f"the chart value {value}"
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise PolicyError(env, source, f"is not JSON: {exc}") from exc
    if not isinstance(items, list):
        raise PolicyError(env, source, f"must be a list of strings, got {items!r}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item.strip():
            raise PolicyError(env, source, f"[{i}] is {item!r}: give a non-empty string")
    return tuple(items)


def normalized_image(image: str) -> str:
    """`image` with the registry and namespace the container runtime would pull it from:
    `python:3.12` is docker.io/library/python:3.12, `org/app` is docker.io/org/app."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return image  # already names its registry
    if not slash:
        return f"docker.io/library/{image}"
    return f"docker.io/{image}"


def _glob_matches(image: str, pattern: str) -> bool:
    """Segment by segment: `*` never crosses a "/", or `*.corp/*` would allow the registry
    evil.example/x.corp."""
    parts, globs = image.split("/"), pattern.split("/")
    return len(parts) == len(globs) and all(map(fnmatch.fnmatchcase, parts, globs))


def image_matches(image: str, pattern: str) -> bool:
    """Whether `image` is allowed by `pattern`: a glob (with *, ? or [) must match the whole
    reference, each "/"-separated part on its own (`ghcr.io/gspo-dev/*` allows
    ghcr.io/gspo-dev/learner:1, not ghcr.io/gspo-dev/team/x:1); a plain prefix must end at a
    path, tag or digest boundary, so `ghcr.io/gspo-dev` allows ghcr.io/gspo-dev/team/x but
    not ghcr.io/gspo-dev-evil/x. The reference as written and as the runtime resolves it
    (docker.io/...) are both tried."""
    for candidate in dict.fromkeys((image, normalized_image(image))):
        if any(c in pattern for c in "*?["):
            if _glob_matches(candidate, pattern):
                return True
        elif candidate == pattern or (
            candidate.startswith(pattern)
            and (pattern[-1] in "/:@" or candidate[len(pattern)] in "/:@")
        ):
            return True
    return False


def check_policy(spec: GSPOJobSpec, policy: ClusterPolicy) -> list[Problem]:
    """What this cluster refuses although the spec itself is valid."""
    out = []
    for role, pods in (("learner", spec.learner), ("rollout", spec.rollout)):
        for i, volume in enumerate(pods.volumes):
            if volume.host_path is not None and not policy.allow_host_path:
                out.append(
                    Problem(
                        f"spec.{role}.volumes[{i}].hostPath",
                        "hostPath volumes are "
                        "not allowed on this cluster (they expose a node's filesystem); use a "
                        "PersistentVolumeClaim, or ask the admin to set the chart value "
                        "allowHostPath",
                    )
                )
    if spec.run_policy.restart_scope == "learner" and not policy.restart_job_gate:
        out.append(
            Problem(
                "spec.runPolicy.restartScope",
                "learner needs JobSet's alpha "
                "RestartJob feature gate, which stock JobSet installs leave off (its webhook would "
                "refuse the job); use all, or enable the gate and set the chart value "
                "jobset.restartJobGate",
            )
        )
    out.extend(_image_problems(spec, policy.allowed_images))
    out.extend(_priority_class_problems(spec, policy.allowed_priority_classes))
    return out


def _image_problems(spec: GSPOJobSpec, allowed: Sequence[str]) -> list[Problem]:
    """Images outside policy.allowedImages. A rollout image is checked only when rollout
    servers run: with rollout.replicas 0 it is never pulled."""
    if not allowed:
        return []
    images = [("learner", spec.learner.image)]
    if spec.rollout.replicas > 0:
        images.append(("rollout", spec.rollout.image))
    return [
        Problem(
            f"spec.{role}.image",
            f"{image!r} is not allowed on this cluster (allowed: {', '.join(allowed)}); use an "
            "image matching one of them, or ask the admin to add it to the chart value "
            "policy.allowedImages",
        )
        for role, image in images
        if not any(image_matches(image, pattern) for pattern in allowed)
    ]


def _priority_class_problems(spec: GSPOJobSpec, allowed: Sequence[str]) -> list[Problem]:
    """A PriorityClass outside policy.allowedPriorityClasses (it would let a job preempt
    others' pods); none at all is the cluster's default priority, always allowed."""
    name = spec.run_policy.scheduling.priority_class_name
    if not allowed or not name or name in allowed:
        return []
    return [
        Problem(
            "spec.runPolicy.scheduling.priorityClassName",
            f"{name!r} is not allowed on this cluster (allowed: {', '.join(allowed)}); use one "
            "of them, leave it unset for the cluster's default priority, or ask the admin to "
            "add it to the chart value policy.allowedPriorityClasses",
        )
    ]


def apply_queue_label(spec: GSPOJobSpec, labels: Any) -> tuple[GSPOJobSpec, list[Problem]]:
    """Kueue's `kueue.x-k8s.io/queue-name` label on the GSPOJob itself, where Kubeflow's and
    KubeRay's users write it: the job's queue when spec.runPolicy.scheduling.queue is unset
    (the operator carries it onto the JobSet, the object Kueue admits), refused when the two
    differ. Kueue knows no GSPOJob, so the label alone would otherwise do nothing."""
    label = labels.get(names.QUEUE_LABEL) if isinstance(labels, Mapping) else None
    scheduling = spec.run_policy.scheduling
    if not label or label == scheduling.queue:
        return spec, []
    if scheduling.queue:
        return spec, [
            Problem(
                f"metadata.labels[{names.QUEUE_LABEL}]",
                f"{label!r} differs from spec.runPolicy.scheduling.queue "
                f"{scheduling.queue!r}; the job's queue is spec.runPolicy.scheduling.queue: "
                "remove the label or make the two equal",
            )
        ]
    run_policy = spec.run_policy.model_copy(
        update={"scheduling": scheduling.model_copy(update={"queue": str(label)})}
    )
    return spec.model_copy(update={"run_policy": run_policy}), []


def check_job(
    doc: Any,
    policy: ClusterPolicy = ClusterPolicy(),
    *,
    allow_overcommit: bool = False,
    gpu_memory_gib: float | None = None,
) -> tuple[GSPOJobSpec | None, list[Problem]]:
    """Validate one GSPOJob document; the spec when valid, else every problem found. A spec
    valid in every other way is then refused if it cannot fit its GPUs (memory_check), unless
    `allow_overcommit` or the job's gspo.dev/allow-overcommit annotation allows it."""
    if not isinstance(doc, Mapping):
        return None, [Problem("(document)", f"must be a mapping, got {type(doc).__name__}")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != API:
        problems.append(Problem("apiVersion", f"{doc.get('apiVersion')!r} must be {API!r}"))
    if doc.get("kind") != KIND:
        problems.append(Problem("kind", f"{doc.get('kind')!r} must be {KIND!r}"))
    spec: GSPOJobSpec | None = None
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError as exc:
        problems.extend(exc.problems)
        problems.extend(_problems_beside_field_errors(doc.get("spec"), exc, policy))
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        problems.insert(0, Problem("metadata", f"must be a mapping, got {type(metadata).__name__}"))
        metadata = {}
    name = metadata.get("name")
    if not name:
        problems.insert(0, Problem("metadata.name", "required field is missing; add it"))
    else:
        replicas = (spec.learner.replicas, spec.rollout.replicas) if spec else (1, 1)
        if (why := names.check_job_name(str(name), *replicas)) is not None:
            problems.insert(0, Problem("metadata.name", why))
    if spec is not None:
        spec, queue_problems = apply_queue_label(spec, metadata.get("labels"))
        problems.extend(queue_problems)
        problems.extend(check_policy(spec, policy))
        problems.extend(check_gpu_requests(spec))
    if spec is not None and not problems:
        allowed = allow_overcommit or overcommit_allowed(metadata.get("annotations"))
        memory = check_memory(spec, allow_overcommit=allowed, gpu_memory_gib=gpu_memory_gib)
        problems.extend(memory.problems)
    return (spec if not problems else None), problems


def _problems_beside_field_errors(raw: Any, exc: SpecError, policy: ClusterPolicy) -> list[Problem]:
    """The cross-field and policy problems of a spec that also has field-level errors, so
    one run of `gspo validate` names them all (the models stop at the field errors).

    The fields pydantic refused are set aside (their defaults apply) and the rest checked
    again; a problem that names a set-aside field is dropped, as its value is not the
    author's. Nothing is added when the spec cannot be checked that way: a required field is
    missing, or a list item is wrong (setting it aside would renumber the others).
    """
    cause = exc.__cause__
    if not isinstance(cause, ValidationError) or not isinstance(raw, Mapping):
        return []
    trimmed = copy.deepcopy(dict(raw))
    set_aside = []
    for err in cause.errors():
        *parents, leaf = err["loc"] or ("",)
        if err["type"] == "missing" or any(isinstance(part, int) for part in err["loc"]):
            return []
        node: Any = trimmed
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            return []  # a location that is not a plain key (a union member, say)
        del node[leaf]
        if err["type"] != "extra_forbidden":  # a misspelt key never held a value in use
            set_aside.append(str(leaf))
    try:
        spec = GSPOJobSpec.model_validate(trimmed)
    except ValidationError:
        return []
    found = [*check_spec(spec), *check_policy(spec, policy)]
    names_set_aside = [re.compile(rf"\b{re.escape(name)}\b") for name in set_aside]
    return [p for p in found if not any(n.search(f"{p.path} {p.message}") for n in names_set_aside)]


def is_other_kind(doc: Any) -> bool:
    """A Kubernetes object of another API group (a PVC, a Secret...): not a GSPOJob to check."""
    if not isinstance(doc, Mapping):
        return False
    version, kind = str(doc.get("apiVersion") or ""), doc.get("kind")
    return bool(version and kind) and not version.startswith(API_GROUP + "/") and kind != KIND


STDIN = "-"


class ManifestError(ValueError):
    """A file that holds no manifest to check: missing, unreadable, not YAML, or empty. Its
    message names the file and says why, in one line for a terminal."""


def source_name(source: str | Path) -> str:
    return "<stdin>" if str(source) == STDIN else str(source)


def _read_text(source: str | Path) -> str:
    name = source_name(source)
    try:
        if str(source) == STDIN:
            return sys.stdin.read()
        return Path(source).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ManifestError(f"{name}: no such file") from exc
    except IsADirectoryError as exc:
        raise ManifestError(f"{name}: is a directory; give a manifest file") from exc
    except PermissionError as exc:
        raise ManifestError(f"{name}: permission denied") from exc
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{name}: not a YAML file (not UTF-8 text)") from exc
    except OSError as exc:
        raise ManifestError(f"{name}: cannot read: {exc.strerror or exc}") from exc


def load_documents(source: str | Path) -> list[Any]:
    """Every non-empty YAML document in `source` (a path, or "-" for stdin); ManifestError
    when there is none or the file cannot be read or parsed."""
    name, text = source_name(source), _read_text(source)
    try:
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        context = f" ({exc.context})" if exc.context else ""
        raise ManifestError(
            f"{name}: not valid YAML at {where}{exc.problem}{context}; fix the YAML there"
        ) from exc
    except yaml.YAMLError as exc:
        raise ManifestError(f"{name}: not valid YAML: {exc}") from exc
    if not docs:
        raise ManifestError(f"{name}: no {KIND} manifest in it")
    return docs


@dataclass(frozen=True)
class FileProblem:
    """One problem of a file: in document `document` (0-based; None: the file as a whole)."""

    document: int | None
    field: str | None
    message: str


@dataclass(frozen=True)
class FileResult:
    """What `gspo validate` found in one file."""

    file: str
    documents: int
    problems: list[FileProblem]
    # Each job's memory plan and its warnings (a skipped plan, an allowed overcommit), for
    # people: `gspo validate` prints them on stderr; -o yaml/json leaves them out.
    notes: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """One line per problem: `file: field.path: message` (`file[i]` in a multi-document
        file)."""
        out = []
        for p in self.problems:
            where = (
                self.file
                if p.document is None or self.documents == 1
                else (f"{self.file}[{p.document}]")
            )
            out.append(f"{where}: {p.field}: {p.message}" if p.field else f"{where}: {p.message}")
        return out

    def as_dict(self) -> dict[str, Any]:
        problems: list[dict[str, Any]] = [
            {"field": p.field, "message": p.message} for p in self.problems
        ]
        if self.documents > 1:
            for shown, p in zip(problems, self.problems, strict=True):
                shown["document"] = p.document
        return {"file": self.file, "valid": self.valid, "problems": problems}


def validate_source(
    source: str | Path,
    policy: ClusterPolicy = ClusterPolicy(),
    *,
    allow_overcommit: bool = False,
    gpu_memory_gib: float | None = None,
) -> FileResult:
    """Check every GSPOJob in `source` (a path, or "-" for stdin) as the operator would."""
    name = source_name(source)
    try:
        docs = load_documents(source)
    except ManifestError as exc:
        message = str(exc).removeprefix(f"{name}: ")
        return FileResult(name, 0, [FileProblem(None, None, message)])
    # Other kinds beside a GSPOJob (the claim its data lives on, say) are kubectl's business.
    ours = [(i, d) for i, d in enumerate(docs) if not is_other_kind(d)]
    if not ours:
        message = f"no {KIND} ({API}) among its {len(docs)} documents"
        return FileResult(name, len(docs), [FileProblem(None, None, message)])
    problems, notes = [], []
    for index, doc in ours:
        found = check_job(
            doc, policy, allow_overcommit=allow_overcommit, gpu_memory_gib=gpu_memory_gib
        )[1]
        problems += [FileProblem(index, p.path, p.message) for p in found]
        where = name if len(docs) == 1 else f"{name}[{index}]"
        notes += [f"{where}: {n}" for n in _memory_notes(doc, allow_overcommit, gpu_memory_gib)]
    return FileResult(name, len(docs), problems, notes)


def _memory_notes(doc: Any, allow_overcommit: bool, gpu_memory_gib: float | None) -> list[str]:
    """The job's memory plan (whether it fits or not) and its warnings; nothing for a spec
    the models refuse."""
    if not isinstance(doc, Mapping):
        return []
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError:
        return []
    metadata = doc.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    allowed = allow_overcommit or overcommit_allowed(annotations)
    memory = check_memory(spec, allow_overcommit=allowed, gpu_memory_gib=gpu_memory_gib)
    table = [memory.plan.table()] if memory.plan is not None and memory.plan.roles else []
    return table + [f"warning: {w}" for w in memory.warnings]
