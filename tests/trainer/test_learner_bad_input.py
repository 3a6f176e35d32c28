"""`gspo learner` refuses bad inputs at start-up, exit 2, naming the spec field, before any work."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.learner_cli import main

Spec = dict[str, Any]


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(spec: Spec, source: str) -> None:
    spec["data"]["source"] = source
    spec["reward"] = {"kind": "math"}


# name -> (change the tiny spec under a scratch directory, the field path the error must name)
BAD_INPUTS: dict[str, tuple[Callable[[Spec, Path], None], str]] = {
    "dataset missing": (lambda s, d: _data(s, str(d / "nope.jsonl")), "spec.data.source"),
    "dataset empty": (lambda s, d: _data(s, _jsonl(d / "empty.jsonl", [])), "spec.data.source"),
    "rows without the prompt field": (
        lambda s, d: _data(s, _jsonl(d / "np.jsonl", [{"question": "1+1=", "answer": "2"}])),
        "spec.data.promptField",
    ),
    "rows without the answer field": (
        lambda s, d: _data(s, _jsonl(d / "na.jsonl", [{"prompt": "1+1=", "solution": "2"}])),
        "spec.data.answerField",
    ),
    "a row that is a JSON scalar": (
        lambda s, d: _data(s, _jsonl(d / "scalar.jsonl", [{"prompt": "1+1=", "answer": "2"}, 5])),
        "spec.data.source",
    ),
    "a row whose prompt is null": (
        lambda s, d: _data(s, _jsonl(d / "null.jsonl", [{"prompt": None, "answer": "2"}])),
        "spec.data.promptField",
    ),
    "reward function does not import": (
        lambda s, d: s.update(reward={"kind": "python", "function": "no_such_module_x:score"}),
        "spec.reward.function",
    ),
    "reward function not in its module": (
        lambda s, d: s.update(reward={"kind": "python", "function": "json:no_such_function"}),
        "spec.reward.function",
    ),
    "model path does not exist": (
        lambda s, d: s["model"].update(name=str(d / "no-model")),
        "spec.model.name",
    ),
    "more GPUs than present": (
        lambda s, d: s["learner"].update(gpusPerReplica=64),
        "spec.learner.gpusPerReplica",
    ),
}


def write_bad_config(name: str, scratch: Path) -> tuple[Path, str]:
    """The tiny job with one bad input; returns its config file and the field to be named."""
    change, field = BAD_INPUTS[name]
    spec = tiny_manifest()["spec"]
    change(spec, scratch)
    path = scratch / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, field


def refuse(name: str, scratch: Path, run: Callable[[list[str]], tuple[int, str]],
           max_seconds: float = 10) -> str:  # fmt: skip
    """'' when the bad input is refused as promised, else what went wrong."""
    config, field = write_bad_config(name, scratch)
    ckpt = scratch / "ckpt"
    start = time.perf_counter()
    code, err = run(["--config", str(config), "--checkpoint-dir", str(ckpt)])
    seconds = time.perf_counter() - start
    lines = [line for line in err.splitlines() if line.startswith("gspo learner: ")]
    if code != 2:
        return f"exit {code}, not 2"
    if len(lines) != 1 or field not in lines[0]:
        return f"expected one line naming {field}, got {lines}"
    if ckpt.exists():
        return "work started: the checkpoint directory was created"
    if seconds > max_seconds:
        return f"took {seconds:.1f} s"
    return ""


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_exits_2_naming_the_field(name: str, tmp_path: Path, capsys) -> None:
    def run(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        return code, capsys.readouterr().err

    assert refuse(name, tmp_path, run) == ""


def test_the_good_tiny_spec_passes_preflight(tmp_path: Path) -> None:
    from gspo_api.spec import GSPOJobSpec
    from gspo_trainer.preflight import preflight

    spec = GSPOJobSpec.model_validate(tiny_manifest()["spec"])
    assert preflight(spec, gpus=0) == []
    rows = _jsonl(tmp_path / "ok.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    good = tiny_manifest()["spec"]
    _data(good, rows)
    assert preflight(GSPOJobSpec.model_validate(good), gpus=0) == []
