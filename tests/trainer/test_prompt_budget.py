"""data.maxPromptTokens is enforced before anything is sent: a prompt no rollout server would
accept is left out at start, counted and logged once; none fitting is an error naming the field.
A prompt the servers refuse anyway (a 400 for it) is dropped from its step, never retried."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from learner_helpers import WrappedFleet, make_learner, tiny_spec

from gspo_trainer.data import Example, fit_prompts
from gspo_trainer.tiny import build_tokenizer


def test_prompts_past_the_limit_are_left_out_and_counted(caplog) -> None:  # type: ignore[no-untyped-def]
    tok = build_tokenizer()  # one token per character
    examples = [Example("1+2=", "3"), Example("11+22+33=", "6"), Example("4+5=", "9")]
    with caplog.at_level(logging.WARNING, logger="gspo.data"):
        kept, dropped = fit_prompts(examples, tok, 4)
    assert [e.prompt for e in kept] == ["1+2=", "4+5="] and dropped == 1
    assert len(caplog.records) == 1
    assert "1 of 3 prompts are longer than data.maxPromptTokens=4" in caplog.text
    assert "the longest has 9" in caplog.text
    assert fit_prompts(examples, tok, 9) == (examples, 0)  # the limit itself fits


def test_none_fitting_names_the_field_and_the_fix() -> None:
    """A configuration error (the learner exits 2, which JobSet does not retry), not a bare
    ValueError (exit 1, restarted backoffLimit times to fail the same way)."""
    from gspo_trainer.data import DataError

    tok = build_tokenizer()
    with pytest.raises(DataError, match=r"data.maxPromptTokens=3 .*shortest has 4.*raise") as e:
        fit_prompts([Example("1+2=", "3")], tok, 3)
    assert e.value.field == "maxPromptTokens"


def test_the_learner_trains_only_on_prompts_that_fit(tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": "1+2+3+4+5=", "answer": "5"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = tiny_spec()
    manifest["spec"]["data"].update(source=str(data), maxPromptTokens=8)
    manifest["spec"]["reward"] = {"kind": "math"}
    learner = make_learner(tmp_path / "models", None, manifest)
    assert sorted(e.prompt for e in learner.draws.stream.examples) == ["1+2=", "2+2="]
    get = learner.metrics.registry.get_sample_value
    assert get("gspo_prompts_dropped_total", {"set": "train"}) == 1


def test_chat_template_kwargs_reach_the_template() -> None:
    """data.chatTemplateKwargs, as vLLM's chat_template_kwargs: Qwen3's enable_thinking."""
    from gspo_api.spec import DataConfig
    from gspo_trainer.data import render_prompt

    tok = build_tokenizer()
    tok.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
        "{{ messages[-1]['content'] }}="
    )
    plain = DataConfig(source="x.jsonl")
    assert render_prompt(plain, "1+2", tok) == "1+2="
    off = DataConfig(source="x.jsonl", chatTemplateKwargs={"enable_thinking": False})
    assert render_prompt(off, "1+2", tok) == "<nothink>1+2="


class Refusing(WrappedFleet):
    """The in-process source, refusing one prompt as RolloutClient reports a server's 400."""

    def __init__(self, inner: Any, refused: list[int]) -> None:
        self.inner, self.refused, self.calls = inner, refused, 0

    async def generate(self, prompts: Any, params: Any) -> Any:
        from gspo_trainer.rollout.client import RequestRefused

        self.calls += 1
        if self.refused in prompts:
            raise RequestRefused("400 prompts[0] has too many tokens", prompts.index(self.refused))
        return await self.inner.generate(prompts, params)

    async def sync_weights(self, named: Any, version: int) -> Any:
        return await self.inner.sync_weights(named, version)


def test_a_prompt_the_servers_refuse_is_dropped_from_its_step(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    learner = make_learner(tmp_path / "models", None, tiny_spec(promptsPerStep=4))
    examples = learner.draws.stream.next_batch(4)
    bad = learner.collector.prompt_ids(examples)[2]
    learner.rollout = Refusing(learner.rollout, bad)
    asyncio.run(learner.sync(0))
    with caplog.at_level(logging.ERROR, logger="gspo.learner"):
        rollouts = asyncio.run(learner.collector.collect(1, examples))
    assert rollouts is not None and learner.rollout.calls == 2  # refused once, then served
    assert rollouts.prompts == [
        p for i, p in enumerate(learner.collector.prompt_ids(examples)) if i != 2
    ]
    assert len(rollouts.responses) == 3 * learner.spec.algorithm.group_size
    assert repr(examples[2].prompt) in caplog.text and "refuse" in caplog.text
    sample = learner.metrics.registry.get_sample_value
    assert sample("gspo_prompts_dropped_total", {"set": "train"}) == 1
