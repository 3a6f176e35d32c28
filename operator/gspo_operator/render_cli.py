"""`gspo render FILE`: print what the operator would create for a GSPOJob, like helm template."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import yaml

from gspo_operator.manifest import check_job, load_documents
from gspo_operator.render import render_job


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's manifest) as readable literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gspo render", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, metavar="FILE")
    parser.add_argument("-n", "--namespace", default=None, help="namespace if the file has none")
    args = parser.parse_args(argv)
    objects = []
    for doc in load_documents(args.file):
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
    sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True))
    return 0
