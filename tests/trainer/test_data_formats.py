"""Data as TRL and verl users have it: conversational prompts through the chat template, the
row shapes of verl's GSM8K preparation (examples/data_preprocess/gsm8k.py) and of TRL's
dataset formats, dotted fields, one-line errors naming file, row and field, and Hub datasets
read from the cache a download leaves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gspo_api.spec import DataConfig
from gspo_trainer.data import DataError, load_eval_examples, load_examples

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    from gspo_trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def verl_gsm8k_row(i: int, question: str, solution: str) -> dict[str, Any]:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it to parquet."""
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": "train",
            "index": i,
            "answer": f"... #### {solution}",
            "question": question,
        },
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_gsm8k_parquet_renders_its_conversation(tmp_path: Path, chat_tokenizer: Any) -> None:
    src = write_parquet(
        tmp_path / "train.parquet", [verl_gsm8k_row(0, "1+1?", "2"), verl_gsm8k_row(1, "2+3?", "5")]
    )
    cfg = DataConfig(
        source=str(src), answer_field="reward_model.ground_truth", system_prompt="Be brief."
    )
    examples = load_examples(cfg, chat_tokenizer)
    assert [e.answer for e in examples] == ["2", "5"]
    assert examples[0].prompt == (
        "<|system|>Be brief.\n<|user|>1+1? Let's think step by step and output the final "
        'answer after "####".\n<|assistant|>'
    )
    assert examples[1].row["extra_info"]["index"] == 1  # kept for verl's reward functions
    assert examples[1].row["data_source"] == "openai/gsm8k"


def test_trl_conversational_prompt_keeps_its_own_system_message(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Think."},
                {"role": "user", "content": "3+4?"},
            ],
            "solution": "7",
        }
    ]
    src = write_jsonl(tmp_path / "trl.jsonl", rows)
    cfg = DataConfig(source=str(src), answer_field="solution", system_prompt="ignored")
    (example,) = load_examples(cfg, chat_tokenizer)
    assert example.prompt == "<|system|>Think.\n<|user|>3+4?\n<|assistant|>"
    assert example.source_prompt == rows[0]["prompt"]
    # Text prompts (TRL's standard format) still go through the template as a user turn.
    src = write_jsonl(tmp_path / "std.jsonl", [{"prompt": "3+4?", "solution": "7"}])
    (text,) = load_examples(cfg.model_copy(update={"source": str(src)}), chat_tokenizer)
    assert text.prompt == "<|system|>ignored\n<|user|>3+4?\n<|assistant|>"


def test_a_dotted_field_reaches_nested_values_and_a_dotted_key_wins(tmp_path: Path) -> None:
    rows = [{"q": {"text": "a"}, "reward_model": {"ground_truth": 4}, "x.y": "flat"}]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(
        source=str(src),
        prompt_field="q.text",
        answer_field="reward_model.ground_truth",
        chat_template=False,
    )
    assert [(e.prompt, e.answer) for e in load_examples(cfg)] == [("a", "4")]
    flat = cfg.model_copy(update={"answer_field": "x.y"})
    assert load_examples(flat)[0].answer == "flat"


@pytest.mark.parametrize(
    ("rows", "cfg", "field", "says"),
    [
        (
            [{"prompt": "p", "answer": "1"}, {"prompt": "p"}],
            {},
            "answerField",
            r"/d.jsonl' line 2 has no field 'answer' \(fields: \['prompt'\]\); set data\.",
        ),
        (
            [{"prompt": [{"role": "user"}], "answer": "1"}],
            {},
            "promptField",
            r"line 1 field 'prompt'\[0\].content is null, not text",
        ),
        (
            [{"prompt": [{"role": "user", "content": [{"type": "image"}]}], "answer": "1"}],
            {},
            "promptField",
            r"content is a list, not text \(content parts",
        ),
        (
            [{"prompt": {"text": "p"}, "answer": "1"}],
            {},
            "promptField",
            r"field 'prompt' is a mapping with keys \['text'\]; a prompt is text or a list",
        ),
        (
            [{"prompt": "p", "answer": {"ground_truth": "1"}}],
            {},
            "answerField",
            r"not text or a number \(point data.answerField at the text inside it",
        ),
        (
            [{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}],
            {"chat_template": False},
            "chatTemplate",
            r"is a conversation.*set data.chatTemplate",
        ),
        (
            [{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}],
            {"prompt_template": "Q: {prompt}"},
            "promptTemplate",
            r"remove promptTemplate",
        ),
        (["just text"], {}, None, r"line 1 is a str, not a mapping of fields"),
    ],
)
def test_a_row_the_reader_cannot_use_names_file_row_and_field(
    tmp_path: Path, rows: list[Any], cfg: dict[str, Any], field: str | None, says: str
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=says) as err:
        load_examples(DataConfig(source=str(src), **cfg))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_a_line_that_is_not_json_and_a_tokenizer_without_a_template(tmp_path: Path) -> None:
    from gspo_trainer.tiny import build_tokenizer

    src = tmp_path / "d.jsonl"
    src.write_text('{"prompt": "p", "answer": "1"}\n\n{"prompt": "p", answer: 1}\n')
    with pytest.raises(DataError, match=r"'.*d.jsonl' line 3: not JSON \(Expecting"):
        load_examples(DataConfig(source=str(src)))
    write_jsonl(src, [{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}])
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        load_examples(DataConfig(source=str(src)), build_tokenizer())


def test_preflight_names_the_spec_field_in_one_line(tmp_path: Path) -> None:
    from learner_helpers import tiny_spec

    from gspo_api.validation import parse_spec
    from gspo_trainer.preflight import check_data

    src = write_parquet(tmp_path / "t.parquet", [verl_gsm8k_row(0, "q", "1")])
    manifest = tiny_spec()
    manifest["spec"]["data"].update(source=str(src), answerField="reward_model.truth")
    (problem,) = check_data(parse_spec(manifest["spec"]))
    assert problem.path == "spec.data.answerField"
    assert str(problem).startswith(f"spec.data.answerField: {str(src)!r} row 0 has no field")
    manifest["spec"]["data"].update(answerField="reward_model.ground_truth", chatTemplate=False)
    (problem,) = check_data(parse_spec(manifest["spec"]))  # a conversation needs the template
    assert problem.path == "spec.data.chatTemplate"
    manifest["spec"]["data"]["chatTemplate"] = True
    assert check_data(parse_spec(manifest["spec"])) == []


# --- Hugging Face Hub datasets ---------------------------------------------------------------


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """openai/gsm8k (config main, splits train and test) in the datasets cache as a Hub
    download leaves it (datasets' builder: <namespace>___<name>/<config>/<version>/<hash>),
    and the Hub out of reach (HF_HUB_OFFLINE, as model.offline sets it)."""
    import datasets
    import huggingface_hub
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {
        split: str(
            write_parquet(tmp_path / f"{split}.parquet", [verl_gsm8k_row(0, f"{split} q", "42")])
        )
        for split in ("train", "test")
    }
    builder = Parquet(
        cache_dir=str(tmp_path / "build"),
        dataset_name="gsm8k",
        config_name="main",
        data_files=files,
        hash="0123abcd",
    )
    builder.download_and_prepare()
    cache = tmp_path / "hf" / "datasets"
    shutil.copytree(builder.cache_dir, cache / "openai___gsm8k" / "main" / "0.0.0" / "0123abcd")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_dataset_is_read_by_name_config_and_split(hub_cache: Path) -> None:
    cfg = DataConfig(
        source="openai/gsm8k",
        config="main",
        eval_source="openai/gsm8k",
        answer_field="reward_model.ground_truth",
    )
    (train,) = load_examples(cfg)
    assert train.prompt.startswith("user: train q") and train.answer == "42"
    (held,) = load_eval_examples(cfg) or []
    assert held.prompt.startswith("user: test q")  # data.evalSplit: test


def test_a_hub_dataset_not_in_the_cache_is_refused_offline(hub_cache: Path) -> None:
    with pytest.raises(
        DataError,
        match=r"'openai/MATH'.*not in this node's dataset cache.*"
        r"HF_HUB_OFFLINE=1 \(model.offline\) forbids",
    ):
        load_examples(DataConfig(source="openai/MATH"))
    with pytest.raises(DataError, match=r"Unknown split \"validation\".*set data.split") as err:
        load_examples(DataConfig(source="openai/gsm8k", config="main", split="validation"))
    assert err.value.field == "split"


def test_a_builtin_model_with_a_hub_dataset_may_download_it() -> None:
    from learner_helpers import tiny_spec

    from gspo_api.validation import parse_spec

    spec = tiny_spec()["spec"]
    assert parse_spec(spec).hub_offline  # built on the spot, nothing to download
    spec["data"].update(source="openai/gsm8k", config="main")
    assert not parse_spec(spec).hub_offline
    spec["model"]["offline"] = True
    assert parse_spec(spec).hub_offline


def test_a_hub_download_carries_hf_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from gspo_trainer.data import load_hub_dataset

    asked: list[tuple[Any, ...]] = []

    def load_dataset(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        asked.append((*args, kwargs))
        return [{"prompt": "p", "answer": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    load_hub_dataset("org/gated", "main", "train", "data.source", {"HF_TOKEN": "hf_x"})
    assert asked == [("org/gated", "main", {"split": "train", "token": "hf_x"})]


def test_a_saved_dataset_dict_reads_data_split(tmp_path: Path) -> None:
    import datasets

    rows = {"prompt": ["p"], "answer": ["1"]}
    splits = {"train": rows, "validation": {"prompt": ["v"], "answer": ["2"]}}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict(v) for k, v in splits.items()}
    ).save_to_disk(tmp_path / "saved")
    cfg = DataConfig(source=str(tmp_path / "saved"), chat_template=False)
    assert [e.prompt for e in load_examples(cfg)] == ["p"]
    held = cfg.model_copy(update={"eval_source": cfg.source, "eval_split": "validation"})
    assert [e.prompt for e in load_eval_examples(held) or []] == ["v"]
    with pytest.raises(DataError, match=r"'test' is not one of its splits.*set data.split"):
        load_examples(cfg.model_copy(update={"split": "test"}))


def test_a_dataset_repository_on_disk_is_read_like_the_hub(tmp_path: Path) -> None:
    """A clone of a Hub dataset repository (its README's configs name each split's files),
    e.g. git clone https://huggingface.co/datasets/openai/gsm8k onto a volume."""
    repo = tmp_path / "gsm8k"
    (repo / "main").mkdir(parents=True)
    for split in ("train", "test"):
        rows = [{"question": f"{split} q", "answer": "#### 3"}]
        write_parquet(repo / "main" / f"{split}-00000-of-00001.parquet", rows)
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - split: train\n    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n"
    )
    cfg = DataConfig(
        source=str(repo), config="main", split="test", prompt_field="question", chat_template=False
    )
    assert [(e.prompt, e.answer) for e in load_examples(cfg)] == [("test q", "#### 3")]
    with pytest.raises(DataError, match=r"config 'socratic'.*set data.config") as err:
        load_examples(cfg.model_copy(update={"config": "socratic"}))
    assert err.value.field == "config"


def test_a_chat_template_that_refuses_the_conversation_names_the_row(tmp_path: Path) -> None:
    """Templates raise on what they do not support (Gemma's on a system message, Mistral's on
    roles that do not alternate): a DataError naming the row and the field (exit 2 in the
    learner), not a traceback."""
    from gspo_trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}" + TEMPLATE
    )
    src = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    cfg = DataConfig(source=str(src), systemPrompt="Be brief.")
    with pytest.raises(DataError, match=r"line 1 .*System role not supported") as caught:
        load_examples(cfg, tok)
    assert caught.value.field == "systemPrompt"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    src = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "4"}])
    with pytest.raises(DataError, match=r"line 1 field 'prompt'.*System role") as caught:
        load_examples(DataConfig(source=str(src)), tok)
    assert caught.value.field == "promptField"
