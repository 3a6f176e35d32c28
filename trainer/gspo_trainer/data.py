"""Prompts for the learner: the built-in addition task, jsonl, parquet or a local HF dataset.

`PromptStream` walks the examples in a fresh seeded shuffle each epoch; its position
(epoch, index) goes into checkpoints so a resumed run sees the very prompts it would have.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_trainer.config import DataConfig

BUILTIN_ADDITION = "builtin:addition"
log = logging.getLogger("gspo.data")


@dataclass(frozen=True)
class Example:
    prompt: str  # rendered prompt text, as sent to the model
    answer: str  # reference answer the reward checks against


def addition_examples() -> list[Example]:
    """Every "a+b=" with single digits; the answer is the last digit of a+b (100 examples)."""
    return [Example(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]


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
    if Path(src).is_dir():
        return "hf-dataset"
    raise ValueError(
        f"data.source {src!r}: cannot tell its format; name a .jsonl or .parquet file, a "
        "directory saved with datasets' save_to_disk, or set data.format"
    )


def read_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    fmt, src = _format_of(cfg), cfg.source
    if fmt == "jsonl":
        with open(src, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(src).to_pylist()
    if fmt == "hf-dataset":
        from datasets import load_from_disk

        ds = load_from_disk(src)
        if hasattr(ds, "keys"):  # a DatasetDict: take its train split
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        return list(ds)
    raise ValueError(f"data.format {fmt!r} is not a file format")


def render_prompt(cfg: DataConfig, text: str, tokenizer: Any | None) -> str:
    """prompt_template first, then the chat template when asked for and the tokenizer has one."""
    if cfg.prompt_template:
        text = cfg.prompt_template.format(prompt=text)
    if cfg.chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **cfg.chat_template_kwargs)  # fmt: skip
    return text


def load_examples(cfg: DataConfig, tokenizer: Any | None = None) -> list[Example]:
    fmt = _format_of(cfg)
    if fmt == "builtin":
        if cfg.source != BUILTIN_ADDITION:
            raise ValueError(f"data.source {cfg.source!r}: the built-in task is {BUILTIN_ADDITION}")
        return addition_examples()
    out = []
    for i, row in enumerate(read_rows(cfg)):
        for key in (cfg.prompt_field, cfg.answer_field):
            if key not in row:
                raise ValueError(
                    f"data.source {cfg.source!r} row {i} has no field {key!r} (fields: "
                    f"{sorted(row)}); set data.promptField / data.answerField"
                )
        prompt = render_prompt(cfg, str(row[cfg.prompt_field]), tokenizer)
        out.append(Example(prompt, str(row[cfg.answer_field])))
    if not out:
        raise ValueError(f"data.source {cfg.source!r} holds no rows")
    return out


def load_eval_examples(cfg: DataConfig, tokenizer: Any | None = None) -> list[Example] | None:
    """The evaluation set, kept apart from the training stream: data.evalSource (held out,
    read like source), or for builtin:addition all of its 100 problems, which are also its
    training problems (the task has no others, so its evaluation measures how much of the
    table the policy has learned, not generalisation). None: a data set of your own without
    an evalSource, which is not evaluated (evaluating on training prompts would flatter it)."""
    if cfg.eval_source:
        return load_examples(cfg.model_copy(update={"source": cfg.eval_source}), tokenizer)
    if _format_of(cfg) == "builtin":
        return load_examples(cfg, tokenizer)
    return None


def fit_prompts(examples: list[Example], tokenizer: Any, limit: int,
                what: str = "data.source") -> tuple[list[Example], int]:  # fmt: skip
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
        raise ValueError(
            f"{what}: all {len(examples)} prompts are longer than data.maxPromptTokens={limit} "
            f"tokens (the shortest has {min(lengths)}); raise data.maxPromptTokens (and "
            "model.maxModelLen with it) or shorten the prompts"
        )
    if dropped:
        log.warning("%s: %d of %d prompts are longer than data.maxPromptTokens=%d tokens "
                    "(the longest has %d) and are left out", what, dropped, len(examples),
                    limit, max(lengths))  # fmt: skip
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
        batch = []
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
