"""`gspo train [JOB.yaml]`: a whole GSPO run on this machine, with no cluster.

It starts the same processes the pods run: `gspo rollout-server` (vLLM's own OpenAI server
with the gspo plugin) per rollout replica and `gspo learner`, wired with the pod environment
(gspo_api.ports). With no file it trains the embedded default (jobs.tiny_manifest: a tiny MoE
model and tokenizer built here, the built-in addition task). It shows a progress bar, and
leaves in the output directory the checkpoints, the final HF export, history.jsonl,
reward.png, the logs and the rollout servers' token (job-token: talk to the policy
through vLLM's OpenAI API while it trains).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import getpass
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gspo_api import ports
from gspo_api.ports import free_port
from gspo_trainer import output_dir
from gspo_trainer.jobs import tiny_manifest

if TYPE_CHECKING:
    from gspo_api.spec import GSPOJobSpec

SERVER_START_TIMEOUT_S = 300.0
LEARNER_STOP_TIMEOUT_S = 300.0  # its final checkpoint, before SIGKILL


def at_least_one(text: str) -> int:
    """A count of 1 or more, for argparse (its error names the flag, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gspo train",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "config", nargs="?", help="GSPOJob manifest (default: examples/tiny.yaml, embedded)"
    )
    p.add_argument("--output-dir", default="gspo-run", help="checkpoints, export, logs, plot")
    p.add_argument("--max-steps", type=int, help="override spec.algorithm.maxSteps")
    p.add_argument(
        "--loss-level",
        choices=["gspo", "gspo-token", "grpo"],
        help="override spec.algorithm.lossLevel (its clip range, and tokenBaseline group "
        "for gspo and grpo)",
    )
    p.add_argument("--seed", type=int, help="override spec.algorithm.seed")
    p.add_argument(
        "--rollout-servers",
        type=at_least_one,
        help="local rollout servers (default: spec.rollout.replicas)",
    )
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a bar")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        dest="overrides",
        help="set any spec field, e.g. --set algorithm.groupSize=8 (a YAML value; "
        "repeat it for more; validated like the file)",
    )
    return p.parse_args(argv)


class JobFileError(ValueError):
    """The job file cannot be read as a GSPOJob (one line naming the file and what is wrong)."""


def read_job_file(path: str) -> dict[str, Any]:
    """The GSPOJob manifest in `path` (a bare spec is wrapped in one), or JobFileError."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise JobFileError(f"{path}: cannot read the job file ({why})") from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise JobFileError(f"{path}: not valid YAML{where}: {problem}") from exc
    # A file may hold other objects beside the job (a claim, a Secret): take the job.
    maps = [d for d in docs if isinstance(d, dict)]
    jobs = [d for d in maps if d.get("kind", "GSPOJob") == "GSPOJob"]
    if not jobs:
        got = "nothing" if not docs else "a " + type(docs[0]).__name__ if not maps else "no GSPOJob"
        raise JobFileError(
            f"{path}: holds {got}, not a GSPOJob manifest (kind: GSPOJob with a spec mapping) "
            "or a bare spec"
        )
    raw = jobs[0]
    if "spec" not in raw and {"apiVersion", "kind", "metadata"} & set(raw):
        raise JobFileError(f"{path}: the GSPOJob has no spec; put the job's sections under spec:")
    manifest = raw if "spec" in raw else {"kind": "GSPOJob", "spec": raw}
    if not isinstance(manifest["spec"], dict):
        got = type(manifest["spec"]).__name__
        raise JobFileError(f"{path}: spec must be a mapping of the job's sections, got {got}")
    return manifest


def job_manifest(args: argparse.Namespace) -> dict[str, Any]:
    """The manifest to run: the file given, or the embedded default, with CLI overrides."""
    manifest = read_job_file(args.config) if args.config else tiny_manifest()
    manifest = copy.deepcopy(manifest)
    from gspo_trainer.overrides import apply_overrides

    apply_overrides(manifest["spec"], args.overrides)  # OverrideError names the --set
    alg = manifest["spec"].setdefault("algorithm", {})
    if not isinstance(alg, dict):  # validation names spec.algorithm; the flags cannot apply
        return manifest
    if args.max_steps is not None:
        alg["maxSteps"] = args.max_steps
    if args.seed is not None:
        alg["seed"] = args.seed
    if args.loss_level is not None and args.loss_level != alg.get("lossLevel"):
        alg["lossLevel"] = args.loss_level
        alg.pop("clipLow", None)  # the level's own default range
        alg.pop("clipHigh", None)
        if args.loss_level != "gspo-token":  # per-token baselines are gspo-token's alone
            alg.pop("tokenBaseline", None)
    return manifest


# torch.distributed's group variables. Inherited (`gspo train` run from a job step under
# torchrun, or a process that initialised a group), they would make the learner think it is
# one rank of that group instead of starting its own.
DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def own_group_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without any torch.distributed group it belongs to."""
    return {
        k: v for k, v in env.items() if k not in DIST_VARS and not k.startswith("TORCHELASTIC_")
    }


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    log_start: int = 0  # where this attempt's lines begin in `log` (earlier ones above)

    def stop(self, timeout_s: float = 60) -> int:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                try:  # a process in uninterruptible sleep outlives even SIGKILL for a while
                    self.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    return -signal.SIGKILL  # the others are still stopped, the run cleaned up
        return int(self.popen.returncode)

    def tail(self, chars: int = 3000) -> str:
        """The end of this attempt's log (not an earlier attempt's)."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as f:
            f.seek(max(self.log_start, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_setup(cpus: list[int] | None, parent: int) -> Callable[[], None] | None:
    """What a spawned child runs between fork and exec: its cores, and on Linux SIGTERM when
    its parent dies (prctl PR_SET_PDEATHSIG; a parent already gone before the prctl is
    caught by the ppid check). The kernel sends it when the thread that forked exits, so
    spawn runs on gspo train's main thread only. None where there is nothing to do."""
    prctl = None
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork
    if prctl is None and not cpus:
        return None

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def spawn(
    name: str,
    args: list[str],
    env: dict[str, str],
    log: Path,
    cpus: list[int] | None = None,
    keep_fds: tuple[int, ...] = (),
) -> Proc:
    """`gspo ARGS` in its own session, appending to `log` after a header (a resumed run keeps
    the previous attempt's log); on `cpus` only when given (set in the child before it runs
    anything, so every thread and process it starts inherits it). The child gets SIGTERM if
    `gspo train` dies without stopping it (killed outright): a learner then saves a final
    checkpoint and a server shuts down, as a deleted pod's would, instead of running on
    unattended in a session of its own. `keep_fds` stay open in the child: the run lock's,
    so a child still stopping keeps the output directory locked."""
    repo = Path(__file__).resolve().parents[2]
    paths = [str(repo / "operator"), str(repo / "trainer"), env.get("PYTHONPATH", "")]
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    pin = child_setup(cpus, os.getpid())
    f, start = output_dir.open_log(log, name)
    with f:
        cmd = [sys.executable, "-m", "gspo_operator.cli", *args]
        popen = subprocess.Popen(
            cmd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=pin,
            pass_fds=keep_fds,
        )
    return Proc(name, popen, log, start)


@dataclass(frozen=True)
class CpuPlacement:
    """Where a run's processes go on a machine without GPUs. A server's worker is always
    bound to its share (VLLM_CPU_OMP_THREADS_BIND). Its other two processes (the HTTP front
    end and the engine-core scheduler) are confined there too only with `pin_servers`, when
    collection overlaps the update (algorithm.maxStaleness > 0): floating, they take the
    learner's cores from it while it updates. In a synchronous step the learner idles while
    they work, so there they float and generation gets every core. On the 2-core machine
    (`gspo train`, 100 steps, medians): overlapped 0.254 s a step pinned against 0.289 s
    floating; synchronous 0.445 s pinned against 0.410 s floating."""

    servers: list[list[int]]  # each rollout server's cores
    learner: list[int]  # the learner's CPUs
    pin_servers: bool = False  # each server's processes on its own share, not only its worker


def place_on_cpus(
    cpus: list[int], n_servers: int, learner_ranks: int, *, overlapped: bool = False
) -> CpuPlacement | None:
    """Disjoint cores for the rollout servers and the learner on a machine without GPUs.

    vLLM's CPU worker binds its OpenMP threads to cores and spins on them between requests
    (vLLM's own binding takes every core but one it reserves for its scheduler): a learner
    the kernel puts on one of them waits for the spinning thread, and with collection running
    ahead (algorithm.maxStaleness) generation and updates contend instead of overlapping. So
    the learner ranks (one thread each) get the last cores, one each, and the servers' workers
    equal shares of the others, all of each server's processes there when `overlapped`
    (CpuPlacement). None, leaving vLLM's binding, with fewer cores than servers plus learner
    ranks."""
    if len(cpus) < n_servers + learner_ranks:
        return None
    cpus = sorted(cpus)
    rest, learner = cpus[: len(cpus) - learner_ranks], cpus[len(cpus) - learner_ranks :]
    per = len(rest) // n_servers
    shares = [rest[i * per : (i + 1) * per] for i in range(n_servers)]
    return CpuPlacement(shares, learner, overlapped)


@dataclass(frozen=True)
class GpuPlacement:
    """CUDA_VISIBLE_DEVICES of the learner and of each rollout server ("": the CPU)."""

    learner: str
    servers: list[str]


class PlacementError(ValueError):
    """The spec needs more GPUs than this machine has."""


def visible_gpus(count: int, environ: Mapping[str, str]) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the `count` GPUs this process sees, in its order:
    a child's CUDA_VISIBLE_DEVICES replaces the parent's, so it must name the parent's own
    entries (the GPUs given to `gspo train`), not their indices among them."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(count)]
    return [entry.strip() for entry in raw.split(",") if entry.strip()][:count]


def place_on_gpus(spec: GSPOJobSpec, gpus: int | Sequence[str], n_servers: int) -> GpuPlacement:
    """GPUs of their own for the learner and each server on a machine with `gpus` of them
    (a count: GPUs 0..count-1; or the entries of visible_gpus).

    The learner's processes (learner.replicas x learner.gpusPerReplica, every pod's ranks on
    this one machine) take the first GPUs, so LOCAL_RANK k is the k-th it sees; each rollout
    server then takes rollout.tensorParallelSize GPUs (vLLM's workers, one per GPU). A side
    whose gpusPerReplica is 0 runs on the CPU and sees none. PlacementError naming the
    numbers when they do not fit."""
    ids = [str(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
    learner = spec.learner.replicas * spec.learner.gpus_per_replica
    per_server = spec.rollout.tensor_parallel_size if spec.rollout.gpus_per_replica > 0 else 0
    need = learner + n_servers * per_server
    if need > len(ids):
        raise PlacementError(
            f"this job needs {need} GPUs and this machine has {len(ids)}: the learner "
            f"{learner} (spec.learner.replicas {spec.learner.replicas} x gpusPerReplica "
            f"{spec.learner.gpus_per_replica}) and {n_servers} rollout server(s) x "
            f"{per_server} (spec.rollout.tensorParallelSize); lower them, run fewer servers "
            "(--rollout-servers), or run on a cluster"
        )
    servers = [
        ",".join(ids[learner + i * per_server : learner + (i + 1) * per_server])
        for i in range(n_servers)
    ]
    return GpuPlacement(",".join(ids[:learner]), servers)


def wait_healthy(
    servers: list[tuple[Proc, str]], timeout_s: float, learner: Proc | None = None
) -> None:
    """Until one server answers /health: the learner starts training on the first, as it does
    on a cluster, and the rest join as they load (follow_learner names one that exits). A
    server that exits before any answers raises with its log's tail; a learner that exits
    first ends the wait (the caller reports its exit)."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while len(pending) == len(servers):
        if learner is not None and learner.popen.poll() is not None:
            return
        for proc, url in list(pending):
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited while starting:\n{proc.tail()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove((proc, url))
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rollout server up after {timeout_s:.0f}s: see their logs")
        time.sleep(0.5)


def follow_learner(
    learner: Proc,
    servers: Sequence[tuple[Proc, str]],
    poll: Callable[[], None],
    period_s: float = 1.0,
    stop_timeout_s: float = LEARNER_STOP_TIMEOUT_S,
) -> str | None:
    """Wait for the learner's exit, calling `poll` every period. A rollout server that exits
    is named with the error its log gives (the learner moves its prompts to the others). Once
    every server has exited the learner is stopped (SIGTERM: a final checkpoint) and the
    returned line says why: it would otherwise wait for a server that no one restarts (a
    cluster restarts the pod; here the user re-runs the command, which resumes)."""
    reported: set[str] = set()
    while learner.popen.poll() is None:
        poll()
        gone = [proc for proc, _ in servers if proc.popen.poll() is not None]
        for proc in gone:
            if proc.name not in reported:
                reported.add(proc.name)
                print(
                    f"{proc.name} exited (code {proc.popen.returncode}): "
                    f"{first_error(proc.tail(200_000)) or 'no error in its log'} ({proc.log})",
                    file=sys.stderr,
                    flush=True,
                )
        if servers and len(gone) == len(servers):
            learner.stop(timeout_s=stop_timeout_s)  # SIGTERM; SIGKILL past the timeout
            return (
                "every rollout server exited, so the learner was stopped (a final checkpoint "
                "first); fix what their logs name above, then run the same command again to "
                "resume"
            )
        time.sleep(period_s)
    return None


# At a line's start, or after a logger's "[file.py:123] " prefix (vLLM's): not one quoted in a
# warning's text.
ERROR_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S.*)", re.MULTILINE)


def first_error(log: str) -> str | None:
    """The first `SomethingError: message` in a log: the root cause, where what follows (an
    engine's "EngineDeadError", interpreter shutdown noise) only reports it."""
    found = ERROR_LINE.search(log)
    return found.group(1).strip() if found else None


class ProgressView:
    """Follows the learner's history.jsonl: a tqdm bar, or one line per 10 steps."""

    def __init__(self, history: Path, max_steps: int, bar: bool, out: TextIO) -> None:
        self.history, self.max_steps, self.out = history, max_steps, out
        self.offset = 0
        self.lines_read = 0  # complete lines consumed, to name a skipped one
        self.records: list[dict[str, float]] = []
        self.last_eval: dict[str, float] | None = None
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=max_steps, desc="train", unit="step", file=out, dynamic_ncols=True
            )

    def poll(self) -> None:
        if not self.history.exists():
            return
        with open(self.history, encoding="utf-8") as f:
            f.seek(self.offset)
            chunk = f.read()
        lines = chunk.split("\n")  # the last is partial (being written) or empty
        self.offset += len(chunk.encode()) - len(lines[-1].encode())
        from gspo_trainer.jsonl import decode_lines

        new = decode_lines(lines[:-1], str(self.history), first_line=self.lines_read + 1)
        self.lines_read += len(lines) - 1
        for r in new:
            self.show(r)
        if new and self.bar is not None:
            # Once per poll, not per step: `gspo train` may share the learner's core (one
            # core here), and every redraw is time the learner does not get.
            self.bar.refresh()

    def show(self, r: dict[str, Any]) -> None:
        if r.get("samples"):  # metrics.samplesEverySteps: what the policy writes, above the bar
            from gspo_trainer.samples import format_samples

            block = format_samples(int(r["step"]), r["samples"])
            if self.bar is not None:
                self.bar.write(block, file=self.out)
            else:
                print(block, file=self.out, flush=True)
        failed = float(r.get("reward_failure_fraction", 0.0))
        was_failing = bool(self.records) and self.records[-1].get("reward_failure_fraction", 0.0)
        if failed > 0 and not was_failing:  # the start of a failing stretch, not every step
            self.say(
                f"WARNING: step {int(r['step'])}: {failed:.0%} of the reward calls failed "
                "and scored 0 (the learner's log says why)"
            )
        self.records.append(r)
        if "eval_accuracy" in r:
            self.last_eval = r
        text = self.describe(r)
        if self.bar is not None:
            self.bar.n = int(r["step"])
            self.bar.set_postfix_str(text, refresh=False)
        elif int(r["step"]) % 10 == 0 or "eval_accuracy" in r:
            print(f"step {int(r['step'])}/{self.max_steps} {text}", file=self.out, flush=True)

    def say(self, line: str) -> None:
        """A line above the bar (or among the progress lines)."""
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def describe(self, r: dict[str, float]) -> str:
        """The step's numbers, each under its history key (the Prometheus metric is gspo_ +
        key): reward, the latest evaluation, and the collapse signals, entropy and the share
        of zero-advantage groups (entropy near 0 with that share near 1 and a low reward:
        the policy answers every prompt alike and has stopped learning)."""
        recent = [x["reward_mean"] for x in self.records[-10:]]
        parts = [f"reward_mean={r['reward_mean']:.3f} (10-step {sum(recent) / len(recent):.3f})"]
        if self.last_eval is not None:
            parts.append(f"eval_accuracy={self.last_eval['eval_accuracy']:.3f}")
            if "eval_mean_at_k" in self.last_eval:
                parts.append(f"eval_mean_at_k={self.last_eval['eval_mean_at_k']:.3f}")
        if "code_pass_rate" in r:  # reward.kind code; sandbox failures are never silent
            parts.append(f"code_pass_rate={r['code_pass_rate']:.3f}")
            if r.get("code_tests/sandbox_failure"):
                parts.append(f"code_tests/sandbox_failure={int(r['code_tests/sandbox_failure'])}")
        if "entropy" in r:
            parts.append(f"entropy={r['entropy']:.3f}")
        parts.append(f"zero_advantage_fraction={r.get('zero_advantage_fraction', 0.0):.2f}")
        parts.append(f"clip_fraction={r.get('clip_fraction', 0.0):.4f}")
        return " ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(
    out: Path,
    records: list[dict[str, float]],
    wall_s: float,
    code: int,
    eval_every: int = 0,
    interrupted: bool = False,
) -> str:
    """The run in a few lines; the last one ends with the final evaluation accuracy, the
    number the run is judged by (the training reward of a 16-prompt step is noisy)."""
    from gspo_trainer import checkpoint as ckpt

    if code != 0:
        ended = f"ended with exit code {code}"
    elif interrupted:
        ended = "stopped as asked (the same command resumes it)"
    else:
        ended = "finished"
    lines = [f"Run {ended} in {wall_s:.0f}s: {out}"]
    evals = [r for r in records if "eval_accuracy" in r]
    if records:
        rewards = [r["reward_mean"] for r in records]
        k = min(20, len(rewards))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        lines.append(f"  steps        {int(records[-1]['step'])}")
        lines.append(f"  reward_mean  {first:.3f} (first {k} steps) -> {last:.3f} (last {k})")
        if "entropy" in records[0]:
            lines.append(
                f"  entropy      {records[0]['entropy']:.3f} (first step) -> "
                f"{records[-1].get('entropy', 0.0):.3f} (last)"
            )
        zero = [r.get("zero_advantage_fraction", 0.0) for r in records[-k:]]
        lines.append(f"  zero_advantage_fraction {sum(zero) / k:.2f} (last {k} steps)")
        lines.append(f"  clip_fraction {records[-1].get('clip_fraction', 0.0):.4f} (last step)")
        failed = [r.get("reward_failure_fraction", 0.0) for r in records]
        if any(failed):
            lines.append(
                f"  WARNING      reward calls failed in {sum(f > 0 for f in failed)} of "
                f"{len(records)} steps (every call in {sum(f == 1 for f in failed)}); "
                "see logs/learner.log"
            )
    latest = ckpt.latest(out / "checkpoints")
    if latest is not None:
        lines.append(f"  checkpoint   {latest}")
    if (out / "checkpoints" / "export").is_dir():
        lines.append(f"  HF export    {out / 'checkpoints' / 'export'}")
    if (out / "reward.png").exists():
        lines.append(f"  reward curve {out / 'reward.png'}")
    lines.append(f"  logs         {out / 'logs'}")
    from gspo_trainer.trackers import LOCAL_DIRS

    for name, sub in LOCAL_DIRS.items():  # metrics.reportTo's local output, where there is one
        if (out / sub).is_dir():
            lines.append(f"  {name:<12} {out / sub}")
    if evals:
        e = evals[-1]
        at_k = f", eval_mean_at_k {e['eval_mean_at_k']:.3f}" if "eval_mean_at_k" in e else ""
        lines.append(
            f"  eval at step {int(e['step'])} (greedy{at_k}): "
            f"eval_accuracy {e['eval_accuracy']:.3f}"
        )
    elif eval_every <= 0:
        lines.append("  eval         off (algorithm.evalEverySteps is 0)")
    else:
        lines.append("  eval         none finished (no evaluation set, or the run ended first)")
    return "\n".join(lines)


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


TOKEN_FILE = "job-token"


def write_token_file(path: Path, token: str) -> None:
    """The servers' token, readable by its owner only, in a file of its own.

    A file already there is truncated and made 0600 (opening with a mode sets it only on a
    new file); a symbolic link is refused, not followed: it could point the token, or the
    truncation, at any file the user can write.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeError(
                f"{path} is a symbolic link; remove it (the job's token is "
                "written to a regular file only)"
            ) from exc
        raise RuntimeError(f"cannot write the job's token to {path}: {exc}") from exc
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(token + "\n")


ENGINE_NICE = 10  # a one-core server's engine below its front end (rollout/core_share.py)


def server_env(
    env: dict[str, str], placement: CpuPlacement | GpuPlacement | None, index: int
) -> dict[str, str]:
    """A rollout server's environment: its cores or its GPUs when `gspo train` placed them.

    A server confined to one core (`server_cpus`: pinned, a share of one) runs vLLM's model
    worker in its engine-core process: vLLM's CPU platform spawns the worker a process of its
    own only to bind its OpenMP threads there (vllm/platforms/cpu.py, which keeps the
    uniproc executor once VLLM_ENABLE_V1_MULTIPROCESSING is 0), and on one core the
    confinement is that binding. One import fewer in the start, and no worker spinning on
    its message queue beside the scheduler on the same core: the embedded default reaches
    its first step 4-5 s sooner and steps 7-11% faster here, with the same history to the
    last bit (BENCHMARKS.md). Floating, or on several cores, the threads would be unbound: vLLM's
    own layout is kept. The user's setting wins.

    On that one core, with the worker in the engine's process (the front end's only child
    then, besides multiprocessing's resource tracker), the engine also runs ENGINE_NICE below
    the front end (rollout/core_share.py), so a step's requests reach it in one batch far more
    often. With the user's VLLM_ENABLE_V1_MULTIPROCESSING=1 the worker would be a grandchild
    left at the front end's priority, spinning above its own scheduler: not set there."""
    if isinstance(placement, GpuPlacement):
        return {**env, "CUDA_VISIBLE_DEVICES": placement.servers[index]}
    if placement is None:
        return env
    share = placement.servers[index]
    out = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))}
    if placement.pin_servers and len(share) == 1:
        out.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if out["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":  # the engine is the front end's child
            out.setdefault(ports.ENV_ENGINE_NICE, str(ENGINE_NICE))
    return out


# A Unix socket's path holds at most 107 bytes (sockaddr_un.sun_path): vLLM's ZeroMQ sockets
# are the directory plus "/" and a 36-character uuid (vllm/utils/network_utils.py).
SOCKET_DIR_MAX = 107 - 37


def scratch_dir() -> Path:
    """A new directory for the rollout servers' temporary files (their TMPDIR), which
    `gspo train` removes once they are gone: vLLM leaves its ZeroMQ sockets and a rendezvous
    file in the temporary directory when it stops, eight a server. In the temporary
    directory, or in /tmp where that one's path would leave vLLM's socket paths too long.

    It links torch's own directory there: torch keeps its compiled headers under
    `<temporary directory>/torchinductor_<user>` whatever TORCHINDUCTOR_CACHE_DIR says
    (torch 2.13, torch/_inductor/codecache.py `_HEADER_DIR`), and vLLM's sampler compiles
    against them at the server's warm-up: in a fresh directory every run would build them
    again (150 MB, 4 s of the start here)."""
    scratch = Path(tempfile.mkdtemp(prefix="gspo-"))
    if len(os.fsencode(scratch)) > SOCKET_DIR_MAX and os.path.isdir("/tmp"):
        scratch.rmdir()
        scratch = Path(tempfile.mkdtemp(prefix="gspo-", dir="/tmp"))
    kept = Path(torch_cache_dir())
    try:
        kept.mkdir(parents=True, exist_ok=True)
        (scratch / kept.name).symlink_to(kept, target_is_directory=True)
    except OSError:  # torch builds them in the scratch directory: slower, not wrong
        pass
    return scratch


def torch_cache_dir() -> str:
    """torch's default compile cache directory (torch 2.13's `default_cache_dir`), read
    without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


def server_cpus(placement: CpuPlacement | GpuPlacement | None, index: int) -> list[int] | None:
    """The cores a rollout server's processes are confined to, when `gspo train` placed them
    with `pin_servers` (see CpuPlacement); None: they float."""
    if not isinstance(placement, CpuPlacement) or not placement.pin_servers:
        return None
    return placement.servers[index]


def server_gpu_args(spec: GSPOJobSpec, placement: GpuPlacement | None) -> list[str]:
    """The vLLM flags of a server on GPUs: its tensor-parallel size, its memory share."""
    if placement is None or spec.rollout.gpus_per_replica == 0:
        return []
    return [
        "--tensor-parallel-size",
        str(spec.rollout.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(spec.rollout.gpu_memory_utilization),
    ]


def process_env(
    spec: GSPOJobSpec, environ: Mapping[str, str], cache: Path, token: str
) -> dict[str, str]:
    """The environment of the servers and the learner `gspo train` starts: the caller's
    (less any torch.distributed group it runs in), the model cache, the job's token, and
    HF_HUB_OFFLINE=1 exactly where a cluster's pods get it (`spec.hub_offline`): a model
    named on the Hugging Face Hub downloads as transformers and vLLM would."""
    env = {**own_group_env(environ), "GSPO_CACHE": str(cache), ports.ENV_JOB_TOKEN: token}
    if spec.hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


@contextlib.contextmanager
def hub_offline_env(offline: bool) -> Iterator[None]:
    """HF_HUB_OFFLINE=1 in this process while it lasts, when the job is offline (its servers
    and learner get it from process_env). Hugging Face's libraries read it when they load,
    which in `gspo train` is inside this block."""
    before = os.environ.get("HF_HUB_OFFLINE")
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def main(argv: list[str]) -> int:
    from gspo_api.validation import SpecError, parse_spec
    from gspo_trainer.overrides import OverrideError

    args = parse_args(argv)
    try:
        manifest = job_manifest(args)
        spec = parse_spec(manifest["spec"])
    except (JobFileError, OverrideError) as exc:
        print(f"gspo train: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        for problem in exc.problems:
            print(f"gspo train: {problem}", file=sys.stderr)
        return 2
    n_servers = max(1, args.rollout_servers or spec.rollout.replicas)
    gpus: GpuPlacement | None = None
    if _has_cuda():  # GPUs of their own for the learner and each server, or a refusal
        try:
            gpus = place_on_gpus(spec, visible_gpus(_gpu_count(), os.environ), n_servers)
        except PlacementError as exc:
            print(f"gspo train: {exc}", file=sys.stderr)
            return 2
    # The learner's own checks (model, data rows, reward, hardware), before any server starts:
    # a bad row or reward is one line and exit 2 in seconds, not after the servers loaded.
    from gspo_trainer.preflight import preflight

    with hub_offline_env(spec.hub_offline):  # the model and data read as the learner will
        problems = preflight(spec, gpus=_gpu_count() if gpus is not None else 0)
    for problem in problems:
        print(f"gspo train: {problem}", file=sys.stderr)
    if problems:
        return 2
    out = Path(args.output_dir).resolve()
    try:
        output_dir.prepare(out)
        run_lock = output_dir.lock(out)  # held until this process exits
    except output_dir.OutputDirError as exc:
        print(f"gspo train: {exc}", file=sys.stderr)
        return 2
    with run_lock:
        return run(args, manifest, spec, out, gpus, n_servers, (run_lock.fileno(),))


def run(
    args: argparse.Namespace,
    manifest: dict[str, Any],
    spec: GSPOJobSpec,
    out: Path,
    gpus: GpuPlacement | None,
    n_servers: int,
    lock_fds: tuple[int, ...] = (),
) -> int:
    """The run itself, holding the output directory's lock (`lock_fds`, passed on to every
    process it starts): servers, learner, summary."""
    cache = out / "models"
    model = spec.model.name
    if model.startswith("builtin:"):
        import torch
        from transformers.utils import logging as hf_logging

        from gspo_trainer.tiny import materialize

        if not torch.cuda.is_available():  # DeepSpeed (imported by transformers) says so once
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        hf_logging.disable_progress_bar()  # a bar for writing one tiny file is noise here
        model = str(materialize(model, cache, seed=spec.algorithm.seed))
    metrics_port = free_port()
    manifest["spec"].setdefault("metrics", {})["port"] = metrics_port
    config = out / ports.CONFIG_FILE
    import yaml

    config.write_text(yaml.safe_dump(manifest, sort_keys=False))

    token = secrets.token_hex(16)
    base_env = process_env(spec, os.environ, cache, token)
    world = spec.learner.replicas * max(spec.learner.gpus_per_replica, 1)
    placement: CpuPlacement | None = None
    if gpus is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # the user's wins
        placement = place_on_cpus(
            list(os.sched_getaffinity(0)),
            n_servers,
            world,
            overlapped=spec.algorithm.max_staleness > 0,
        )
    servers: list[tuple[Proc, str]] = []
    learner: Proc | None = None
    scratch = scratch_dir()  # the servers' temporary files
    start = time.monotonic()
    view: ProgressView | None = None
    code = 1
    interrupted = False

    def on_signal(signum: int, _: Any) -> None:
        nonlocal interrupted
        interrupted = True
        if learner is not None and learner.popen.poll() is None:
            os.killpg(learner.popen.pid, signal.SIGTERM)  # final checkpoint, then exit 143

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"Starting {n_servers} rollout server(s) for {spec.model.name} ...", flush=True)
        weights_dir = []  # where the servers load versions from, with weightSync filesystem
        if spec.weight_sync.method == "filesystem":
            weights_dir = ["--weights-dir", str(out / "checkpoints" / ports.WEIGHTS_SUBDIR)]
        for i in range(n_servers):
            port = free_port()
            # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
            proc = spawn(f"rollout-{i}", [
                "rollout-server", "--model", model, "--served-model-name", spec.model.name,
                "--host", "127.0.0.1", "--port", str(port),
                "--dtype", spec.model.dtype, "--max-model-len", str(spec.model.max_model_len),
                "--max-num-seqs", str(spec.rollout.max_num_seqs),
                *[f"--engine-arg={k}={json.dumps(v)}" for k, v in spec.rollout.engine_args.items()],
                *weights_dir, *server_gpu_args(spec, gpus),
            ], {**server_env(base_env, gpus or placement, i), "TMPDIR": str(scratch)},
               out / "logs" / f"rollout-{i}.log", server_cpus(placement, i), lock_fds)  # fmt: skip
            servers.append((proc, f"http://127.0.0.1:{port}"))
        learner_env = {
            **base_env,
            ports.ENV_ROLLOUT_URLS: ",".join(url for _, url in servers),
            ports.ENV_POD_IP: "127.0.0.1",
            ports.ENV_JOB_NAME: str((manifest.get("metadata") or {}).get("name") or "gspo"),
            # The vLLM CPU worker busy-polls a core between requests; a one-thread learner
            # leaves it that core instead of stalling its own thread team (8x faster here).
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            ports.ENV_CHECKPOINT_DIR: str(out / "checkpoints"),
            ports.ENV_NNODES: "1",
            ports.ENV_NODE_RANK: "0",
            ports.ENV_NPROC_PER_NODE: str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        if gpus is not None:  # its ranks' LOCAL_RANK index these
            learner_env["CUDA_VISIBLE_DEVICES"] = gpus.learner
        # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
        learner = spawn("learner", [
            "learner", "--config", str(config), "--checkpoint-dir", str(out / "checkpoints"),
            "--weight-sync-port", str(free_port()), "--metrics-host", "127.0.0.1",
            "--tracker-dir", str(out),  # metrics.reportTo: out/tensorboard, out/wandb, out/mlruns
        ], learner_env, out / "logs" / "learner.log",
           placement.learner if placement else None, lock_fds)  # fmt: skip
        # The learner starts beside its servers, as a job's pods do: it imports and builds its
        # engine while vLLM loads, then waits for the fleet itself (Learner._await_fleet).
        wait_healthy(servers, SERVER_START_TIMEOUT_S, learner)
        if learner.popen.poll() is None and not interrupted:  # else follow_learner reports
            # The servers answer anyone with the run's token, OpenAI's API included: leave it
            # where its owner (only) can read it, to talk to the policy while it trains.
            token_file = out / TOKEN_FILE
            write_token_file(token_file, token)
            # An earlier release's name for it, left in a reused directory: a dead token.
            (out / "rollout-token").unlink(missing_ok=True)
            print(
                f"Rollout servers (vLLM's OpenAI API, token in {token_file}): "
                f"{', '.join(url for _, url in servers)}",
                flush=True,
            )
            print(
                f"Learner started; metrics at http://127.0.0.1:{metrics_port}/metrics "
                f"(progress at /progress); logs in {out / 'logs'}",
                flush=True,
            )
        view = ProgressView(
            out / "checkpoints" / "history.jsonl",
            spec.algorithm.max_steps,
            bar=not args.no_progress,
            out=sys.stderr,
        )
        ended = follow_learner(learner, servers, view.poll)
        view.poll()
        view.close()
        code = int(learner.popen.returncode)
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
        if ended is not None and code != 0:  # not a learner that finished as it was stopped
            print(f"gspo train: {ended}", file=sys.stderr)
        stopped = ended is not None and code == ports.LEARNER_STOPPED_EXIT_CODE
        if stopped:
            code = 1  # the run did not finish: no server was left
        elif interrupted and code == ports.LEARNER_STOPPED_EXIT_CODE:
            code = 0  # Ctrl-C: the learner stopped as asked (a final checkpoint if it trained)
        if code != 0 and interrupted and not stopped:  # stopped while it was still starting
            print(
                f"gspo train: interrupted; the learner exited {code} before it could stop "
                f"cleanly: it was still starting ({learner.log})",
                file=sys.stderr,
            )
        elif code != 0 and not stopped:
            print(
                f"The learner failed (exit {code}); last lines of its log:\n{learner.tail()}",
                file=sys.stderr,
            )
    except (RuntimeError, TimeoutError) as exc:
        print(f"gspo train: {exc}", file=sys.stderr)
        code = 1
    finally:
        if learner is not None:
            learner.stop(timeout_s=LEARNER_STOP_TIMEOUT_S)
        for proc, _ in servers:
            proc.stop(timeout_s=30)
        shutil.rmtree(scratch, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)
    from gspo_trainer.plot import plot_training, read_history

    records = read_history(out / "checkpoints" / "history.jsonl")
    if records:
        label = spec.algorithm.loss_level.upper()
        plot_training({label: records}, out / "reward.png", title=f"gspo train: {spec.model.name}")
    print(
        summary(
            out,
            records,
            time.monotonic() - start,
            code,
            spec.algorithm.eval_every_steps,
            interrupted,
        ),
        flush=True,
    )
    return code
