"""`gspo learner --config FILE`: the learner process the learner pods (and `gspo train`) run.

The pod contract (gspo_api.ports): GSPO_CONFIG or /etc/gspo/gspojob.yaml holds the GSPOJob
manifest (or a bare spec); GSPO_ROLLOUT_URLS the servers (fixed URLs or dns+http://);
GSPO_JOB_TOKEN their control token; GSPO_POD_IP the address the servers reach rank 0 on
for weight sync; GSPO_CHECKPOINT_DIR the checkpoint volume; MASTER_ADDR/MASTER_PORT and
GSPO_NNODES/GSPO_NODE_RANK/GSPO_NPROC_PER_NODE the learner group. With more than one
process per pod (or several pods) this command starts torch.distributed.run, which runs it
again once per process.

Exit status: 0 after algorithm.maxSteps (progress phase Succeeded); 143 after SIGTERM or
SIGINT before then (a final checkpoint is written first, so a suspended, evicted or drained
job resumes where it stopped; ports.LEARNER_STOPPED_EXIT_CODE); 1 on a fatal error; 2 on
an invalid config, or one this node cannot run (a model, data set or reward function that
is not there, more GPUs than it has: `preflight`), before any work. A start
resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from gspo_api import ports
from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import ConfigError
from gspo_trainer.trackers import ENV_TRACKER_DIR

log = logging.getLogger("gspo.learner")


def load_spec(path: str | os.PathLike[str]) -> GSPOJobSpec:
    """A GSPOJob manifest or a bare spec, from YAML or JSON, read as `gspo train` reads its
    job file: FileNotFoundError when it is missing, JobFileError (one line, with the line and
    column of broken YAML) when it cannot be read as a job, SpecError naming bad fields."""
    from gspo_api.validation import parse_spec
    from gspo_trainer.train import read_job_file

    if not Path(path).exists():
        raise FileNotFoundError(str(path))
    return parse_spec(read_job_file(str(path))["spec"], prefix="spec")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gspo learner",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    default_config = os.environ.get(ports.ENV_CONFIG_PATH) or str(
        Path(ports.CONFIG_DIR) / ports.CONFIG_FILE
    )
    p.add_argument("--config", default=default_config, help="GSPOJob manifest or bare spec")
    ckpt_default = os.environ.get(ports.ENV_CHECKPOINT_DIR, ports.CHECKPOINT_DIR)
    p.add_argument(
        "--checkpoint-dir",
        default=ckpt_default,
        help=f"checkpoints, the export and history (${ports.ENV_CHECKPOINT_DIR})",
    )
    p.add_argument(
        "--rollout-urls",
        default=os.environ.get(ports.ENV_ROLLOUT_URLS, ""),
        help=f"default ${ports.ENV_ROLLOUT_URLS}",
    )
    p.add_argument(
        "--weight-sync-port",
        type=int,
        default=ports.WEIGHT_SYNC_PORT,
        help="port of the weight-sync process group rank 0 hosts",
    )
    p.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address of the status server (/metrics, /progress, /healthz)",
    )
    p.add_argument(
        "--history",
        default=None,
        help="one JSON line per step (default: in the checkpoint dir, history.jsonl)",
    )
    p.add_argument(
        "--tracker-dir",
        default=os.environ.get(ENV_TRACKER_DIR),
        help="where metrics.reportTo trackers write (default: the checkpoint dir; "
        f"${ENV_TRACKER_DIR})",
    )
    return p.parse_args(argv)


def refuse(message: str) -> int:
    """Report a configuration error found while running (one line on stderr, and for a rank
    of a group in the file its launcher reads); the exit code JobSet does not retry."""
    print(f"gspo learner: {message}", file=sys.stderr, flush=True)
    where = os.environ.get(ports.ENV_CONFIG_ERROR_FILE)
    if where and "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(OSError):
            Path(where).write_text(message + "\n")
    return ports.INVALID_CONFIG_EXIT_CODE


def _group_size() -> tuple[int, int, int]:
    env = os.environ
    return (
        int(env.get(ports.ENV_NNODES, "1")),
        int(env.get(ports.ENV_NODE_RANK, "0")),
        int(env.get(ports.ENV_NPROC_PER_NODE, "1")),
    )


# torch.distributed.run kills its ranks 30 s after passing SIGTERM on, by default: too soon
# for the final checkpoint of a large model. Leave a minute of the pod's grace period.
RANKS_STOP_SECONDS = ports.LEARNER_GRACE_SECONDS - 60


def group_command(argv: list[str]) -> list[str]:
    """torch.distributed.run starting this command once per process of the learner group,
    its rendezvous store listening on this pod's address only (`gspo_trainer.rendezvous`)."""
    nnodes, node_rank, nproc = _group_size()
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = os.environ.get("MASTER_PORT", str(ports.RENDEZVOUS_PORT))
    # fmt: skip: the command line as it reads, a module beside -m (ruff splits every item).
    return [
        sys.executable, "-m", "gspo_trainer.rendezvous",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        f"--rdzv-backend={ports.RENDEZVOUS_BACKEND}",
        f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-conf=rank={node_rank}",
        f"--shutdown-timeout={RANKS_STOP_SECONDS}",
        "-m", "gspo_operator.cli", "learner", *argv,
    ]  # fmt: skip


def _ranks_of(launcher_pid: int) -> list[int]:
    """The learner processes torch.distributed.run started (its children that carry a rank)."""
    pids: list[int] = []
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    ranks = []
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(var.startswith(b"LOCAL_RANK=") for var in environ):
            ranks.append(pid)
    return ranks


def _die_with_parent() -> None:
    """Runs in the launcher child before exec: SIGTERM it (so it stops its ranks) if we die."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def launch_group(argv: list[str]) -> int:
    """Run the learner group; SIGTERM and SIGINT go to each rank, which then checkpoints.

    The ranks get the signal, not torch.distributed.run: it would stop them itself and exit
    1 whatever they did, where a group whose ranks all checkpointed and stopped exits 0. The
    launcher runs in its own session so a terminal's Ctrl-C or a process-group kill reaches
    only this process, and it is stopped in turn if this process dies.
    """
    import tempfile

    errors = Path(tempfile.mkdtemp(prefix="gspo-learner-")) / "config-error"
    env = {**os.environ, ports.ENV_CONFIG_ERROR_FILE: str(errors)}
    proc = subprocess.Popen(
        group_command(argv), start_new_session=True, env=env, preexec_fn=_die_with_parent
    )
    signalled = False

    def forward(signum: int, _: Any) -> None:
        nonlocal signalled
        signalled = True
        ranks = _ranks_of(proc.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # a rank that has just exited
                os.kill(pid, signum)
        if not ranks:  # not started yet (or no /proc): the launcher stops what there is
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    refused = errors.read_text().strip() if errors.exists() else ""
    shutil.rmtree(errors.parent, ignore_errors=True)
    if refused:  # a rank refused its configuration: torch.distributed.run says 1
        print(f"gspo learner: {refused}", file=sys.stderr, flush=True)
        return ports.INVALID_CONFIG_EXIT_CODE
    # Ranks that stopped on request exit 0 (torch.distributed.run turns any other code into
    # 1); whether they finished or stopped early is told by whether a signal was passed on.
    if code == 0 and signalled and not _finished(argv):
        return ports.LEARNER_STOPPED_EXIT_CODE
    return code


def _finished(argv: list[str]) -> bool:
    """Whether the group trained to maxSteps (its final checkpoint is at maxSteps)."""
    from gspo_trainer import checkpoint as ckpt

    args = parse_args(argv)
    done = ckpt.list_complete(Path(args.checkpoint_dir))
    return bool(done) and done[-1][0] >= load_spec(args.config).algorithm.max_steps


def build_rollout(args: argparse.Namespace, spec: GSPOJobSpec) -> Any:
    from gspo_trainer.engine import has_gpu
    from gspo_trainer.rollout.client import RolloutClient, SyncOptions
    from gspo_trainer.rollout.discovery import FleetDiscovery, resolve_urls

    if not args.rollout_urls:
        raise ConfigError(f"no rollout servers: set ${ports.ENV_ROLLOUT_URLS} or --rollout-urls")
    urls = resolve_urls(args.rollout_urls)
    if not urls:
        raise ConfigError(f"${ports.ENV_ROLLOUT_URLS}={args.rollout_urls!r} resolved to nothing")
    sync = SyncOptions(
        master_addr=os.environ.get(ports.ENV_POD_IP, "127.0.0.1"),
        master_port=args.weight_sync_port,
        backend="nccl" if has_gpu() and spec.rollout.gpus_per_replica > 0 else "gloo",
        bucket_mb=float(spec.weight_sync.bucket_size_mb),
        timeout_s=spec.weight_sync.timeout_seconds,
        method=spec.weight_sync.method,
        directory=str(Path(args.checkpoint_dir) / ports.WEIGHTS_SUBDIR),
    )
    client = RolloutClient(
        urls,
        ports.job_token(os.environ),
        timeout_s=spec.rollout.request_timeout_seconds,
        sync=sync,
    )
    return FleetDiscovery(client, args.rollout_urls)


async def run(args: argparse.Namespace, spec: GSPOJobSpec) -> int:
    from gspo_api.progress import LearnerProgress
    from gspo_trainer.learner import Learner
    from gspo_trainer.metrics import LearnerMetrics
    from gspo_trainer.rewards import RewardFailed
    from gspo_trainer.status_server import serve_status

    rank = int(os.environ.get("RANK", "0"))
    # The status server starts before the model loads (minutes for a large one, a Hub
    # download included): the pod is Ready once its process serves, and /progress says
    # "Starting" meanwhile. Kueue's WaitForPodsReady evicts a job whose pods are not all
    # Ready within its timeout (5 minutes by default).
    metrics = LearnerMetrics()
    loaded: list[Learner] = []

    def progress() -> LearnerProgress:
        return loaded[0].progress() if loaded else LearnerProgress()

    server = None
    if rank == 0:
        shown = metrics if spec.metrics.enabled else None
        server = serve_status(shown, progress, args.metrics_host, spec.metrics.port)
        log.info(
            "Status on http://%s:%d (/progress, /healthz%s)",
            args.metrics_host,
            spec.metrics.port,
            ", /metrics" if shown else "",
        )
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # The first process of every other pod answers the pod's readiness probe. Several
        # "nodes" on one host (a test) share the port: the first one's answer serves them all.
        try:
            server = serve_status(None, None, args.metrics_host, spec.metrics.port)
        except OSError as exc:
            log.info("Health endpoint not started (%s); another process serves it", exc)
    rollout = build_rollout(args, spec) if rank == 0 else None
    ckpt_dir = Path(args.checkpoint_dir)
    history = args.history or (ckpt_dir / "history.jsonl")
    from gspo_trainer.code.runner import SandboxUnavailable

    try:
        learner = Learner.build(
            spec,
            rollout,
            checkpoint_dir=ckpt_dir,
            metrics=metrics,
            history_path=history if rank == 0 else None,
            tracker_dir=args.tracker_dir,
        )
    except SandboxUnavailable as exc:  # the cluster's state, not the spec's: exit 1, retried
        log.error("The learner stopped: %s", exc)  # the pod's termination message
        if rollout is not None:
            await rollout.close()
        if server is not None:
            server.shutdown()
        return 1
    loaded.append(learner)

    def request_stop(signum: int, _frame: object) -> None:
        log.info("Asked to stop: finishing the step, then a final checkpoint")
        learner.state.stop_requested = True

    # A plain handler, not the event loop's: ranks other than 0 train without ever yielding
    # to the loop, so a loop callback would run only when training ended (an evicted rank 1
    # would miss its final checkpoint and be killed after the grace period). Python runs
    # this between two bytecodes of the main thread, and the next step's any_rank sees it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    try:
        code = await learner.run()
    except ConfigError as exc:  # found once training read its inputs: not worth a restart
        learner.state.phase, learner.state.message = "Failed", str(exc)
        code = refuse(str(exc))
    except RewardFailed as exc:
        learner.state.phase, learner.state.message = "Failed", str(exc)
        log.error("The learner stopped: %s", exc)
        code = 1
    except Exception as exc:
        learner.state.phase, learner.state.message = "Failed", f"{type(exc).__name__}: {exc}"
        log.exception("The learner failed")
        code = 1
    finally:
        if rollout is not None:
            await rollout.close()
    if server is not None:
        server.shutdown()
    # Stopped early, after a final checkpoint: not 0 (see ports). A rank under
    # torch.distributed.run exits 0 all the same; its launcher (launch_group) says it.
    stopped = code == 0 and learner.state.phase == "Suspending"
    if stopped and "TORCHELASTIC_RUN_ID" not in os.environ:
        return ports.LEARNER_STOPPED_EXIT_CODE
    return code


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from gspo_api.validation import SpecError
    from gspo_trainer.train import JobFileError

    args = parse_args(argv)
    try:
        spec = load_spec(args.config)
    except FileNotFoundError:
        where = f"--config or ${ports.ENV_CONFIG_PATH}"
        print(f"gspo learner: config {args.config} not found ({where})", file=sys.stderr)
        return 2
    except SpecError as exc:
        for problem in exc.problems:
            print(f"gspo learner: {problem}", file=sys.stderr)
        return 2
    except JobFileError as exc:  # broken YAML, not a job, unreadable
        print(f"gspo learner: {exc}", file=sys.stderr)
        return 2
    from gspo_trainer.preflight import preflight

    problems = preflight(spec)  # before torch.distributed.run starts ranks, and in each rank
    for problem in problems:
        print(f"gspo learner: {problem}", file=sys.stderr)
    if problems:
        return 2
    nnodes, _, nproc = _group_size()
    if nnodes * nproc > 1 and "RANK" not in os.environ:
        return launch_group(argv)
    from gspo_trainer.device import DeviceError, select_device

    try:
        select_device()  # this rank's GPU, before any CUDA call or collective
    except DeviceError as exc:
        print(f"gspo learner: {exc}", file=sys.stderr)
        return 2
    try:
        code = asyncio.run(run(args, spec))
    except ConfigError as exc:
        code = refuse(str(exc))
    except ValueError as exc:
        print(f"gspo learner: {exc}", file=sys.stderr)
        return 1
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of a group: no interpreter teardown
        from gspo_trainer.engine import exit_rank

        exit_rank(code)
    return code
