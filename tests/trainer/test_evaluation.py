"""Evaluation during training: a held-out (or, for the built-in task, complete) prompt set,
greedy accuracy and mean@k through the rollout engine, into history, metrics, the progress
bar, the summary and the plot."""

from __future__ import annotations

import asyncio
import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest
from learner_helpers import WrappedFleet, make_learner, run, tiny_spec

from gspo_api.spec import DataConfig
from gspo_trainer.data import load_eval_examples
from gspo_trainer.metrics import STEP_GAUGES
from gspo_trainer.plot import plot_training
from gspo_trainer.rollout.local import LocalRollout
from gspo_trainer.rollout.types import SamplingParams
from gspo_trainer.train import ProgressView, summary


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_eval_sets_are_kept_apart_from_training(tmp_path: Path) -> None:
    builtin = load_eval_examples(DataConfig(source="builtin:addition"))
    assert builtin is not None and len(builtin) == 100  # every problem the task has
    assert len({e.prompt for e in builtin}) == 100
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    held.write_text(
        "".join(json.dumps({"prompt": f"{a}*2=", "answer": str(2 * a)}) + "\n" for a in range(3))
    )
    own = DataConfig(source=str(train), prompt_template="Q: {prompt}", chat_template=False)
    assert load_eval_examples(own) is None  # never evaluated on its own training prompts
    examples = load_eval_examples(own.model_copy(update={"eval_source": str(held)}))
    assert examples is not None
    assert [e.prompt for e in examples] == ["Q: 0*2=", "Q: 1*2=", "Q: 2*2="]  # same template


def test_preflight_names_a_missing_eval_source(tmp_path: Path) -> None:
    from gspo_api.validation import parse_spec
    from gspo_trainer.preflight import check_data

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    manifest = copy.deepcopy(tiny_spec())
    manifest["spec"]["data"].update(source=str(data), evalSource=str(tmp_path / "no.jsonl"))
    problems = check_data(parse_spec(manifest["spec"]))
    assert [p.path for p in problems] == ["spec.data.evalSource"]


class Spy(WrappedFleet):
    """Records the sampling of every generate call, then lets the wrapped source answer."""

    def __init__(self, inner: LocalRollout) -> None:
        self.inner, self.calls = inner, []

    async def generate(self, prompts: Any, params: SamplingParams) -> Any:
        self.calls.append((len(prompts), params))
        return await self.inner.generate(prompts, params)

    async def sync_weights(self, named: Any, version: int) -> Any:
        return await self.inner.sync_weights(named, version)


@pytest.mark.parametrize("k", [0, 5])
def test_evaluation_runs_on_the_rollout_engine_every_n_steps_and_last(
    cache: Path, tmp_path: Path, k: int
) -> None:
    """Greedy accuracy at every evaluation; the k sampled answers per prompt of
    eval_mean_at_k only when algorithm.evalMeanAtK asks (k, not groupSize, of them)."""
    spec = tiny_spec(maxSteps=3, evalEverySteps=2, evalMeanAtK=k)
    learner = make_learner(cache, tmp_path, spec)
    spy = Spy(learner.rollout)  # type: ignore[arg-type]
    learner.rollout = spy
    assert run(learner) == 0
    evals = [r for r in learner.state.history if "eval_accuracy" in r]
    assert [int(r["step"]) for r in evals] == [2, 3]  # every 2 steps, and after the last
    greedy = [(n, p) for n, p in spy.calls if p.temperature == 0]
    assert len(greedy) == 2 and all(n == 100 and p.n == 1 for n, p in greedy)
    sampled = [(n, p) for n, p in spy.calls if n == 100 and p.temperature > 0]
    sample = learner.metrics.registry.get_sample_value
    assert sample("gspo_eval_accuracy") == evals[-1]["eval_accuracy"]
    for r in evals:
        assert 0.0 <= r["eval_accuracy"] <= 1.0
        assert ("eval_mean_at_k" in r) == (k > 0)
    if k:
        assert len(sampled) == 2 and all(p.n == k for _, p in sampled)
        assert all(0.0 <= r["eval_mean_at_k"] <= 1.0 for r in evals)
        assert sample("gspo_eval_mean_at_k") == evals[-1]["eval_mean_at_k"]
    else:
        assert sampled == []  # one greedy pass: 100 answers, not 100 x (1 + groupSize)
        assert not sample("gspo_eval_mean_at_k")


def test_greedy_is_deterministic_and_the_argmax(cache: Path) -> None:
    import torch

    learner = make_learner(cache, None)
    rollout: LocalRollout = learner.rollout  # type: ignore[assignment]
    prompt = learner.tokenizer("3+4=", add_special_tokens=False).input_ids
    greedy = SamplingParams(n=1, max_tokens=1, temperature=0.0)
    a = asyncio.run(rollout.generate([prompt], greedy)).groups[0][0]
    b = asyncio.run(rollout.generate([prompt], greedy)).groups[0][0]
    assert a.token_ids == b.token_ids
    with torch.no_grad():
        logits = rollout.model(torch.tensor([prompt])).logits[0, -1]
    assert a.token_ids[0] == int(logits.argmax())


def test_off_by_default_in_the_spec(cache: Path) -> None:
    from gspo_api.spec import AlgorithmConfig

    assert AlgorithmConfig().eval_every_steps == 0  # a cluster job evaluates when asked
    learner = make_learner(cache, None, tiny_spec(evalEverySteps=0))
    assert learner.eval_examples is None
    assert not any(learner.eval_due(s) for s in range(1, 10))


def records() -> list[dict[str, float]]:
    out = []
    for step in range(1, 31):
        r = {
            "step": step,
            "reward_mean": step / 30,
            "entropy": 2.0 - step / 20,
            "zero_advantage_fraction": 0.4,
            "clip_fraction": 0.01,
            "seconds": 0.1,
            "time": 1000.0 + step / 10,
        }
        if step % 10 == 0:
            r.update(eval_accuracy=step / 40, eval_mean_at_k=step / 50)
        out.append(r)
    return out


def test_one_name_per_metric_in_history_bar_and_prometheus(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(r) + "\n" for r in records()))
    out = io.StringIO()
    view = ProgressView(history, 30, bar=False, out=out)
    view.poll()
    text = out.getvalue().splitlines()[-1]
    shown = [part.split("=")[0] for part in text.split() if "=" in part]
    assert shown == [
        "reward_mean",
        "eval_accuracy",
        "eval_mean_at_k",
        "entropy",
        "zero_advantage_fraction",
        "clip_fraction",
    ]
    for key in shown:
        assert key in records()[-1]  # the history key
        assert STEP_GAUGES[key][0] == f"gspo_{key}"  # the Prometheus metric
    assert "eval_accuracy=0.750" in text


def test_the_summary_ends_with_the_evaluation_accuracy(tmp_path: Path) -> None:
    text = summary(tmp_path, records(), 12.0, 0, eval_every=10)
    assert text.splitlines()[-1].rstrip().endswith("eval_accuracy 0.750")
    assert "entropy" in text and "zero_advantage_fraction" in text
    off = summary(tmp_path, [], 1.0, 0, eval_every=0)
    assert "evalEverySteps is 0" in off.splitlines()[-1]


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures saved during the test, as they were drawn (the PNG is still written)."""
    from matplotlib.figure import Figure

    figures: list[Any] = []
    real = Figure.savefig

    def keep(fig: Any, *a: Any, **kw: Any) -> Any:
        figures.append(fig)
        return real(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def test_the_plot_has_reward_evaluations_and_collapse_panels(
    tmp_path: Path, shown: list[Any]
) -> None:
    path = plot_training({"GSPO": records()}, tmp_path / "reward.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    top, bottom, share = shown[0].axes
    assert {"GSPO eval_accuracy (greedy)", "GSPO eval_mean_at_k"} <= {
        line.get_label() for line in top.get_lines()
    }
    assert [line.get_label() for line in bottom.get_lines()] == ["GSPO entropy"]
    assert [line.get_label() for line in share.get_lines()] == ["GSPO zero_advantage_fraction"]


def test_accuracy_over_time_plots_each_evaluation_at_its_seconds(
    tmp_path: Path, shown: list[Any]
) -> None:
    from gspo_trainer.plot import plot_accuracy_over_time, training_seconds

    runs = records()
    slower = [{**r, "time": r["time"] + 2 * r["step"]} for r in runs]  # 2 s more a step
    path = plot_accuracy_over_time({"a": [runs], "b": [slower, runs]}, tmp_path / "t.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    lines = shown[0].axes[0].get_lines()
    assert [line.get_label() for line in lines][:2] == ["a", "b"]  # one legend entry a label
    evals = [r for r in runs if "eval_accuracy" in r]
    seconds = dict(zip((r["step"] for r in runs), training_seconds(runs), strict=True))
    assert list(lines[0].get_xdata()) == pytest.approx([seconds[r["step"]] for r in evals])
    assert list(lines[0].get_ydata()) == [r["eval_accuracy"] for r in evals]
    # Seconds count from the start of each run's first step: 2 s more for each step after it.
    want = [seconds[r["step"]] + 2 * (r["step"] - 1) for r in evals]
    assert list(lines[1].get_xdata()) == pytest.approx(want)
