"""`gspo validate FILE...`: check GSPOJob manifests offline, with the operator's own checks.

`check_job` is exactly what the operator runs before it creates anything, so a manifest that
passes here is one the operator accepts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gspo_operator import names
from gspo_trainer.config import API_GROUP, API_VERSION, KIND, GSPOJobSpec
from gspo_trainer.validation import Problem, SpecError, parse_spec

API = f"{API_GROUP}/{API_VERSION}"
ENV_ALLOW_HOST_PATH = "GSPO_ALLOW_HOST_PATH"
ENV_RESTART_JOB_GATE = "GSPO_JOBSET_RESTART_JOB_GATE"


@dataclass(frozen=True)
class ClusterPolicy:
    """What the cluster admin allows (the chart's values, passed to the operator as env)."""

    allow_host_path: bool = False  # hostPath volumes give pods a node's filesystem
    restart_job_gate: bool = False  # the cluster's JobSet runs with the RestartJob feature gate

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ClusterPolicy:
        def on(name: str) -> bool:
            return env.get(name, "").lower() in ("1", "true", "yes")

        return cls(
            allow_host_path=on(ENV_ALLOW_HOST_PATH), restart_job_gate=on(ENV_RESTART_JOB_GATE)
        )


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
    return out


def check_job(
    doc: Any, policy: ClusterPolicy = ClusterPolicy()
) -> tuple[GSPOJobSpec | None, list[Problem]]:
    """Validate one GSPOJob document; the spec when valid, else every problem found."""
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
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        problems.insert(0, Problem("metadata.name", "required field is missing; add it"))
    else:
        replicas = (spec.learner.replicas, spec.rollout.replicas) if spec else (1, 1)
        if (why := names.check_job_name(str(name), *replicas)) is not None:
            problems.insert(0, Problem("metadata.name", why))
    if spec is not None:
        problems.extend(check_policy(spec, policy))
    return (spec if not problems else None), problems


def is_other_kind(doc: Any) -> bool:
    """A Kubernetes object of another API group (a PVC, a Secret...): not a GSPOJob to check."""
    if not isinstance(doc, Mapping):
        return False
    version, kind = str(doc.get("apiVersion") or ""), doc.get("kind")
    return bool(version and kind) and not version.startswith(API_GROUP + "/") and kind != KIND


def load_documents(path: Path) -> list[Any]:
    """Every non-empty YAML document in `path`."""
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def validate_file(path: Path, policy: ClusterPolicy = ClusterPolicy()) -> list[str]:
    """One line per problem: `file: field.path: message`."""
    try:
        docs = load_documents(path)
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: cannot read: {exc}"]
    if not docs:
        return [f"{path}: no YAML documents found"]
    # Other kinds beside a GSPOJob (the claim its data lives on, say) are kubectl's business.
    ours = [(i, d) for i, d in enumerate(docs) if not is_other_kind(d)]
    if not ours:
        return [f"{path}: no {KIND} ({API}) among its {len(docs)} documents"]
    lines = []
    for index, doc in ours:
        where = str(path) if len(docs) == 1 else f"{path}[{index}]"
        _, problems = check_job(doc, policy)
        lines.extend(f"{where}: {problem}" for problem in problems)
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gspo validate", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument(
        "--allow-host-path", action="store_true", help="as on a cluster that allows hostPath"
    )
    parser.add_argument(
        "--jobset-restart-job-gate",
        action="store_true",
        help="as on a cluster whose JobSet has the RestartJob feature gate on",
    )
    args = parser.parse_args(argv)
    policy = ClusterPolicy(args.allow_host_path, args.jobset_restart_job_gate)
    failed = False
    for path in args.files:
        lines = validate_file(path, policy)
        for line in lines:
            print(line)
        failed = failed or bool(lines)
    if not failed:
        print(f"{len(args.files)} file(s) valid", file=sys.stderr)
    return 1 if failed else 0
