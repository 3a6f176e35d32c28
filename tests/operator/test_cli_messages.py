"""The words behind `gspo validate` and `gspo render`: pydantic errors in plain words with a
fix, every problem of a manifest at once, and files that hold no manifest. In-process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_api.validation import explain_error
from gspo_operator.cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE, main
from gspo_operator.manifest import ManifestError, check_job, load_documents

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def err(kind: str, value: Any, ctx: dict[str, Any] | None = None, msg: str = "") -> dict:
    return {"type": kind, "loc": ("x",), "input": value, "ctx": ctx, "msg": msg}


# (pydantic error, the words the message must hold)
EXPLAINED = [
    (err("int_parsing", "abc"), "expected an integer, got 'abc' (a string); fix: "),
    (err("int_type", None), "expected an integer, got nothing (null); fix: "),
    (err("int_from_float", 2.5), "expected an integer, got 2.5 (a number); fix: "),
    (err("float_parsing", "fast"), "expected a number, got 'fast' (a string); fix: "),
    (err("bool_parsing", "maybe"), "expected true or false, got 'maybe' (a string); fix: "),
    (err("string_type", 3), "expected a string, got 3 (an integer); fix: quote"),
    (err("model_type", "x"), "expected a mapping, got 'x' (a string); fix: "),
    (err("list_type", {"a": 1}), "expected a list, got a mapping; fix: "),
    (
        err("literal_error", "ppo", {"expected": "'gspo', 'gspo-token' or 'grpo'"}),
        "expected one of 'gspo', 'gspo-token' or 'grpo', got 'ppo' (a string); fix: use one",
    ),
    (err("greater_than", -1, {"gt": 0.0}), "expected a number greater than 0, got -1"),
    (err("greater_than_equal", 0, {"ge": 1}), "got 0 (an integer); fix: set it to 1 or more"),
    (err("less_than_equal", 2.0, {"le": 1.0}), "fix: set it to 1 or less"),
    (err("string_too_short", "", {"min_length": 1}), "expected at least 1 character(s)"),
    (err("string_pattern_mismatch", "x", {"pattern": "^/"}), "expected text matching ^/"),
    (err("missing", {}), "required field is missing; add it"),
    (err("value_error", "1x", msg="Value error, '1x' is not a quantity"), "not a quantity"),
    (err("bool_type", True), "got true (a boolean)"),
]


@pytest.mark.parametrize(("error", "words"), EXPLAINED)
def test_pydantic_errors_in_plain_words_with_a_fix(error: dict, words: str) -> None:
    assert words in explain_error(error)


def test_unknown_fields_list_the_allowed_ones() -> None:
    said = explain_error(err("extra_forbidden", 1), ["groupSize", "seed"])
    assert said == "unknown field; remove it or fix its spelling; allowed here: groupSize, seed"


def test_an_unexpected_context_still_explains() -> None:
    said = explain_error(err("greater_than", 1, {}, msg="Input should be greater than 2"))
    assert said.startswith("expected greater than 2, got 1 (an integer); fix: ")


def _problems(**algorithm: Any) -> dict[str, str]:
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"]["algorithm"].update(algorithm)
    spec, problems = check_job(doc)
    assert spec is None
    return {p.path: p.message for p in problems}


def test_cross_field_problems_come_with_field_errors() -> None:
    found = _problems(groupSize=1, temperature="hot", miniBatches=7)
    assert {
        "spec.algorithm.temperature",
        "spec.algorithm.groupSize",
        "spec.algorithm.miniBatches",
    } <= set(found)
    assert found["spec.algorithm.groupSize"].startswith("1 leaves every response")


def test_a_rule_that_reads_a_refused_field_is_left_out() -> None:
    """groupSize 'abc' is set aside; miniBatches' rule would judge the default in its place."""
    found = _problems(groupSize="abc", miniBatches=7)
    assert set(found) == {"spec.algorithm.groupSize"}


def test_metadata_that_is_not_a_mapping_is_a_problem_not_a_crash() -> None:
    doc = {**copy.deepcopy(EXAMPLE), "metadata": 5}
    _, problems = check_job(doc)
    assert [str(p) for p in problems][:2] == [
        "metadata.name: required field is missing; add it",
        "metadata: must be a mapping, got int",
    ]


def test_a_missing_required_field_adds_no_guesses() -> None:
    doc = copy.deepcopy(EXAMPLE)
    del doc["spec"]["model"]["name"]
    doc["spec"]["algorithm"]["groupSize"] = 1
    _, problems = check_job(doc)
    assert [p.path for p in problems] == ["spec.model.name"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "no GSPOJob manifest in it"),
        ("a: [1\n", "not valid YAML at line 2, column 1"),
        ("a: b: c\n", "not valid YAML at line 1, column 5: mapping values are not allowed"),
    ],
)
def test_files_without_a_manifest(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError) as info:
        load_documents(path)
    assert str(info.value).startswith(f"{path}: ")
    assert words in str(info.value)


def test_binary_and_missing_files(tmp_path: Path) -> None:
    blob = tmp_path / "blob.yaml"
    blob.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ManifestError, match="not UTF-8"):
        load_documents(blob)
    with pytest.raises(ManifestError, match="no such file"):
        load_documents(tmp_path / "gone.yaml")


def test_main_maps_outcomes_to_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(REPO / "examples/gspojob.yaml")]) == EXIT_OK
    assert main(["validate", "gone.yaml"]) == EXIT_INVALID
    assert main(["validate", "--no-such-flag", "x"]) == EXIT_USAGE
    assert main(["no-such-command"]) == EXIT_USAGE
    assert main(["--version"]) == EXIT_OK
    assert "Traceback" not in capsys.readouterr().err
