"""`gspo train --set path=value`: any spec field, as Helm and Hydra users write it, validated
like the file, with errors naming the path; nothing starts for a bad one."""

from __future__ import annotations

import pytest

from gspo_api.validation import parse_spec
from gspo_trainer.overrides import OverrideError, apply_overrides
from gspo_trainer.train import job_manifest, main, parse_args


def spec_after(*assignments: str) -> dict:
    args = parse_args([arg for a in assignments for arg in ("--set", a)])
    return job_manifest(args)["spec"]


def test_any_field_by_its_path_with_yaml_values() -> None:
    spec = spec_after(
        "algorithm.groupSize=4",
        "spec.data.systemPrompt=Answer with a number.",
        "algorithm.temperature=0.7",
        "data.chatTemplateKwargs.enable_thinking=false",
        "rollout.engine_args.enforce_eager=true",  # snake_case, as Hydra users write it
        "reward.functions=[{name: exact, kind: arithmetic}]",
        "reward.functions[1]={name: fmt, kind: format, weight: 0.5}",
        "reward.functions[0].weight=2",
        "reward.kind=null",
        r"learner.labels.app\.kubernetes\.io/part-of=rl",  # a dot in a key, escaped as in Helm
    )
    parsed = parse_spec(spec)
    assert parsed.algorithm.group_size == 4 and parsed.algorithm.temperature == 0.7
    assert parsed.data.system_prompt == "Answer with a number."
    assert parsed.data.chat_template_kwargs == {"enable_thinking": False}
    assert spec["rollout"]["engineArgs"] == {"enforce_eager": True}
    assert parsed.learner.labels == {"app.kubernetes.io/part-of": "rl"}
    assert [(f.name, f.weight) for f in parsed.reward.functions or []] == [
        ("exact", 2.0),
        ("fmt", 0.5),
    ]


def test_a_bad_value_or_field_is_refused_with_its_path(capsys: pytest.CaptureFixture) -> None:
    assert main(["--set", "algorithm.groupSize=many", "--set", "algorithm.groupSise=4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("gspo train: spec.algorithm.groupSize: expected an integer")
    assert err[1].startswith("gspo train: spec.algorithm.groupSise: ")
    assert "groupSize" in err[1]  # the allowed fields are listed
    assert main(["--set", "algorithm.groupSize"]) == 2
    assert "write it as path=value" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("assignment", "says"),
    [
        ("algorithm.groupSize.x=1", r"spec.algorithm.groupSize is not a mapping"),
        ("reward.functions[3].weight=1", r"spec.reward.functions has 0 items; index 3"),
        ("algorithm..groupSize=1", r"is not a field path"),
        ("data.source=[unclosed", r"the value is not YAML"),
    ],
)
def test_paths_that_cannot_be_set(assignment: str, says: str) -> None:
    spec = {"algorithm": {"groupSize": 8}, "reward": {"functions": []}}
    with pytest.raises(OverrideError, match=says):
        apply_overrides(spec, [assignment])


@pytest.mark.parametrize("value", ["5", "[1]"])
def test_a_section_set_to_a_non_mapping_is_refused_not_a_traceback(
    value: str, capsys: pytest.CaptureFixture
) -> None:
    """--max-steps, --seed and --loss-level write into spec.algorithm: one that is not a
    mapping (from --set or the file) is left for validation to name."""
    args = [
        "--set",
        f"algorithm={value}",
        "--max-steps",
        "2",
        "--seed",
        "1",
        "--loss-level",
        "grpo",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo train: spec.algorithm: expected a mapping"), err


def test_null_unsets_a_field_so_its_default_applies() -> None:
    """As Helm's --set x=null: the key goes, and the field takes its default."""
    from gspo_trainer.jobs import tiny_manifest

    spec = tiny_manifest()["spec"]
    default = parse_spec({**spec, "reward": {}}).reward.timeout_seconds
    spec["reward"] = {"timeoutSeconds": default + 1}
    apply_overrides(spec, ["reward.timeoutSeconds=null"])
    assert parse_spec(spec).reward.timeout_seconds == default
