"""Each image starts a real `gspo` subcommand, installs an extra that exists, and runs as non-root.

No Docker engine runs here, so the Dockerfiles are read, not built.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from gspo_api import ports
from gspo_operator.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[2]
IMAGES = {
    "operator": ports.OPERATOR_COMMAND,
    "learner": ports.LEARNER_COMMAND,
    "rollout": ports.ROLLOUT_COMMAND,
}


def _dockerfile(name: str) -> str:
    return (REPO / "docker" / f"{name}.Dockerfile").read_text()


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_is_the_pod_command(name: str) -> None:
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", _dockerfile(name), re.M)
    assert entry, f"docker/{name}.Dockerfile has no exec-form ENTRYPOINT"
    command = tuple(json.loads(entry.group(1)))
    assert command == IMAGES[name]
    assert command[0] == "gspo" and command[1] in SUBCOMMANDS


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_installs_an_existing_extra(name: str) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    wanted = set(re.findall(r"gspo-operator\[([a-z-]+)\]|\"\.\[([a-z-]+)\]\"", _dockerfile(name)))
    names = {a or b for a, b in wanted}
    assert names == {name}, names
    assert name in extras


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_non_root_on_pinned_bases(name: str) -> None:
    text = _dockerfile(name)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    bases = re.findall(r"^(?:FROM|ARG BASE=)\s*(\S+)", text, re.M)
    for base in bases:
        if base.startswith("${") or " AS " in base:
            continue
        assert ":" in base and not base.endswith(":latest"), base
    assert text.count("FROM ") >= 2, "multi-stage build expected"
