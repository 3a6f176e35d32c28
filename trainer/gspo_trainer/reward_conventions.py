"""Reward functions written for TRL or verl, called as those libraries call them, unchanged.

reward.convention (or a component's) says which: `trl` calls TRL's GRPOTrainer reward_funcs
convention once per batch, `verl` calls verl's compute_score once per response. Where each
argument comes from:

TRL (trl/trainer/grpo_trainer.py, GRPOTrainer._calculate_rewards, v1.16):
    prompts         the row's prompt as the data set holds it: text, or the conversation
    completions     decoded text; for a conversation [{"role": "assistant", "content": text}]
    completion_ids  the response's token ids
    **columns       every other field of the row, one list per field (e.g. solution)
    returns         one float per completion; None (the function does not apply) scores 0.
    Not given: trainer_state, log_extra, log_metric, environments (TRL's own objects); a
    function that takes **kwargs runs without them. An async function is awaited.

verl (verl/workers/reward_manager/naive.py, NaiveRewardManager; custom_reward_function):
    data_source     the row's data_source field (None without one)
    solution_str    decoded text of the response, special tokens skipped
    ground_truth    the reference answer, read through data.answerField
                    (reward_model.ground_truth for verl's preparations)
    extra_info      the row's extra_info field ({} without one)
    returns         a number, or a mapping whose "score" is the reward.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gspo_trainer.reward_types import Scored

BatchFn = Callable[[Sequence["Scored"]], list[float | None]]
TRL_RESERVED = ("prompt", "completion", "completion_ids")  # columns TRL does not pass on


def trl_batch(fn: Callable[..., Any]) -> BatchFn:
    """`fn(prompts, completions, completion_ids, **columns) -> list[float | None]` over a
    batch of scored items."""

    def call(items: Sequence[Scored]) -> list[float | None]:
        prompts = [i.prompt if i.source_prompt is None else i.source_prompt for i in items]
        completions: list[Any] = [
            [{"role": "assistant", "content": i.completion}]
            if isinstance(p, list)
            else i.completion
            for i, p in zip(items, prompts, strict=True)
        ]
        keys = [k for k in (items[0].row if items else {}) if k not in TRL_RESERVED]
        columns = {k: [i.row.get(k) for i in items] for k in keys}
        ids = [list(i.token_ids or ()) for i in items]
        out = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        if not isinstance(out, Sequence) or isinstance(out, str) or len(out) != len(items):
            shown = len(out) if isinstance(out, Sequence) else type(out).__name__
            raise ValueError(
                f"returned {shown} rewards for {len(items)} completions; a TRL reward "
                "function returns one float (or None) per completion"
            )
        return [None if r is None else float(r) for r in out]

    return call


async def _awaited(out: Any) -> Any:
    return await out


def verl_item(fn: Callable[..., Any]) -> Callable[[Scored], float]:
    """`fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}`."""

    def call(item: Scored) -> float:
        out = fn(
            data_source=item.row.get("data_source"),
            solution_str=item.completion,
            ground_truth=item.answer,
            extra_info=item.row.get("extra_info") or {},
        )
        if isinstance(out, Mapping):
            if "score" not in out:
                raise ValueError(f"returned a mapping without 'score' (keys {sorted(out)})")
            out = out["score"]
        return float(out)

    return call
