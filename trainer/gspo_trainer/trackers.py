"""Experiment trackers (spec.metrics.reportTo): TensorBoard, Weights & Biases, MLflow.

Learner rank 0 sends each step's history record to every tracker named, under the keys of
history.jsonl (reward_mean, loss, entropy, eval_accuracy, ...: the Prometheus names without
`gspo_`). `step` is each tracker's x-axis and `time` its timestamp; values that are not
numbers are skipped. A record's `samples` (a list of dicts, one per completion) becomes a
table: TensorBoard text, a wandb.Table, an MLflow JSON artifact (samples/step-NNNNNN.json).

Settings and secrets come from the learner's environment (set from Secrets through the
spec's learner.env / learner.envFrom), never from the spec itself:

    tensorboard  event files in DIR/tensorboard
    wandb        WANDB_API_KEY, WANDB_PROJECT (default "gspo"), WANDB_ENTITY, WANDB_MODE
                 (offline writes locally only), WANDB_BASE_URL, WANDB_RUN_ID and WANDB_RESUME
                 (to continue one run across restarts); files in WANDB_DIR, else DIR/wandb
    mlflow       MLFLOW_TRACKING_URI (default file:DIR/mlruns, a local file store),
                 MLFLOW_EXPERIMENT_NAME (default "gspo"), MLFLOW_TRACKING_USERNAME/_PASSWORD
                 or MLFLOW_TRACKING_TOKEN

DIR is the learner's --tracker-dir ($GSPO_TRACKER_DIR), else its checkpoint directory: on a
cluster the checkpoint volume, for `gspo train` its output directory. Runs are named after
the job ($GSPO_JOB_NAME). A restarted learner (it resumes from its checkpoint) continues the
same wandb and MLflow run: each run's id is kept in DIR (RUN_ID_FILES) the first time and
reused after, unless WANDB_RUN_ID names one. Each library is imported only when its tracker
starts.

A tracker never stops training: one that fails to start is dropped, one that fails to log
tries again at the next step; each failure is counted (gspo_tracker_failures_total{tracker})
and the first of each tracker logged as a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gspo_api import ports
from gspo_api.spec import TrackerName

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger("gspo.trackers")

ENV_TRACKER_DIR = "GSPO_TRACKER_DIR"
SAMPLES_KEY = "samples"  # a record's sample completions: a table, never a scalar
NOT_LOGGED = ("step", "time", SAMPLES_KEY)  # the x-axis, the timestamp, the table
DEFAULT_PROJECT = "gspo"  # wandb project and MLflow experiment when the environment names none
# A job's env and envFrom are left out of the config trackers show: a value may be a secret.
PRIVATE = {"learner": ("env", "envFrom"), "rollout": ("env", "envFrom")}

Outcome = Literal["succeeded", "stopped", "failed"]
OUTCOME_OF_PHASE: dict[str, Outcome] = {"Succeeded": "succeeded", "Suspending": "stopped"}
MLFLOW_STATUS: dict[Outcome, str] = {
    "succeeded": "FINISHED",
    "stopped": "KILLED",
    "failed": "FAILED",
}

# Where each tracker writes under its directory by default (the summary of `gspo train`
# lists them); wandb's is its own choice (it adds /wandb to the directory it is given).
LOCAL_DIRS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}
# Where a tracker keeps the id of this job's run, so that a restart continues it.
RUN_ID_FILES: dict[str, str] = {"wandb": ".wandb-run-id", "mlflow": ".mlflow-run-id"}


def kept_run_id(directory: Path, tracker: str) -> str | None:
    """The run id a previous start of this job kept in `directory`, if any."""
    path = directory / RUN_ID_FILES[tracker]
    if not path.exists():
        return None
    return path.read_text().strip() or None


def keep_run_id(directory: Path, tracker: str, run_id: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RUN_ID_FILES[tracker]).write_text(run_id + "\n")


class Tracker(Protocol):
    """One tracker: started once, a log per step, a table when a step has samples, finished."""

    name: TrackerName

    def start(self, run_name: str, config: dict[str, Any]) -> None: ...

    def log(self, step: int, scalars: Mapping[str, float], timestamp: float) -> None: ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None: ...

    def finish(self, outcome: Outcome) -> None: ...


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers by name, without its step, time and samples (bools are flags)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in NOT_LOGGED and isinstance(value, int | float) and not isinstance(value, bool)
    }


def columns_of(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every key of the samples, in the order first seen: the table's columns."""
    return list(dict.fromkeys(key for sample in samples for key in sample))


def run_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec as trackers show it: the manifest dict less the pods' env (see PRIVATE)."""
    out = dict(spec)
    for section, keys in PRIVATE.items():
        if isinstance(out.get(section), Mapping):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return out


# --- the trackers ---------------------------------------------------------------------------


class TensorBoard:
    """Event files in DIR/tensorboard: scalars, samples as a markdown table, the spec as text."""

    name: TrackerName = "tensorboard"

    def __init__(self, directory: Path) -> None:
        self.log_dir = directory / LOCAL_DIRS["tensorboard"]
        self.writer: Any = None

    def start(self, run_name: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", 0)

    def log(self, step: int, scalars: Mapping[str, float], timestamp: float) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step, walltime=timestamp)
        self.writer.flush()

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        columns = columns_of(samples)

        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", " ↵ ")

        rows = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
        rows += [f"| {' | '.join(cell(s.get(c, '')) for c in columns)} |" for s in samples]
        self.writer.add_text(SAMPLES_KEY, "\n".join(rows), step)
        self.writer.flush()

    def finish(self, outcome: Outcome) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run; its settings from WANDB_* (see the module docstring)."""

    name: TrackerName = "wandb"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.run: Any = None

    def start(self, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        where = os.environ.get("WANDB_DIR") or str(self.directory)  # wandb adds /wandb
        Path(where).mkdir(parents=True, exist_ok=True)
        run_id = os.environ.get("WANDB_RUN_ID") or kept_run_id(self.directory, self.name)
        if run_id is None:
            run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f], as wandb's own ids
            keep_run_id(self.directory, self.name, run_id)
        resume: Any = os.environ.get("WANDB_RESUME", "allow")  # wandb checks the value
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=run_name,
            dir=where,
            config=config,
            id=run_id,
            resume=resume,
        )

    def log(self, step: int, scalars: Mapping[str, float], timestamp: float) -> None:
        self.run.log(dict(scalars), step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        import wandb

        columns = columns_of(samples)
        table = wandb.Table(columns=[*columns], data=[[s.get(c) for c in columns] for s in samples])
        self.run.log({SAMPLES_KEY: table}, step=step)

    def finish(self, outcome: Outcome) -> None:
        if outcome == "stopped":
            self.run.mark_preempting()  # suspended: resumed later
        self.run.finish(exit_code=1 if outcome == "failed" else 0)


class MLflow:
    """An MLflow run, through MlflowClient (no process-global active run)."""

    name: TrackerName = "mlflow"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.client: Any = None
        self.run_id = ""

    def start(self, run_name: str, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.directory / LOCAL_DIRS["mlflow"]).resolve().as_uri()
            # MLflow 3 refuses a file store unless told; it is this default's whole point.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        eid = experiment.experiment_id if experiment else self.client.create_experiment(name)
        kept = kept_run_id(self.directory, self.name)
        if kept is not None and self._exists(kept):
            self.run_id = kept
            self.client.update_run(kept, status="RUNNING")  # a restart: the same run goes on
        else:
            self.run_id = self.client.create_run(eid, run_name=run_name).info.run_id
            keep_run_id(self.directory, self.name, self.run_id)
        self.client.log_dict(self.run_id, config, "spec.json")

    def _exists(self, run_id: str) -> bool:
        """Whether the tracking store (perhaps another one since) holds the run."""
        try:
            self.client.get_run(run_id)
        except Exception:  # MlflowException: not found, or another store's id
            return False
        return True

    def log(self, step: int, scalars: Mapping[str, float], timestamp: float) -> None:
        from mlflow.entities import Metric

        ms = int(timestamp * 1000)
        metrics = [Metric(key, value, ms, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        columns = columns_of(samples)  # the layout of MlflowClient.log_table's files
        table = {"columns": columns, "data": [[s.get(c) for c in columns] for s in samples]}
        self.client.log_dict(self.run_id, table, f"{SAMPLES_KEY}/step-{step:06d}.json")

    def finish(self, outcome: Outcome) -> None:
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[outcome])


TRACKERS: dict[TrackerName, Callable[[Path], Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
}


# --- what the learner holds ---------------------------------------------------------------


class Trackers:
    """The run's trackers: failures are warned about once per tracker, counted, never raised."""

    def __init__(
        self,
        trackers: Sequence[Tracker] = (),
        run_name: str = DEFAULT_PROJECT,
        on_failure: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.trackers = list(trackers)
        self.run_name = run_name
        self.on_failure = on_failure
        self.warned: set[str] = set()

    def _call(self, tracker: Tracker, what: str, call: Callable[[], None]) -> bool:
        try:
            call()
        except Exception as exc:
            self.on_failure(tracker.name)
            if tracker.name not in self.warned:
                self.warned.add(tracker.name)
                log.warning(
                    "Tracker %s could not %s (training goes on; later failures are "
                    "counted in gspo_tracker_failures_total): %s: %s",
                    tracker.name,
                    what,
                    type(exc).__name__,
                    exc,
                )
            return False
        return True

    def start(self, spec: Mapping[str, Any]) -> None:
        """Start each tracker with the spec (a manifest dict); one that cannot is dropped."""
        config, name = run_config(spec), self.run_name
        self.trackers = [
            t for t in self.trackers if self._call(t, "start", partial(t.start, name, config))
        ]
        if self.trackers:
            log.info("Reporting to %s as run %s", ", ".join(t.name for t in self.trackers), name)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """One history record: its numbers to log(), its samples (if any) to log_samples()."""
        scalars = scalars_of(record)
        timestamp = record.get("time")
        if not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
            timestamp = time.time()
        samples = record.get(SAMPLES_KEY)
        for t in self.trackers:
            self._call(t, "log", partial(t.log, step, scalars, timestamp))
            if isinstance(samples, list) and samples:
                self._call(t, "log samples", partial(t.log_samples, step, samples))

    def finish(self, phase: str) -> None:
        """End the run; the learner's phase says how (Succeeded, Suspending, else failed)."""
        outcome = OUTCOME_OF_PHASE.get(phase, "failed")
        for t in self.trackers:
            self._call(t, "finish", partial(t.finish, outcome))
        self.trackers = []


def build_trackers(
    names: Sequence[TrackerName],
    directory: str | Path | None,
    rank: int,
    failures: Counter | None = None,
) -> Trackers:
    """The trackers spec.metrics.reportTo names, writing under `directory` (default: the
    current one), for a run named after $GSPO_JOB_NAME; none on ranks other than 0.
    `failures` (labelled by tracker) counts what fails. Nothing is imported or started yet."""
    if rank != 0:
        return Trackers()
    where = Path(directory) if directory is not None else Path.cwd()
    name = os.environ.get(ports.ENV_JOB_NAME) or DEFAULT_PROJECT
    count = (lambda t: failures.labels(t).inc()) if failures is not None else (lambda t: None)
    return Trackers([TRACKERS[n](where) for n in names], name, count)
