"""`gspo validate FILE...`: check GSPOJob manifests offline, with the operator's own checks.

`check_job` is exactly what the operator runs before it creates anything, so a manifest that
passes here is one the operator accepts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gspo_operator import names
from gspo_trainer.config import API_GROUP, API_VERSION, KIND, GSPOJobSpec
from gspo_trainer.validation import Problem, SpecError, parse_spec

API = f"{API_GROUP}/{API_VERSION}"


def check_job(doc: Any) -> tuple[GSPOJobSpec | None, list[Problem]]:
    """Validate one GSPOJob document; the spec when valid, else every problem found."""
    if not isinstance(doc, Mapping):
        return None, [Problem("(document)", f"must be a mapping, got {type(doc).__name__}")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != API:
        problems.append(Problem("apiVersion", f"{doc.get('apiVersion')!r} must be {API!r}"))
    if doc.get("kind") != KIND:
        problems.append(Problem("kind", f"{doc.get('kind')!r} must be {KIND!r}"))
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        problems.append(Problem("metadata.name", "required field is missing; add it"))
    elif (why := names.check_job_name(str(name))) is not None:
        problems.append(Problem("metadata.name", why))
    spec: GSPOJobSpec | None = None
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError as exc:
        problems.extend(exc.problems)
    return (spec if not problems else None), problems


def load_documents(path: Path) -> list[Any]:
    """Every non-empty YAML document in `path`."""
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def validate_file(path: Path) -> list[str]:
    """One line per problem: `file: field.path: message`."""
    try:
        docs = load_documents(path)
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: cannot read: {exc}"]
    if not docs:
        return [f"{path}: no YAML documents found"]
    lines = []
    for index, doc in enumerate(docs):
        where = str(path) if len(docs) == 1 else f"{path}[{index}]"
        _, problems = check_job(doc)
        lines.extend(f"{where}: {problem}" for problem in problems)
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gspo validate", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        lines = validate_file(path)
        for line in lines:
            print(line)
        failed = failed or bool(lines)
    if not failed:
        print(f"{len(args.files)} file(s) valid", file=sys.stderr)
    return 1 if failed else 0
