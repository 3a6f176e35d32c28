"""Each Dockerfile's Python environment resolves: its own `pip install` (or the build stage's
`pip wheel`) run by pip with `--dry-run`, with the same requirements, versions (versions.env
substituted) and find-links (this project's wheel, built here, where the Dockerfile has
`/wheels`), against PyPI alone as in the image (this machine's pip.conf, find-links and
constraints are set aside). The report must hold exactly the pinned versions: for the rollout
image, vLLM's own torch pin must be TORCH_VERSION, or pip fails here as the build would.

Needs PyPI (the CUDA builds of torch and vLLM are only there): skipped unless
GSPO_NETWORK_TESTS=1 (`make check-images`). Each image takes 10-60 s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import REPO
from test_images_match import IMAGE_PACKAGES, PINNED, VERSIONS_ENV, parse_versions_env

pytestmark = pytest.mark.skipif(
    os.environ.get("GSPO_NETWORK_TESTS") != "1",
    reason="resolves the images' packages from PyPI: set GSPO_NETWORK_TESTS=1",
)
PIP_ENV_SET_ASIDE = ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL")


def pip_commands(dockerfile: str, pins: dict[str, str]) -> list[list[str]]:
    """The arguments of every `pip install` / `pip wheel` of `dockerfile` that resolves
    dependencies (not --no-deps; not --no-index, which installs what a build stage resolved),
    with versions.env's variables substituted."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    commands = []
    for line in joined.splitlines():
        if not line.startswith("RUN "):
            continue
        for part in line.split("&&"):
            words = shlex.split(part.replace("${", "{").format(**pins) if "${" in part else part)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # DS_BUILD_OPS=0 pip ...
                words = words[1:]
            if words[:2] in (["pip", "install"], ["pip", "wheel"]) and not {
                "--no-deps",
                "--no-index",
            } & set(words):
                commands.append(words[2:])
    return commands


def dry_run(args: list[str], wheels: Path, report: Path) -> dict:
    reqs, find_links = [], []
    it = iter(args)
    for word in it:
        if word in ("--find-links", "-f"):
            find_links += ["--find-links", str(wheels) if next(it) == "/wheels" else word]
        elif word in ("--wheel-dir", "-w"):
            next(it)
        elif word.startswith("-"):
            continue  # --no-cache-dir
        else:
            reqs.append(str(REPO) + word[1:] if word.startswith(".[") else word)
    env = {k: v for k, v in os.environ.items() if k not in PIP_ENV_SET_ASIDE}
    env.update(PIP_CONFIG_FILE=os.devnull, DS_BUILD_OPS="0")
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--timeout", "30", *find_links, *reqs],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's wheel alone, as each Dockerfile's build stage makes it."""
    wheels = tmp_path_factory.mktemp("wheels")
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(wheels), str(REPO)],
        check=True, timeout=300,
    )  # fmt: skip
    return wheels


@pytest.mark.parametrize("image", sorted(IMAGE_PACKAGES))
def test_each_image_resolves_its_pins(image: str, project_wheel: Path, tmp_path: Path) -> None:
    pins = parse_versions_env(VERSIONS_ENV.read_text())
    text = (REPO / "docker" / f"{image}.Dockerfile").read_text()
    commands = pip_commands(text, pins)
    assert commands, f"{image}.Dockerfile has no pip install that resolves dependencies"
    for i, args in enumerate(commands):
        report = dry_run(args, project_wheel, tmp_path / f"report-{i}.json")
        got = {r["metadata"]["name"].lower(): r["metadata"]["version"] for r in report["install"]}
        for package in IMAGE_PACKAGES[image]:
            assert got.get(package) == pins[PINNED[package]], (package, got.get(package))
        if "torch" in got:  # PyPI's CUDA build, not a local +cpu wheel
            assert "+" not in got["torch"], got["torch"]
