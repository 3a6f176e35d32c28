"""`gspo render FILE`: print what the operator would create for a GSPOJob, like helm template.

Secret values are printed as `<redacted>` unless `--show-secrets` is given: rendered output
ends up in terminals, CI logs and pull requests, and the weight-sync token guards the rollout
servers' control endpoints.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import yaml

from gspo_operator.manifest import check_job, is_other_kind, load_documents
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gspo render", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, metavar="FILE")
    parser.add_argument("-n", "--namespace", default=None, help="namespace if the file has none")
    parser.add_argument(
        "--show-secrets",
        action="store_true",
        help=f"print Secret values (the generated sync token) instead of {REDACTED}",
    )
    args = parser.parse_args(argv)
    objects = []
    for doc in load_documents(args.file):
        if is_other_kind(doc):
            continue  # a claim or Secret beside the job: kubectl applies it as it is
        spec, problems = check_job(doc)
        if spec is None:
            for problem in problems:
                print(f"{args.file}: {problem}", file=sys.stderr)
            return 1
        meta = dict(doc["metadata"])
        meta["namespace"] = meta.get("namespace") or args.namespace or "default"
        job = {**doc, "metadata": meta}
        # The operator generates the token once per job; a rendered file gets a fresh one.
        objects.extend(render_job(job, spec, token=secrets.token_urlsafe(32)))
    if not args.show_secrets:
        objects = [redact(o) for o in objects]
    sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True))
    return 0
