"""Prompt data: the built-in task, files, templates, and a seeded resumable shuffle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gspo_api.spec import DataConfig
from gspo_trainer.data import PromptStream, addition_examples, load_examples


def test_addition_task_is_every_single_digit_pair() -> None:
    examples = addition_examples()
    assert len(examples) == 100 and len({e.prompt for e in examples}) == 100
    by_prompt = {e.prompt: e.answer for e in examples}
    assert by_prompt["7+8="] == "5" and by_prompt["0+0="] == "0"


def test_each_epoch_is_a_seeded_permutation() -> None:
    examples = addition_examples()
    stream = PromptStream(examples, seed=3)
    first = stream.next_batch(100)
    second = stream.next_batch(100)
    assert sorted(e.prompt for e in first) == sorted(e.prompt for e in examples)
    assert [e.prompt for e in first] != [e.prompt for e in second]  # reshuffled
    assert [e.prompt for e in PromptStream(examples, 3).next_batch(100)] == [
        e.prompt for e in first
    ]
    assert [e.prompt for e in PromptStream(examples, 4).next_batch(100)] != [
        e.prompt for e in first
    ]


def test_position_round_trips_across_an_epoch_boundary() -> None:
    examples = addition_examples()
    straight = PromptStream(examples, seed=1)
    straight.next_batch(90)
    state = straight.state_dict()
    expected = [e.prompt for e in straight.next_batch(30)]
    resumed = PromptStream(examples, seed=999)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [e.prompt for e in resumed.next_batch(30)] == expected


def test_jsonl_and_parquet_with_a_prompt_template(tmp_path: Path) -> None:
    rows = [{"q": "1+1", "a": "2"}, {"q": "2+2", "a": "4"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for src in (jsonl, parquet):
        cfg = DataConfig(
            source=str(src),
            prompt_field="q",
            answer_field="a",
            prompt_template="Q: {prompt}\nA:",
            chat_template=False,
        )
        examples = load_examples(cfg)
        assert [(e.prompt, e.answer) for e in examples] == [
            ("Q: 1+1\nA:", "2"),
            ("Q: 2+2\nA:", "4"),
        ]


def test_missing_field_names_the_field_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"no field 'prompt'.*promptField"):
        load_examples(DataConfig(source=str(path)))
    with pytest.raises(ValueError, match="cannot tell its format"):
        load_examples(DataConfig(source=str(tmp_path / "data.csv")))
