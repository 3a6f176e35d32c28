"""metrics.reportTo: each tracker, offline, gets the history records' names and values; a
tracker that fails never stops the run, and only rank 0 reports."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
from learner_helpers import make_learner, run, tiny_spec

from gspo_trainer import trackers
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.trackers import Trackers, build_trackers

RECORDS = [
    {
        "step": 1,
        "time": 1.7e9,
        "reward_mean": 0.25,
        "loss": -0.5,
        "entropy": 1.5,
        "note": "not a number",
        "finite": True,
        "nothing": None,
    },
    {
        "step": 2,
        "time": 1.7e9 + 3,
        "reward_mean": 0.75,
        "loss": float("nan"),
        "entropy": 1.25,
        "eval_accuracy": 0.5,
        "samples": [
            {"prompt": "1+2=", "response": "3 | three\nok", "reward": 1.0},
            {"prompt": "2+2=", "response": "5", "reward": 0.0, "advantage": -1.0},
        ],
    },
]
LOGGED = {  # what RECORDS should become: numbers only, step and time as the axes
    1: {"reward_mean": 0.25, "loss": -0.5, "entropy": 1.5},
    2: {"reward_mean": 0.75, "loss": math.nan, "entropy": 1.25, "eval_accuracy": 0.5},
}
SPEC = {"model": {"name": "tiny"}, "learner": {"env": [{"name": "WANDB_API_KEY", "value": "s"}]}}
SETTINGS = (
    "WANDB_DIR",
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "WANDB_PROJECT",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_ALLOW_FILE_STORE",
)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracker reaches a network; each writes under the directory it is given."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("GSPO_JOB_NAME", "job-a")
    for name in SETTINGS:
        monkeypatch.setenv(name, "")  # so that what the trackers set is undone afterwards
        monkeypatch.delenv(name)


def report(names: list[str], directory: Path, records: list[dict[str, Any]]) -> LearnerMetrics:
    metrics = LearnerMetrics()
    t = build_trackers(names, directory, 0, metrics.tracker_failures)  # type: ignore[arg-type]
    t.start(SPEC)
    for record in records:
        t.log(record["step"], record)
    t.finish("Succeeded")
    return metrics


def same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step].keys() == values.keys(), step
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, nan_ok=True), (step, key)


# --- reading back what each tracker wrote ------------------------------------------------


def tensorboard_scalars(directory: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory / "tensorboard"))
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def _wandb_log_records(data: bytes) -> list[bytes]:
    """W&B's transaction log (.wandb): a 7-byte ":W&B" header, then LevelDB log blocks of
    32 KiB whose chunks have a 7-byte header (crc32, length little-endian, type: 1 a whole
    record, 2/3/4 its first, middle and last parts)."""
    assert data[:4] == b":W&B", data[:7]
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's zero-filled tail
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(part)
            part = b""
    return out


def wandb_history(directory: Path) -> tuple[dict[int, dict[str, Any]], Path]:
    """Each step's logged values (wandb's own `_` keys left out), and the run's directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    (run_dir,) = (directory / "wandb").glob("offline-run-*")
    records: list[Any] = []
    deadline = time.monotonic() + 30
    # wandb-core writes the log on its own after run.finish() returns: wait for its last record
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"no exit record in {run_dir}"
        time.sleep(0.1)
        records = []
        for raw in _wandb_log_records(next(run_dir.glob("*.wandb")).read_bytes()):
            records.append(pb.Record())
            records[-1].ParseFromString(raw)
    out: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = out.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    items[key] = json.loads(item.value_json)
    return out, run_dir


def mlflow_run(directory: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(directory / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("gspo")
    (found,) = client.search_runs([experiment.experiment_id])
    return client, found


def mlflow_metrics(client: Any, run_id: str, keys: Any) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


# --- each tracker, driven with records ------------------------------------------------------


def test_tensorboard_event_files_hold_the_records(tmp_path: Path, offline: None) -> None:
    report(["tensorboard"], tmp_path, RECORDS)
    same(tensorboard_scalars(tmp_path), LOGGED)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "| prompt | response | reward | advantage |" in table
    assert "3 \\| three ↵ ok" in table  # one row per sample, whatever the text holds
    (config,) = acc.Tensors("config/text_summary")
    assert "WANDB_API_KEY" not in config.tensor_proto.string_val[0].decode()


def test_wandb_offline_run_holds_the_records(tmp_path: Path, offline: None) -> None:
    report(["wandb"], tmp_path, RECORDS)
    history, run_dir = wandb_history(tmp_path)
    samples = history[2].pop("samples/path")
    same(
        {
            s: {k: v for k, v in h.items() if not k.startswith("samples")}
            for s, h in history.items()
        },
        LOGGED,
    )
    table = json.loads((run_dir / "files" / samples).read_text())
    assert table["columns"] == ["prompt", "response", "reward", "advantage"]
    assert table["data"][1] == ["2+2=", "5", 0.0, -1.0]


def test_mlflow_file_store_holds_the_records(tmp_path: Path, offline: None) -> None:
    report(["mlflow"], tmp_path, RECORDS)
    client, found = mlflow_run(tmp_path)
    assert found.info.run_name == "job-a" and found.info.status == "FINISHED"
    assert set(found.data.metrics) == {"reward_mean", "loss", "entropy", "eval_accuracy"}
    same(mlflow_metrics(client, found.info.run_id, found.data.metrics), LOGGED)
    artifacts = Path(found.info.artifact_uri.removeprefix("file://"))
    table = json.loads((artifacts / "samples" / "step-000002.json").read_text())
    assert table["columns"] == ["prompt", "response", "reward", "advantage"]
    spec = json.loads((artifacts / "spec.json").read_text())
    assert spec["model"] == {"name": "tiny"} and "env" not in spec["learner"]


# --- the policy: numbers only, failures counted, rank 0 ------------------------------------


class Fake:
    """A tracker that records its calls, and raises in the ones named in `fail`."""

    def __init__(self, name: str, fail: tuple[str, ...] = ()) -> None:
        self.name, self.fail = name, fail
        self.calls: list[tuple[Any, ...]] = []

    def _do(self, call: str, *args: Any) -> None:
        if call in self.fail:
            raise RuntimeError(f"{call} failed")
        self.calls.append((call, *args))

    def start(self, run_name: str, config: dict[str, Any]) -> None:
        self._do("start", run_name)

    def log(self, step: int, scalars: Any, timestamp: float) -> None:
        self._do("log", step, dict(scalars), timestamp)

    def log_samples(self, step: int, samples: Any) -> None:
        self._do("log_samples", step, samples)

    def finish(self, outcome: str) -> None:
        self._do("finish", outcome)


def test_only_numbers_are_logged_and_samples_go_to_log_samples() -> None:
    fake = Fake("tensorboard")
    t = Trackers([fake], "run-x")  # type: ignore[list-item]
    t.start(SPEC)
    for record in RECORDS:
        t.log(record["step"], record)
    t.finish("Suspending")
    assert fake.calls[0] == ("start", "run-x")
    assert fake.calls[1] == ("log", 1, LOGGED[1], 1.7e9)
    assert fake.calls[2][:2] == ("log", 2) and "samples" not in fake.calls[2][2]
    assert fake.calls[3] == ("log_samples", 2, RECORDS[1]["samples"])
    assert fake.calls[4] == ("finish", "stopped")


def test_a_failing_tracker_is_warned_about_once_counted_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = LearnerMetrics()
    broken_start = Fake("wandb", fail=("start",))
    broken_log = Fake("mlflow", fail=("log", "finish"))
    good = Fake("tensorboard")
    t = Trackers(
        [broken_start, broken_log, good],
        "r",  # type: ignore[list-item]
        lambda name: metrics.tracker_failures.labels(name).inc(),
    )
    with caplog.at_level(logging.WARNING, logger="gspo.trackers"):
        t.start(SPEC)
        for record in RECORDS:
            t.log(record["step"], record)
        t.finish("Running")  # an exception ended the run
    count = metrics.registry.get_sample_value
    assert count("gspo_tracker_failures_total", {"tracker": "wandb"}) == 1  # then dropped
    assert count("gspo_tracker_failures_total", {"tracker": "mlflow"}) == 3  # 2 logs, finish
    assert [c[0] for c in good.calls] == ["start", "log", "log", "log_samples", "finish"]
    assert good.calls[-1] == ("finish", "failed")
    assert broken_log.calls[-1] == ("log_samples", 2, RECORDS[1]["samples"])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "wandb could not start" in warned[0]


def test_only_rank_0_reports(tmp_path: Path) -> None:
    assert build_trackers(["tensorboard", "mlflow"], tmp_path, 1).trackers == []
    names = [t.name for t in build_trackers(["tensorboard", "mlflow"], tmp_path, 0).trackers]
    assert names == ["tensorboard", "mlflow"]
    assert build_trackers([], tmp_path, 0).trackers == []


def test_every_tracker_the_spec_allows_has_an_implementation() -> None:
    from typing import get_args

    from gspo_api.spec import TrackerName

    assert set(trackers.TRACKERS) == set(get_args(TrackerName))


# --- a run, in process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_a_run_reports_its_history_to_every_tracker(
    cache: Path, tmp_path: Path, offline: None
) -> None:
    manifest = tiny_spec(maxSteps=2, groupSize=4, promptsPerStep=4)
    names = ["tensorboard", "wandb", "mlflow"]
    manifest["spec"]["metrics"] = {"reportTo": names, "samplesEverySteps": 2, "samplesPerLog": 2}
    learner = make_learner(cache, None, manifest, tracker_dir=tmp_path)
    assert run(learner) == 0
    want = {r["step"]: trackers.scalars_of(r) for r in learner.state.history}
    assert {"reward_mean", "loss", "entropy"} <= want[1].keys()
    assert "samples" in learner.state.history[1]
    same(tensorboard_scalars(tmp_path), want)
    history, _ = wandb_history(tmp_path)
    same(
        {
            s: {k: v for k, v in h.items() if not k.startswith("samples")}
            for s, h in history.items()
        },
        want,
    )
    assert history[2]["samples/nrows"] == 2
    client, found = mlflow_run(tmp_path)
    assert found.info.status == "FINISHED"
    same(mlflow_metrics(client, found.info.run_id, set().union(*want.values())), want)
    count = learner.metrics.registry.get_sample_value
    assert all(count("gspo_tracker_failures_total", {"tracker": t}) == 0 for t in names)


class Unstartable:
    name = "wandb"

    def __init__(self, directory: Path) -> None:
        pass

    def start(self, run_name: str, config: dict[str, Any]) -> None:
        raise ConnectionError("no route to api.wandb.ai")


def test_a_tracker_that_cannot_start_does_not_stop_the_run(
    cache: Path, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(trackers.TRACKERS, "wandb", Unstartable)
    manifest = tiny_spec(maxSteps=2, groupSize=4, promptsPerStep=4)
    manifest["spec"]["metrics"] = {"reportTo": ["wandb", "tensorboard"]}
    learner = make_learner(cache, None, manifest, tracker_dir=tmp_path)
    assert run(learner) == 0 and learner.state.phase == "Succeeded"
    count = learner.metrics.registry.get_sample_value
    assert count("gspo_tracker_failures_total", {"tracker": "wandb"}) == 1
    assert sorted(tensorboard_scalars(tmp_path)) == [1, 2]


def test_a_restarted_learner_continues_its_mlflow_run(tmp_path: Path, offline: None) -> None:
    first, then = RECORDS[:2], RECORDS[2:]
    report(["mlflow"], tmp_path, first)
    report(["mlflow"], tmp_path, then)  # the learner restarted and resumed
    client, found = mlflow_run(tmp_path)  # one run, not two
    assert found.info.status == "FINISHED"
    same(mlflow_metrics(client, found.info.run_id, found.data.metrics), LOGGED)
    # A store that lost the run (a new tracking server) gets a new one, not an error.
    (tmp_path / ".mlflow-run-id").write_text("0123456789abcdef\n")
    report(["mlflow"], tmp_path, first)
    experiment = client.get_experiment_by_name("gspo")
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_a_restarted_learner_continues_its_wandb_run(tmp_path: Path, offline: None) -> None:
    report(["wandb"], tmp_path, RECORDS[:2])
    report(["wandb"], tmp_path, RECORDS[2:])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # wandb writes each start offline apart, under the run's one id
    kept = (tmp_path / ".wandb-run-id").read_text().strip()
    # offline-run-<date>_<time>-<id>, and "-1" after it for a second start in the same second
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{kept}(-\d+)?")
    assert kept and all(named.fullmatch(r.name) for r in runs), [r.name for r in runs]
