"""`gspo render FILE`: what the operator would create for a GSPOJob, like helm template.

Secret values are printed as `<redacted>` unless `--show-secrets` is given: rendered output
ends up in terminals, CI logs and pull requests, and the job's token guards the rollout
servers' control endpoints.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import yaml

from gspo_api.spec import KIND
from gspo_operator.manifest import (
    ManifestError,
    check_job,
    is_other_kind,
    load_documents,
    source_name,
)
from gspo_operator.render import Obj, render_job

REDACTED = "<redacted>"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's manifest) as readable literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def redact(obj: Obj) -> Obj:
    """`obj` with every Secret value replaced by REDACTED (keys kept: they are the contract)."""
    if obj.get("kind") != "Secret":
        return obj
    out = dict(obj)
    for field in ("stringData", "data"):
        if field in out:
            out[field] = dict.fromkeys(out[field], REDACTED)
    return out


def render_source(
    source: str | Path, namespace: str | None = None, show_secrets: bool = False
) -> list[Obj]:
    """The objects of every GSPOJob in `source` (a path, or "-" for stdin), other kinds left
    out; ManifestError naming every problem (one per line) when a job is invalid."""
    name = source_name(source)
    objects = []
    for doc in load_documents(source):
        if is_other_kind(doc):
            continue  # a claim or Secret beside the job: kubectl applies it as it is
        spec, problems = check_job(doc)
        if spec is None:
            raise ManifestError("\n".join(f"{name}: {problem}" for problem in problems))
        meta = dict(doc["metadata"])
        meta["namespace"] = meta.get("namespace") or namespace or "default"
        job = {**doc, "metadata": meta}
        # The operator generates the token once per job; a rendered file gets a fresh one.
        objects.extend(render_job(job, spec, token=secrets.token_urlsafe(32)))
    if not objects:
        raise ManifestError(f"{name}: no {KIND} manifest in it")
    return objects if show_secrets else [redact(o) for o in objects]


def dump_yaml(objects: list[Any]) -> str:
    """A multi-document YAML stream, as kubectl apply -f takes it."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)
