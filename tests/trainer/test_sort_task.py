"""builtin:sort and its positional reward: the problems (lengths, determinism, the held-out
split), partial credit per position and per token, and the limits that must hold it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gspo_api.spec import DataConfig, RewardConfig
from gspo_api.tasks import (
    DISTINCT_MAX_DIGITS,
    DISTINCT_MIN_DIGITS,
    SORT3_MAX_DIGITS,
    SORT3_MIN_DIGITS,
    SORT3_SYMBOLS,
    SORT_MAX_DIGITS,
    SORT_MIN_DIGITS,
)
from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.data import load_eval_examples, load_examples
from gspo_trainer.preflight import check_data
from gspo_trainer.rewards import (
    Scored,
    build_scorer,
    positional_reward,
    sequence_reward,
    tokenizer_answer_ids,
)

REPO = Path(__file__).resolve().parents[2]
SORT = DataConfig(source="builtin:sort")


def test_sort_problems_vary_in_length_and_average_at_least_eight_response_tokens() -> None:
    examples = load_examples(SORT)
    lengths = [len(e.answer) for e in examples]
    assert set(lengths) == set(range(SORT_MIN_DIGITS, SORT_MAX_DIGITS + 1))
    assert sum(n + 1 for n in lengths) / len(lengths) >= 8  # the answer, then EOS
    for e in examples[:200]:
        digits = e.prompt.removesuffix("=")
        assert e.prompt.endswith("=") and digits.isdigit()
        assert e.answer == "".join(sorted(digits))
        assert e.row == {"prompt": e.prompt, "answer": e.answer}  # what rewards are given
    assert len({e.prompt for e in examples}) == len(examples)


def test_sort_problems_are_the_same_in_every_process_and_evaluation_is_held_out() -> None:
    train, held_out = load_examples(SORT), load_eval_examples(SORT)
    assert held_out is not None and len(held_out) == 100
    assert train == load_examples(SORT) and held_out == load_eval_examples(SORT)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert len({len(e.answer) for e in held_out}) > 4
    # data.evalSource naming the task reads its held-out set, not its training problems
    other = DataConfig(source="builtin:addition", evalSource="builtin:sort")
    assert load_eval_examples(other) == held_out


def scored(completion: str, finished: bool = True, answer: str = "1123") -> Scored:
    return Scored("3121=", completion, answer, finished, len(completion) + finished)


@pytest.mark.parametrize(
    ("completion", "finished", "share"),
    [
        ("1123", True, 1.0),  # exact, then EOS: the only full score
        ("1123", False, 4 / 5),  # cut before EOS: the EOS position is wrong
        ("1133", True, 4 / 5),
        ("112", True, 3 / 5),  # too short: EOS where "3" belongs
        ("11", True, 2 / 5),
        ("11233", True, 4 / 6),  # too long: the extra position counts against it
        ("11233333", False, 4 / 8),
        ("", True, 0.0),
        ("", False, 0.0),
    ],
)
def test_positional_reward_is_the_share_of_positions_right(
    completion: str, finished: bool, share: float
) -> None:
    item = scored(completion, finished)
    assert positional_reward(item) == pytest.approx(share)
    per_token = positional_reward(item, per_token=True)
    if completion or finished:
        assert isinstance(per_token, tuple) and len(per_token) == item.tokens
    assert sequence_reward(per_token) == pytest.approx(share)  # the response's one reward


def test_per_token_scores_credit_each_position() -> None:
    assert positional_reward(scored("1133"), per_token=True) == (1.0, 1.0, 0.0, 1.0, 1.0)
    # too long: the tokens past the answer and its EOS score 0
    assert positional_reward(scored("112345"), per_token=True) == (1, 1, 1, 1, 0, 0, 0)
    # too short: right tokens share the missing positions' loss, the early EOS scores 0
    assert positional_reward(scored("11"), per_token=True) == pytest.approx((3 / 5, 3 / 5, 0))
    # not one token per position (a tokenizer with longer tokens): one number
    assert positional_reward(Scored("", "1123", "1123", True, 2), per_token=True) == 1.0


def test_per_token_scores_line_up_with_the_built_in_tokenizers_tokens() -> None:
    from gspo_trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    ids = [*tok("1933", add_special_tokens=False).input_ids, tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=True)
    item = Scored("3121=", text, "1123", True, len(ids), ids)
    token_level = build_scorer(RewardConfig(kind="positional"), per_token=True)
    assert text == "1933"
    assert token_level.scores([item]) == [(1.0, 0.0, 0.0, 1.0, 1.0)]
    assert token_level.score([item]) == [pytest.approx(3 / 5)]
    # under gspo and grpo (one advantage per response) the kind gives one number
    assert build_scorer(RewardConfig(kind="positional")).scores([item]) == [3 / 5]
    # as a weighted component too, a number (format) counting on every token
    components = [{"name": "pos", "kind": "positional"}, {"name": "f", "kind": "format"}]
    cfg = RewardConfig(functions=[*components[:1], {**components[1], "weight": 0.5}])
    assert build_scorer(cfg, per_token=True).score_components([item])[0] == [
        (1.5, 0.5, 0.5, 1.5, 1.5)
    ]


def test_with_token_ids_every_token_is_a_position_pads_included() -> None:
    """The decoded text drops special tokens: "1123" with pads where its EOS belongs would
    read as the answer cut before EOS. Scored on token ids, each pad is a wrong position."""
    from gspo_trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    answer_ids = tokenizer_answer_ids(tok)
    padded = [*tok("1123", add_special_tokens=False).input_ids, *[tok.pad_token_id] * 4]
    item = Scored("3121=", "1123", "1123", False, len(padded), padded)
    assert positional_reward(item) == pytest.approx(4 / 5)  # the text alone is fooled
    assert positional_reward(item, answer_ids=answer_ids) == pytest.approx(4 / 8)
    assert positional_reward(item, True, answer_ids) == (1, 1, 1, 1, 0, 0, 0, 0)
    exact = [*padded[:4], tok.eos_token_id]
    item = Scored("3121=", "1123", "1123", True, 5, exact)
    assert positional_reward(item, True, answer_ids) == (1.0,) * 5
    scorer = build_scorer(RewardConfig(kind="positional"), tokenizer=tok)
    assert scorer.score([item]) == [1.0]


def test_a_response_cut_before_its_eos_scores_nothing() -> None:
    """As for arithmetic: otherwise a run of rising digits to maxResponseTokens still earns
    part of the credit, and a policy learns to never end its answers."""
    cut = scored("1123", finished=False)
    for per_token in (False, True):
        scorer = build_scorer(RewardConfig(kind="positional"), per_token=per_token)
        assert scorer.scores([cut, scored("1123")]) == [0.0, (1.0,) * 5 if per_token else 1.0]


def sort_spec(**overrides: Any) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "examples/sort.yaml").read_text())["spec"]
    for path, value in overrides.items():
        section, field = path.split(".")
        spec[section][field] = value
    return spec


def problems(spec: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return {p.path: p.message for p in info.value.problems}


def test_the_example_holds_the_task() -> None:
    spec = parse_spec(sort_spec())
    assert (spec.data.source, spec.reward.kind) == ("builtin:sort", "positional")


def test_limits_too_short_for_the_task_name_the_field_and_the_fix() -> None:
    found = problems(sort_spec(**{"data.maxPromptTokens": 12, "algorithm.maxResponseTokens": 12}))
    assert found["spec.data.maxPromptTokens"].startswith(
        "12 is shorter than builtin:sort's longest prompt (13 tokens); raise it to 13"
    )
    assert "longest answer and its EOS (13 tokens)" in found["spec.algorithm.maxResponseTokens"]
    # the model's context must hold both (the rule every job has)
    found = problems(sort_spec(**{"model.maxModelLen": 24}))
    assert list(found) == ["spec.model.maxModelLen"]


@pytest.mark.parametrize("field", ["source", "evalSource"])
def test_an_unknown_built_in_task_names_the_field(field: str) -> None:
    found = problems(sort_spec(**{f"data.{field}": "builtin:reverse"}))
    assert found == {
        f"spec.data.{field}": "'builtin:reverse' is not a built-in task; use one of "
        "builtin:addition, builtin:sort, builtin:sort3, builtin:sort-distinct"
    }


def test_the_learners_preflight_names_the_field_too() -> None:
    """A spec that skipped `gspo validate` still stops at the learner's preflight."""
    spec = parse_spec(sort_spec()).model_copy()
    spec.data = DataConfig(source="builtin:reverse")
    (problem,) = check_data(spec)
    assert problem.path == "spec.data.source"
    assert "'builtin:reverse' is not a built-in task" in problem.message


def test_a_learner_step_on_the_sort_task_credits_each_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task, its reward and GSPO-token through a learner step (in-process rollouts):
    every response token's reward is its position's credit, and the evaluation is held out."""
    import asyncio

    import torch
    from learner_helpers import make_learner, tiny_spec

    import gspo_trainer.learner as learner_module

    seen = []
    real_pack = learner_module.pack
    monkeypatch.setattr(learner_module, "pack", lambda *a: seen.append(real_pack(*a)) or seen[-1])
    manifest = tiny_spec(lossLevel="gspo-token", promptsPerStep=2, groupSize=4, miniBatches=1,
                         maxResponseTokens=13, evalEverySteps=100)  # fmt: skip
    spec = manifest["spec"]
    spec["model"]["maxModelLen"] = 32
    spec["data"] = {"source": "builtin:sort", "chatTemplate": False, "maxPromptTokens": 13}
    spec["reward"] = {"kind": "positional"}
    learner = make_learner(tmp_path, None, manifest)
    tok = learner.tokenizer
    asyncio.run(learner.sync(0))
    asyncio.run(learner.train_step(1))
    (packed,) = seen
    assert packed.token_rewards is not None
    ended = 0
    for i, n in enumerate(map(int, packed.lengths.tolist())):
        ids = packed.ids[i, : int(packed.attn[i].sum())].tolist()
        prompt, response = tok.decode(ids[:-n]), ids[-n:]
        finished = response[-1] == tok.eos_token_id
        text = tok.decode(response, skip_special_tokens=True)
        answer = "".join(sorted(prompt.removesuffix("=")))
        item = Scored(prompt, text, answer, finished, n, response)
        want = positional_reward(item, per_token=True, answer_ids=tokenizer_answer_ids(tok))
        want = want if finished else (0.0,) * n  # cut at maxResponseTokens: nothing
        ended += finished
        got = packed.token_rewards[i][packed.mask[i]]
        torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype).reshape(-1))
        assert float(packed.rewards[i]) == pytest.approx(sequence_reward(want))
    assert ended  # some responses are scored position by position
    held_out = {e.prompt for e in load_eval_examples(SORT) or []}
    assert learner.eval_examples and {e.prompt for e in learner.eval_examples} == held_out
    evaluation = asyncio.run(learner.collector.evaluate(1, learner.eval_examples[:4]))
    assert 0.0 <= evaluation["eval_accuracy"] <= 1.0


SORT3 = DataConfig(source="builtin:sort3")


def test_sort3_problems_are_runs_of_three_symbols_held_out_and_long_enough() -> None:
    train, held_out = load_examples(SORT3), load_eval_examples(SORT3)
    assert held_out is not None and len(held_out) == 100 and len(train) == 10_000
    lengths = [len(e.answer) for e in train]
    assert set(lengths) == set(range(SORT3_MIN_DIGITS, SORT3_MAX_DIGITS + 1))
    assert sum(n + 1 for n in lengths) / len(lengths) >= 8  # the answer, then EOS
    for e in [*train[:200], *held_out]:
        symbols = e.prompt.removesuffix("=")
        assert e.prompt.endswith("=") and set(symbols) <= set(SORT3_SYMBOLS)
        assert e.answer == "".join(sorted(symbols))
    assert len({e.prompt for e in train}) == len(train)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert train == load_examples(SORT3) and held_out == load_eval_examples(SORT3)
    # its own problems, not builtin:sort's drawn again
    assert not {e.prompt for e in held_out} & {e.prompt for e in load_eval_examples(SORT) or []}


def test_the_sort3_example_holds_the_task_and_its_limits_name_the_field() -> None:
    spec = yaml.safe_load((REPO / "examples/sort3.yaml").read_text())["spec"]
    parsed = parse_spec(spec)
    assert (parsed.data.source, parsed.reward.kind) == ("builtin:sort3", "positional")
    assert parsed.algorithm.max_response_tokens == SORT3_MAX_DIGITS + 1  # no room to run on
    spec["algorithm"]["maxResponseTokens"] = SORT3_MAX_DIGITS
    found = problems(spec)
    assert list(found) == ["spec.algorithm.maxResponseTokens"]
    assert (
        "builtin:sort3's longest answer and its EOS (11 tokens)"
        in found["spec.algorithm.maxResponseTokens"]
    )


DISTINCT = DataConfig(source="builtin:sort-distinct")


def test_sort_distinct_problems_are_distinct_digits_held_out_and_long_enough() -> None:
    train, held_out = load_examples(DISTINCT), load_eval_examples(DISTINCT)
    assert held_out is not None and len(held_out) == 100 and len(train) == 10_000
    lengths = [len(e.answer) for e in train]
    assert set(lengths) == set(range(DISTINCT_MIN_DIGITS, DISTINCT_MAX_DIGITS + 1))
    assert sum(n + 1 for n in lengths) / len(lengths) >= 8  # the answer, then EOS
    for e in [*train, *held_out]:
        digits = e.prompt.removesuffix("=")
        assert e.prompt.endswith("=") and len(set(digits)) == len(digits) and digits.isdigit()
        assert e.answer == "".join(sorted(digits))
    assert len({e.prompt for e in train}) == len(train)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert train == load_examples(DISTINCT) and held_out == load_eval_examples(DISTINCT)
    # the sets vary, not only their order: every digit is missing from some answer
    assert all(any(d not in e.answer for e in held_out) for d in "0123456789")


def test_the_sort_distinct_example_is_valid_and_capped_at_the_longest_answer() -> None:
    spec = parse_spec(yaml.safe_load((REPO / "examples/sort-distinct.yaml").read_text())["spec"])
    assert spec.data.source == "builtin:sort-distinct"
    assert spec.algorithm.max_response_tokens == DISTINCT_MAX_DIGITS + 1  # the answer, EOS
    assert spec.reward.kind == "positional" and spec.algorithm.loss_level == "gspo-token"
    assert spec.algorithm.token_baseline == "position"
    # what keeps it sampling (BENCHMARKS.md's five seeds ran with these)
    assert spec.algorithm.scale_rewards == "none" and spec.algorithm.entropy_coef == 0.1


@pytest.mark.parametrize("level", ["gspo", "grpo", "gspo-token"])
def test_the_loss_level_flag_on_the_example_keeps_a_valid_spec(level: str) -> None:
    """`gspo train examples/sort-distinct.yaml --loss-level gspo` (bench_train's default
    levels): a per-response objective takes the group's baseline, which the example's
    tokenBaseline position would refuse; gspo-token keeps it."""
    import argparse

    from gspo_trainer.train import job_manifest

    args = argparse.Namespace(
        config=str(REPO / "examples/sort-distinct.yaml"),
        overrides=[],
        max_steps=None,
        seed=None,
        loss_level=level,
    )
    spec = parse_spec(job_manifest(args)["spec"])
    assert spec.algorithm.loss_level == level
    assert spec.algorithm.token_baseline == ("position" if level == "gspo-token" else "group")
