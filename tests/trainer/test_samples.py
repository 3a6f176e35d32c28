"""Sample completions: which responses are picked, and that they reach the log and history
every metrics.samplesEverySteps steps with their own reward and advantage."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest
from learner_helpers import make_learner, tiny_spec

import gspo_trainer.advantages as advantages_module
from gspo_trainer.plot import read_history
from gspo_trainer.samples import format_samples, pick_samples, samples_due
from gspo_trainer.train import ProgressView, summary


def varied(prompt: str, completion: str, answer: str) -> float:
    """Spread inside most groups from the first step."""
    return float(sum(map(ord, completion)) % 7)


def test_best_then_worst_of_each_group_and_one_of_a_group_that_agrees() -> None:
    rewards = [0.0, 2.0, 1.0, 2.0, 5.0, 5.0, 5.0, 5.0, 3.0, 0.0, 0.0, 9.0]
    n = len(rewards)
    prompts = [f"p{i // 4}" for i in range(n)]
    responses = [f"r{i}" for i in range(n)]
    advantages = [r / 10 for r in rewards]
    picked = pick_samples(prompts, responses, rewards, advantages, 4, 4)
    # group 0: best is row 1 (first of the tie with row 3), worst row 0; group 1 agrees: row
    # 4 only; group 2: best row 11 (the count stops before its worst)
    assert [s["index"] for s in picked] == [1, 0, 4, 11]
    assert [s["group"] for s in picked] == [0, 0, 1, 2]
    for s in picked:
        i = s["index"]
        assert (s["prompt"], s["response"]) == (prompts[i], responses[i])
        assert (s["reward"], s["advantage"]) == (rewards[i], advantages[i])
    assert [s["index"] for s in pick_samples(prompts, responses, rewards, advantages, 4, 100)] == [
        1,
        0,
        4,
        11,
        9,
    ]
    with pytest.raises(ValueError, match="one of each per response"):
        pick_samples(prompts, responses[:-1], rewards, advantages, 4, 4)


def test_due_every_n_steps_and_never_at_zero() -> None:
    assert [s for s in range(1, 9) if samples_due(s, 3)] == [3, 6]
    assert not any(samples_due(s, 0) for s in range(1, 9))


def test_the_log_block_shows_each_sample() -> None:
    block = format_samples(
        7,
        [
            {
                "group": 2,
                "index": 17,
                "prompt": "3+4=",
                "response": "7",
                "reward": 1.0,
                "advantage": 0.75,
            }
        ],
    )
    assert block.splitlines() == [
        "Samples at step 7:",
        "  group 2 response 17: reward 1.000 advantage +0.750",
        "    '3+4=' -> '7'",
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_a_learner_logs_and_keeps_samples_every_n_steps(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = tiny_spec(miniBatches=1)
    manifest["spec"]["reward"] = {"kind": "python", "function": "test_samples:varied"}
    manifest["spec"]["metrics"].update(samplesEverySteps=2, samplesPerLog=3)
    history = tmp_path / "history.jsonl"
    learner = make_learner(cache, None, manifest, history_path=history)
    seen: list[tuple[list[float], list[float]]] = []  # each step's rewards and advantages
    original = advantages_module.group_advantages

    def recording(rewards, group_size, *args, **kwargs):
        adv, stats = original(rewards, group_size, *args, **kwargs)
        seen.append((rewards.tolist(), adv.tolist()))
        return adv, stats

    monkeypatch.setattr(advantages_module, "group_advantages", recording)
    asyncio.run(learner.sync(0))
    with caplog.at_level(logging.INFO, logger="gspo.learner"):
        stats = [asyncio.run(learner.train_step(step)) for step in (1, 2, 3)]

    records = read_history(history)
    assert [("samples" in r) for r in records] == [False, True, False]
    assert "samples" not in stats[0] and "samples" not in stats[2]
    samples = records[1]["samples"]
    assert samples == stats[1]["samples"] and len(samples) == 3
    rewards, advantages = seen[1]
    G = learner.spec.algorithm.group_size
    for s in samples:
        i = s["index"]
        assert s["group"] == i // G
        assert s["reward"] == pytest.approx(rewards[i])
        assert s["advantage"] == pytest.approx(advantages[i])
        assert s["reward"] == pytest.approx(varied("", s["response"], ""))
        assert s["prompt"].endswith("=")  # the addition task's prompt, "a+b="
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Samples")]
    assert len(logged) == 1 and logged[0].startswith("Samples at step 2:")
    assert f"response {samples[0]['index']}: reward {samples[0]['reward']:.3f}" in logged[0]

    # The readers of history take a record holding samples.
    console = io.StringIO()
    view = ProgressView(history, 3, bar=False, out=console)
    view.poll()
    assert len(view.records) == 3
    assert "steps        3" in summary(tmp_path, records, 1.0, 0)
    # `gspo train` shows them on the console too, once, where they were due.
    shown = console.getvalue()
    assert shown.count("Samples at step") == 1 and "Samples at step 2:" in shown
    assert f"response {samples[0]['index']}: reward {samples[0]['reward']:.3f}" in shown


def test_the_summary_names_the_trackers_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "logs").mkdir()
    assert "tensorboard" not in summary(tmp_path, [], 1.0, 0)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "mlruns").mkdir()
    text = summary(tmp_path, [], 1.0, 0)
    assert f"tensorboard  {tmp_path / 'tensorboard'}" in text
    assert f"mlflow       {tmp_path / 'mlruns'}" in text and "wandb" not in text


def test_the_summary_says_how_the_run_ended(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Finished, stopped by Ctrl-C (exit 0: it resumes), or failed: the first line says which."""
    assert summary(tmp_path, [], 1.0, 0).startswith("Run finished in 1s")
    stopped = summary(tmp_path, [], 1.0, 0, interrupted=True)
    assert stopped.startswith("Run stopped as asked (the same command resumes it) in 1s")
    assert summary(tmp_path, [], 1.0, 143, interrupted=True).startswith(
        "Run ended with exit code 143"
    )
