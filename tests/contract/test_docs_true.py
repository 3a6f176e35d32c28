"""What README.md and docs/ state that the code can check stays true: every metric name, spec
field and repository file they cite exists, and every `gspo` command of their console blocks
that runs here (validate, render, crd) prints what the block shows.

The files those commands name (job.yaml, bad.yaml, ...) are in tests/contract/docs_files/;
one-gpu.yaml is examples/gspojob.yaml on one learner GPU, as docs/cli.md says. In a block's
output, `...` stands for the rest of what was cut, and the lines shown must appear in order.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_operator.cli import main as gspo_main
from gspo_operator.crd import render_crd
from gspo_trainer.metrics import STEP_GAUGES

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
FILES = Path(__file__).parent / "docs_files"
REPO_DIRS = ("examples", "tests", "bench", "docs", "charts", "docker", "trainer", "operator")
# Spec-like paths the docs cite that are another object's (Kueue's Workload).
OTHER_OBJECTS = {"spec.active"}
# Paths the docs cite in another project's repository.
OTHER_REPOSITORIES = {"examples/data_preprocess/gsm8k.py"}  # verl's GSM8K preparation
FILE_SUFFIXES = {"png", "json", "jsonl", "yaml", "md", "py", "txt"}  # `reward.png` is a file
RUNNABLE = ("validate", "render", "crd", "--help", "--version")


def doc_text(doc: Path) -> str:
    return doc.read_text()


def cited(pattern: str) -> Iterator[tuple[str, str]]:
    """(doc name, match) of every line of the docs; lines quoting `gspo validate`'s refusal
    of an unknown field name that field on purpose."""
    for doc in DOCS:
        for line in doc_text(doc).splitlines():
            if "unknown field" in line:
                continue
            for match in re.findall(pattern, line):
                yield doc.name, match


def exported_metric_names() -> set[str]:
    """Every gspo_ metric name the code declares (string literals of trainer/ and operator/)."""
    names = set()
    for source in (*REPO.glob("trainer/**/*.py"), *REPO.glob("operator/**/*.py")):
        names |= set(re.findall(r"[\"'](gspo_[a-z0-9_]+)[\"']", source.read_text()))
    return names


def test_every_metric_the_docs_name_is_exported() -> None:
    names = exported_metric_names()
    missing = []
    for doc, name in cited(r"(?<![\w/.])(gspo_[a-z0-9_]+)(?![\w/.])"):
        if name in ("gspo_api", "gspo_trainer", "gspo_operator"):  # the packages
            continue
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        prefix = name.endswith("_") and any(n.startswith(name) for n in names)
        if name not in names and base not in names and not prefix:
            missing.append(f"{doc}: {name}")
    assert not missing


def test_the_local_run_page_names_every_metric_that_is_not_gspo_and_its_history_key() -> None:
    readme = " ".join(doc_text(REPO / "docs" / "local-run.md").split())
    for key, (name, _) in STEP_GAUGES.items():
        if name != f"gspo_{key}":
            assert f"`{key}`: `{name}`" in readme, key


def _spec_schema() -> dict[str, Any]:
    crd = render_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _resolves(node: dict[str, Any], parts: list[str]) -> bool:
    for part in parts:
        part = re.sub(r"\[[^\]]*\]$", "", part)
        if node.get("type") == "array":
            node = node.get("items", {})
        props = node.get("properties")
        if props is None:  # a map (env, labels, engineArgs): any key
            any_key = "additionalProperties", "x-kubernetes-preserve-unknown-fields"
            return any(node.get(k) for k in any_key)
        if part not in props:
            return False
        node = props[part]
    return True


def test_every_spec_field_the_docs_name_exists() -> None:
    spec = _spec_schema()
    sections = set(spec["properties"])
    missing = []
    for doc, path in cited(r"(?<![\w.$/-])(spec\.[A-Za-z][\w.]*(?:\[[^\]]*\])?[\w.]*\w)"):
        if path not in OTHER_OBJECTS and not _resolves(spec, path.split(".")[1:]):
            missing.append(f"{doc}: {path}")
    for doc, path in cited(r"`([a-z][A-Za-z]*(?:\.[A-Za-z][A-Za-z0-9]*)+)`"):
        parts = path.split(".")
        if parts[0] in sections and parts[-1] not in FILE_SUFFIXES and not _resolves(spec, parts):
            missing.append(f"{doc}: {path}")
    assert not missing


def test_every_repository_file_the_docs_cite_exists() -> None:
    missing = []
    for doc in DOCS:
        text = doc_text(doc)
        paths = re.findall(rf"(?<![\w/.-])((?:{'|'.join(REPO_DIRS)})/[\w./-]*\w)", text)
        links = [p for p in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text)]
        for path in paths:
            if path not in OTHER_REPOSITORIES and not (REPO / path).exists():
                missing.append(f"{doc.name}: {path}")
        for link in links:
            if not (doc.parent / link).exists():
                missing.append(f"{doc.name}: ({link})")
    assert not missing


def console_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(doc, command, the output lines the block shows) of each `$ gspo ...` line of the docs'
    console blocks that runs here (no cluster, no training)."""
    for doc in DOCS:
        for block in re.findall(r"```console\n(.*?)```", doc_text(doc), re.S):
            steps: list[tuple[str, list[str]]] = []
            for line in block.splitlines():
                if line.startswith("$ "):
                    steps.append((line[2:], []))
                elif steps and line.strip():
                    steps[-1][1].append(line)
            for command, shown in steps:
                command = re.split(r"\s{2,}#", command)[0].strip()
                words = command.split("|")[0].split()
                if words[:1] == ["gspo"] and len(words) > 1 and words[1] in RUNNABLE:
                    piped = "|" in command
                    yield doc.name, " ".join(words), [] if piped or "-o" in words else shown


def _shown_as_pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


@pytest.fixture
def docs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for f in FILES.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    one_gpu = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())
    one_gpu["spec"]["learner"].update(replicas=1, gpusPerReplica=1)
    (tmp_path / "one-gpu.yaml").write_text(yaml.safe_dump(one_gpu, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_gspo_commands_of_the_console_blocks_print_what_they_show(
    docs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = []
    for doc, command, shown in console_commands():
        code = gspo_main(command.split()[1:])
        out = capsys.readouterr()
        printed = (out.out + out.err).splitlines()
        assert code in (0, 1), f"{doc}: `{command}` exited {code}: {out.err[-2000:]}"
        assert "Traceback" not in out.err, f"{doc}: `{command}`"
        lines = iter(printed)
        for line in shown:
            pattern = _shown_as_pattern(line)
            assert any(pattern.fullmatch(got) for got in lines), (
                f"{doc}: `{command}` does not print\n  {line}\nit prints:\n" + "\n".join(printed)
            )
        ran.append(command)
    assert {"gspo validate job.yaml", "gspo validate bad.yaml", "gspo render nope.yaml"} <= set(ran)


def _described_spec(doc: Path) -> dict[str, set[str]]:
    """Section -> the field names the `kubectl describe gspo` transcript in `doc` shows
    (kubectl's "Clip High" is clipHigh; a name with anything but letters and '-' it prints
    as it is, adamBeta1: kubectl/pkg/describe/describe.go, smartLabelFor)."""
    text = doc_text(doc)
    spec_part = text[text.index("\nSpec:\n") : text.index("\nStatus:\n")]
    shown: dict[str, set[str]] = {}
    section = ""
    for line in spec_part.splitlines():
        if m := re.fullmatch(r"  (\w[\w ]*):", line):
            section = m.group(1)
            shown[section] = set()
        elif (m := re.match(r"    (\w[\w ]*):", line)) and section:
            if re.search(r"[^A-Za-z -]", m.group(1)):
                shown[section].add(m.group(1))
                continue
            first, *rest = m.group(1).split()
            shown[section].add(first.lower() + "".join(w[:1].upper() + w[1:] for w in rest))
    return shown


def test_the_captured_kubectl_describe_shows_the_whole_spec_of_the_example() -> None:
    """docs/operator.md's transcript is of examples/gspojob.yaml with the API server's
    defaults: every field of each section the spec now has is in it."""
    from gspo_api.validation import parse_spec

    manifest = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())
    spec = parse_spec(manifest["spec"]).model_dump(mode="json", by_alias=True, exclude_none=True)
    shown = _described_spec(REPO / "docs" / "operator.md")
    for section, fields in spec.items():
        if isinstance(fields, dict):
            title = re.sub(r"(?<!^)([A-Z])", r" \1", section).title()
            assert set(fields) <= shown.get(title, set()), (section, set(fields) - shown[title])


def test_the_operators_failover_time_is_stated_one_way() -> None:
    """Where the docs say how soon a standby operator takes over from a dead leader, they
    give docs/operator.md's range, which starts at the lease duration."""
    from gspo_operator.leader import Timing

    operator_md = " ".join((REPO / "docs" / "operator.md").read_text().split())
    (stated,) = re.findall(r"is replaced within [^:]*: about (\d+ to \d+ s)", operator_md)
    assert stated.startswith(f"{Timing().lease_duration_s:.0f} to ")
    for path in (
        "docs/cluster.md",
        "charts/gspo-operator/README.md",
        "charts/gspo-operator/values.yaml",
    ):
        text = " ".join((REPO / path).read_text().replace("#", " ").split())
        claims = re.findall(r"tak\w+ over within ([^,]*?)(?: of its death| if it dies)", text)
        assert claims == [stated], (path, claims)


def test_every_relative_link_of_the_docs_resolves() -> None:
    """A link in README.md or docs/ to a file of this repository (the README split into pages
    under docs/, whose links are relative to docs/) opens that file."""
    broken = []
    for doc in (
        *DOCS,
        REPO / "RELIABILITY.md",
        REPO / "BENCHMARKS.md",
        REPO / "charts" / "gspo-operator" / "README.md",
    ):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc_text(doc)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken
