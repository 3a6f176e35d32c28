"""`gspo` as the console script: version, exit codes, stdin, -o, completion. Run as a
subprocess, as a person or a CI job would (tests/checkout.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from checkout import REPO, checkout_env

EXAMPLE = REPO / "examples/gspojob.yaml"


def _bad_example(tmp_path: Path, **algorithm: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["algorithm"].update(algorithm)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_version_is_the_installed_distributions(gspo) -> None:
    out = gspo("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"gspo, version {version('gspo-operator')}"


def test_help_states_the_exit_codes(gspo) -> None:
    out = gspo("-h")
    assert out.returncode == 0
    assert "Exit codes:" in out.stdout and "2  usage" in out.stdout


@pytest.mark.parametrize(
    "args", [("trian",), ("render", "--no-such-flag", "x.yaml"), ("crd", "-o", "xml")]
)
def test_usage_errors_exit_2_without_a_traceback(gspo, args: tuple[str, ...]) -> None:
    out = gspo(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "Error:" in out.stderr


def test_pod_commands_get_their_arguments_unparsed(gspo) -> None:
    out = gspo("train", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: gspo train")  # argparse's own help, not click's


def test_render_of_a_missing_file_exits_1_naming_it(gspo) -> None:
    out = gspo("render", "nope.yaml")
    assert out.returncode == 1
    assert out.stderr == "nope.yaml: no such file\n"
    assert out.stdout == ""


@pytest.mark.parametrize("text", ["", "---\n", "# only a comment\n"])
def test_a_file_without_documents_exits_1(gspo, tmp_path: Path, text: str) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    for command in ("render", "validate"):
        out = gspo(command, str(empty))
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        assert f"{empty}: no GSPOJob manifest in it" in out.stdout + out.stderr


def test_a_yaml_syntax_error_names_file_line_and_column(gspo, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: gspo.dev/v1alpha1\nkind: GSPOJob\nspec: [1, 2\nmetadata: x\n")
    for command in ("render", "validate"):
        out = gspo(command, str(broken))
        said = out.stdout + out.stderr
        assert out.returncode == 1, said
        assert "Traceback" not in said
        assert f"{broken}: not valid YAML at line 4, column 9" in said, said


def test_dash_reads_the_manifest_from_stdin(gspo) -> None:
    from_file = gspo("render", "--show-secrets", str(EXAMPLE))
    from_stdin = gspo("render", "--show-secrets", "-", input=EXAMPLE.read_text())
    assert from_stdin.returncode == 0, from_stdin.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(from_stdin.stdout)]
    assert kinds == [d["kind"] for d in yaml.safe_load_all(from_file.stdout)]
    checked = gspo("validate", "-", input="kind: Job\n")
    assert checked.returncode == 1
    assert "<stdin>: kind: 'Job' must be 'GSPOJob'" in checked.stdout.splitlines()


def test_render_json_is_a_list_of_the_yaml_objects(gspo) -> None:
    as_yaml = gspo("render", str(EXAMPLE))
    as_json = gspo("render", "-o", "json", str(EXAMPLE))
    assert as_json.returncode == 0, as_json.stderr
    listed = json.loads(as_json.stdout)
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    # The job's token is random per run; redacted (the default) both print the same.
    assert listed["items"] == list(yaml.safe_load_all(as_yaml.stdout))


def test_crd_json_is_the_yaml_crd(gspo) -> None:
    as_json = gspo("crd", "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == yaml.safe_load(gspo("crd").stdout)


def test_validate_names_every_bad_field_at_once(gspo, tmp_path: Path) -> None:
    bad = _bad_example(tmp_path, groupSize="abc", learningRate="fast", lossLevel="ppo")
    out = gspo("validate", str(bad))
    assert out.returncode == 1
    fields = [line.split(": ")[1] for line in out.stdout.splitlines()]
    assert sorted(fields) == [
        "spec.algorithm.groupSize",
        "spec.algorithm.learningRate",
        "spec.algorithm.lossLevel",
    ]
    group_size = next(line for line in out.stdout.splitlines() if "groupSize" in line)
    assert "expected an integer, got 'abc' (a string); fix: " in group_size


def test_validate_json_is_a_result_per_file(gspo, tmp_path: Path) -> None:
    bad = _bad_example(tmp_path, groupSize=1)
    out = gspo("validate", "-o", "json", str(EXAMPLE), str(bad), str(tmp_path / "gone.yaml"))
    assert out.returncode == 1
    good, wrong, gone = json.loads(out.stdout)
    assert good == {"file": str(EXAMPLE), "valid": True, "problems": []}
    assert wrong["valid"] is False
    assert [p["field"] for p in wrong["problems"]] == ["spec.algorithm.groupSize"]
    assert gone["problems"] == [{"field": None, "message": "no such file"}]


def test_crd_write_into_a_missing_directory_is_refused(gspo, tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "crd.yaml"
    out = gspo("crd", "--write", str(target))
    assert out.returncode == 1
    assert str(target.parent) in out.stderr and "mkdir -p" in out.stderr
    assert not target.parent.exists()


def test_crd_write_writes_the_chart_copy(gspo, tmp_path: Path) -> None:
    target = tmp_path / "crd.yaml"
    out = gspo("crd", "--write", str(target))
    assert out.returncode == 0, out.stderr
    assert target.read_text() == gspo("crd").stdout


def _complete(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gspo_operator.cli"],
        capture_output=True,
        text=True,
        timeout=60,
        env=checkout_env(**env),
        cwd=REPO,
    )


def test_bash_completion_script_and_answers() -> None:
    script = _complete(_GSPO_COMPLETE="bash_source")
    assert script.returncode == 0, script.stderr
    assert "_gspo_completion" in script.stdout and "complete " in script.stdout
    answer = _complete(_GSPO_COMPLETE="bash_complete", COMP_WORDS="gspo val", COMP_CWORD="1")
    assert answer.stdout.split() == ["plain,validate"]


def test_validate_imports_no_torch() -> None:
    code = (
        "import sys; from gspo_operator.cli import main; "
        "rc = main(['validate', 'examples/gspojob.yaml']); print(rc, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=checkout_env(), cwd=REPO
    )
    assert out.stdout.split() == ["0", "False"], out.stderr
