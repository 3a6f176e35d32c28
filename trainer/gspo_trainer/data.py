"""Prompts for the learner: the built-in tasks (gspo_api.tasks), jsonl, parquet, a local HF dataset
or a Hugging Face Hub dataset, in the row shapes TRL's and verl's preparations write.

A prompt is text or a conversation (a list of {role, content} messages: TRL's conversational
format, verl's parquet `prompt` column), which the tokenizer's chat template renders. Fields
are found by a dotted path (`reward_model.ground_truth`). A row the reader cannot use is a
`DataError` naming the file, the row and the field. `PromptStream` walks the examples in a
fresh seeded shuffle each epoch; its position (epoch, index) goes into checkpoints so a
resumed run sees the very prompts it would have.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_api.spec import DataConfig, looks_like_hub_name
from gspo_api.tasks import BUILTIN_TASKS, Problem
from gspo_api.validation import ConfigError

log = logging.getLogger("gspo.data")

Message = dict[str, Any]  # {"role": ..., "content": ...} and whatever else the row had


@dataclass(frozen=True)
class Example:
    prompt: str  # rendered prompt text, as sent to the model
    answer: str  # reference answer the reward checks against
    # The prompt as the row had it (text, or messages) and the whole row: what TRL's and
    # verl's reward functions are given (rewards.py).
    source_prompt: str | list[Message] | None = field(default=None, compare=False)
    row: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


class DataError(ConfigError):
    """A data set the reader cannot use; `field` is the DataConfig field to fix (camelCase),
    or None for the source itself. A configuration error: the learner exits 2 on it, which
    JobSet does not retry."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _problem_examples(problems: list[Problem]) -> list[Example]:
    """A built-in task's problems, each with its row {prompt, answer} (the columns a TRL
    reward function is given)."""
    return [Example(p, a, p, {"prompt": p, "answer": a}) for p, a in problems]


def addition_examples() -> list[Example]:
    """builtin:addition: every "a+b=" with single digits (100 examples)."""
    return _problem_examples(BUILTIN_TASKS["builtin:addition"].train())


def builtin_examples(name: str, what: str, *, evaluation: bool = False) -> list[Example]:
    """A built-in task's training problems (or its evaluation set); an unknown name is a
    DataError naming `what` (data.source or data.evalSource) and the tasks there are."""
    task = BUILTIN_TASKS.get(name)
    if task is None:
        raise DataError(
            f"{what} {name!r} is not a built-in task; use one of {', '.join(BUILTIN_TASKS)}"
        )
    return _problem_examples(task.evaluation() if evaluation else task.train())


def _format_of(cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    src = cfg.source
    if src.startswith("builtin:"):
        return "builtin"
    if src.endswith((".jsonl", ".json")):
        return "jsonl"
    if src.endswith(".parquet"):
        return "parquet"
    if Path(src).is_dir():  # save_to_disk's, or a dataset repository's files (a clone)
        saved = any((Path(src) / f).is_file() for f in SAVED_MARKERS)
        return "hf-dataset" if saved else "hub"
    if not Path(src).exists() and looks_like_hub_name(src):
        return "hub"
    raise DataError(
        f"data.source {src!r}: cannot tell its format; name a .jsonl or .parquet file, a "
        "directory saved with datasets' save_to_disk or holding a dataset repository, a Hub "
        "dataset (owner/name), or set data.format"
    )


# What datasets' save_to_disk writes at the top of a DatasetDict's or a Dataset's directory.
SAVED_MARKERS = ("dataset_dict.json", "state.json")


def _jsonl_rows(src: str, what: str) -> Iterator[tuple[str, Any]]:
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{what} {src!r} line {n}: not JSON ({exc.msg} at "
                    f"column {exc.colno}); write one JSON object per line"
                ) from exc


def _pick_split(ds: Any, split: str, what: str) -> Any:
    """The split of a saved DatasetDict; one split is read whatever its name."""
    if not hasattr(ds, "keys"):
        return ds
    names = list(ds.keys())
    if split in names:
        return ds[split]
    if len(names) == 1:
        return ds[names[0]]
    field = "split" if what == "data.source" else "evalSplit"
    raise DataError(f"{what} {split!r} is not one of its splits {names}; set data.{field}", field)


def load_hub_dataset(
    name: str, config: str | None, split: str, what: str, environ: Mapping[str, str] | None = None
) -> Any:
    """A Hugging Face Hub dataset's split (or a local directory holding a dataset
    repository's files, its README's configs included), as datasets.load_dataset reads it:
    downloaded once
    into the datasets cache under HF_HOME (the model cache volume on a cluster), with HF_TOKEN
    for a gated or private one, read from the cache alone with HF_HUB_OFFLINE=1. Errors
    are one line naming the field."""
    import datasets

    env = os.environ if environ is None else environ
    offline = bool(datasets.config.HF_HUB_OFFLINE)  # HF_HUB_OFFLINE, as datasets read it
    field = "split" if what == "data.source" else "evalSplit"
    shown = f"{what} {name!r} (config {config!r}, split {split!r})"
    try:
        return datasets.load_dataset(name, config, split=split, token=env.get("HF_TOKEN"))
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        if "split" in first.lower():
            raise DataError(f"{shown}: {first}; set data.{field}", field) from exc
        if "config" in first.lower():
            raise DataError(f"{shown}: {first}; set data.config", "config") from exc
        raise DataError(f"{shown}: {first}") from exc
    except (ConnectionError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if offline:
            raise DataError(
                f"{shown} is not in this node's dataset cache ({datasets.config.HF_DATASETS_CACHE}"
                ") and HF_HUB_OFFLINE=1 (model.offline) forbids downloading it; run once with "
                "the Hub reachable, or give a local file"
            ) from exc
        raise DataError(
            f"{shown}: cannot download it ({first}); check the name, HF_TOKEN "
            "(model.hfTokenSecret) for a gated one, and the network"
        ) from exc


def _rows(cfg: DataConfig, split: str, what: str) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the source: where is "line 3" or "row 2"."""
    fmt, src = _format_of(cfg), cfg.source
    if fmt == "hub":
        yield from (
            (f"row {i}", r) for i, r in enumerate(load_hub_dataset(src, cfg.config, split, what))
        )
        return
    if not Path(src).exists():
        raise DataError(
            f"{what} {src!r} does not exist on this node; mount the data set or fix the path"
        )
    if fmt == "jsonl":
        yield from _jsonl_rows(src, what)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        yield from ((f"row {i}", r) for i, r in enumerate(pq.read_table(src).to_pylist()))
    elif fmt == "hf-dataset":
        from datasets import load_from_disk

        ds = _pick_split(load_from_disk(src), split, what)
        yield from ((f"row {i}", r) for i, r in enumerate(ds))
    else:
        raise DataError(f"data.format {fmt!r} is not a file format", "format")


_MISSING = object()


def field_value(row: Mapping[str, Any], path: str) -> Any:
    """row[path], or by a dotted path through nested mappings (verl's
    reward_model.ground_truth); a key that itself holds dots wins. _MISSING if absent."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _conversation(value: list[Any], at: str) -> list[Message]:
    """The messages of a conversational prompt, each with a role and text content."""
    if not value:
        raise DataError(
            f"{at} is an empty list; give text or {{role, content}} messages", "promptField"
        )
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DataError(
                f"{at}[{i}] is not a {{role, content}} message ({_kind(m)}); "
                "a prompt is text or a list of such messages",
                "promptField",
            )
        if not isinstance(m.get("content"), str):
            raise DataError(
                f"{at}[{i}].content is {_kind(m.get('content'))}, not text "
                "(content parts such as images are not supported)",
                "promptField",
            )
    return [dict(m) for m in value]


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(value)}"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def render_prompt(cfg: DataConfig, text: str, tokenizer: Any | None) -> str:
    """prompt_template first, then the chat template when asked for and the tokenizer has one."""
    if cfg.prompt_template:
        text = cfg.prompt_template.format(prompt=text)
    if cfg.chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return render_messages(cfg, [{"role": "user", "content": text}], tokenizer)
    return text


def render_messages(cfg: DataConfig, messages: list[Message], tokenizer: Any) -> str:
    """A conversation through the tokenizer's chat template, ready for the assistant's
    turn; data.systemPrompt first unless the conversation opens with a system message."""
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **cfg.chat_template_kwargs
    )


def _check_conversation_settings(cfg: DataConfig, tokenizer: Any | None, at: str) -> None:
    """A conversation needs the chat template; a text template cannot apply to it."""
    if cfg.prompt_template:
        raise DataError(
            f"{at} is a conversation, which data.promptTemplate (for text "
            "prompts) cannot format; remove promptTemplate or give text prompts",
            "promptTemplate",
        )
    if not cfg.chat_template:
        raise DataError(
            f"{at} is a conversation, which only the tokenizer's chat template "
            "renders; set data.chatTemplate true",
            "chatTemplate",
        )
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{at} is a conversation and the tokenizer has no chat template; use "
            "a model (or model.tokenizer) with one, or give text prompts",
            "promptField",
        )


def _answer(value: Any, at: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    hint = " (point data.answerField at the text inside it, e.g. reward_model.ground_truth)"
    raise DataError(
        f"{at} is {_kind(value)}, not text or a number{hint if isinstance(value, Mapping) else ''}",
        "answerField",
    )


def example_of(
    cfg: DataConfig, row: Any, where: str, tokenizer: Any | None, what: str = "data.source"
) -> Example:
    """One row as an Example, or a DataError naming the file, the row and the field."""
    head = f"{what} {cfg.source!r} {where}"
    if not isinstance(row, Mapping):
        raise DataError(f"{head} is {_kind(row)}, not a mapping of fields")
    values = {}
    for name, key in (("promptField", cfg.prompt_field), ("answerField", cfg.answer_field)):
        values[name] = field_value(row, key)
        if values[name] is _MISSING:
            raise DataError(
                f"{head} has no field {key!r} (fields: {sorted(row)}); set data.{name}", name
            )
    prompt, at = values["promptField"], f"{head} field {cfg.prompt_field!r}"
    answer = _answer(values["answerField"], f"{head} field {cfg.answer_field!r}")
    if isinstance(prompt, str):
        text = _templated(cfg, at, [], lambda: render_prompt(cfg, prompt, tokenizer))
        return Example(text, answer, prompt, row)
    if not isinstance(prompt, list | tuple):
        raise DataError(
            f"{at} is {_kind(prompt)}; a prompt is text or a list of {{role, content}} messages",
            "promptField",
        )
    messages = _conversation(list(prompt), at)
    _check_conversation_settings(cfg, tokenizer, at)
    if tokenizer is None:  # checked only (preflight): the learner renders with its tokenizer
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    else:
        text = _templated(cfg, at, messages, lambda: render_messages(cfg, messages, tokenizer))
    return Example(text, answer, messages, row)


def _templated(cfg: DataConfig, at: str, messages: list[Message], render: Any) -> str:
    """`render()`, or a DataError when the chat template refuses the prompt: templates
    raise on what they do not support (a system message, roles that do not alternate)."""
    from jinja2 import TemplateError

    try:
        return str(render())
    except TemplateError as exc:
        if cfg.system_prompt and (not messages or messages[0].get("role") != "system"):
            field, fix = "systemPrompt", "remove data.systemPrompt"
        elif messages:
            field, fix = "promptField", "fix the conversation"
        else:
            field, fix = "chatTemplate", "set data.chatTemplate false"
        raise DataError(
            f"{at}: the tokenizer's chat template refused it ({exc}); {fix} or use a model "
            "(or model.tokenizer) whose template accepts it",
            field,
        ) from exc


def load_examples(
    cfg: DataConfig,
    tokenizer: Any | None = None,
    *,
    what: str = "data.source",
    split: str | None = None,
) -> list[Example]:
    """Every row of `cfg.source` as an Example (`what`, `split`: for the evaluation set)."""
    fmt = _format_of(cfg)
    if fmt == "builtin":
        return builtin_examples(cfg.source, what)
    out = [
        example_of(cfg, row, where, tokenizer, what)
        for where, row in _rows(cfg, split or cfg.split, what)
    ]
    if not out:
        raise DataError(f"{what} {cfg.source!r} holds no rows")
    return out


def load_eval_examples(cfg: DataConfig, tokenizer: Any | None = None) -> list[Example] | None:
    """The evaluation set, kept apart from the training stream: data.evalSource (held out,
    read like source), or a built-in task's own (gspo_api.tasks): builtin:sort's 100 held-out
    problems; for builtin:addition all of its 100 problems, which are also its training
    problems (the task has no others, so its evaluation measures how much of the table the
    policy has learned, not generalisation). None: a data set of your own without an
    evalSource, which is not evaluated (evaluating on training prompts would flatter it).
    An evalSource naming a built-in task reads that task's evaluation set."""
    if cfg.eval_source:
        held_out = cfg.model_copy(update={"source": cfg.eval_source})
        if _format_of(held_out) == "builtin":
            return builtin_examples(cfg.eval_source, "data.evalSource", evaluation=True)
        return load_examples(held_out, tokenizer, what="data.evalSource", split=cfg.eval_split)
    if _format_of(cfg) == "builtin":
        return builtin_examples(cfg.source, "data.source", evaluation=True)
    return None


def fit_prompts(
    examples: list[Example], tokenizer: Any, limit: int, what: str = "data.source"
) -> tuple[list[Example], int]:
    """(the examples whose prompt is at most `limit` tokens, how many were left out).

    Tokens are counted as the learner sends prompts (no special tokens added). A prompt past
    data.maxPromptTokens would be refused by every rollout server it reached (the engine's
    context is maxPromptTokens + maxResponseTokens), so it is dropped here, once, with one
    log line, rather than failing a step. None fitting is an error naming the field.
    """
    lengths = [len(tokenizer(e.prompt, add_special_tokens=False).input_ids) for e in examples]
    kept = [e for e, n in zip(examples, lengths, strict=True) if n <= limit]
    dropped = len(examples) - len(kept)
    if not kept:
        raise DataError(
            f"{what}: all {len(examples)} prompts are longer than data.maxPromptTokens={limit} "
            f"tokens (the shortest has {min(lengths)}); raise data.maxPromptTokens (and "
            "model.maxModelLen with it) or shorten the prompts",
            "maxPromptTokens",
        )
    if dropped:
        log.warning(
            "%s: %d of %d prompts are longer than data.maxPromptTokens=%d tokens "
            "(the longest has %d) and are left out",
            what,
            dropped,
            len(examples),
            limit,
            max(lengths),
        )
    return kept, dropped


class PromptStream:
    """Endless batches of examples: a new seeded shuffle every epoch."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            batch.append(self.examples[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)
