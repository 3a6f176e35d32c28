"""`gspo operator`: run the GSPOJob operator (kopf), its /metrics and its liveness probe.

With `--leader-elect` several replicas run and only the holder of a Lease reconciles
(gspo_operator.leader); the others stand by, answering /healthz, until the Lease is theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import aiohttp.web
import kopf

from gspo_api import ports
from gspo_operator import leader
from gspo_operator.handlers import DEFAULT_INTERVAL_S, Context, label_selectors, register
from gspo_operator.kube import Kube, load_api_client
from gspo_operator.manifest import ClusterPolicy, PolicyError
from gspo_operator.metrics import OperatorMetrics
from gspo_operator.reconcile import (
    DEFAULT_PROGRESS_WRITE_S,
    DEFAULT_PROGRESS_WRITES_PER_MINUTE,
)

log = logging.getLogger("gspo_operator")

# Exit status of a leader that lost its Lease: non-zero, so Kubernetes restarts the container
# and it rejoins as a candidate (client-go's usual OnStoppedLeading is a fatal exit too).
EXIT_LOST_LEADERSHIP = 1
# How long a leader that lost its Lease lets kopf stop before exiting regardless. The renew
# deadline (10 s) plus this stays under the lease duration (15 s): it has stopped before a
# standby may take over.
LOST_STOP_GRACE_S = 3.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gspo operator",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the operator's and kopf's log level",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=ports.OPERATOR_METRICS_PORT,
        help="Prometheus /metrics port",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=ports.OPERATOR_HEALTH_PORT,
        help="/healthz port (liveness and readiness)",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable)",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between reads of a running learner's progress",
    )
    p.add_argument(
        "--progress-write-interval",
        type=float,
        default=DEFAULT_PROGRESS_WRITE_S,
        help="shortest time between status writes of one job that only report progress "
        "(step, reward)",
    )
    p.add_argument(
        "--progress-writes-per-minute",
        type=float,
        default=DEFAULT_PROGRESS_WRITES_PER_MINUTE,
        help="progress-only status writes a minute, shared by all running jobs (0: no limit)",
    )
    election = p.add_argument_group("leader election (several replicas, one reconciling)")
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="reconcile only while holding a coordination.k8s.io Lease; stand by otherwise",
    )
    election.add_argument(
        "--leader-election-namespace",
        default=None,
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE or the pod's own namespace)",
    )
    election.add_argument(
        "--leader-election-id",
        default=leader.DEFAULT_LEASE_NAME,
        metavar="NAME",
        help="name of the Lease",
    )
    defaults = leader.Timing()
    election.add_argument(
        "--leader-election-lease-duration",
        type=float,
        default=defaults.lease_duration_s,
        metavar="S",
        help="seconds a standby waits after the leader's last renewal before taking over",
    )
    election.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=defaults.renew_deadline_s,
        metavar="S",
        help="seconds the leader keeps trying to renew before it stops leading",
    )
    election.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=defaults.retry_period_s,
        metavar="S",
        help="seconds between tries to acquire or renew the Lease",
    )
    return p.parse_args(argv)


def build_registry(ctx: Context, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    kopf.on.login(registry=registry)(login or kopf.login_via_client)
    return registry


async def _serves_jobsets(ctx: Context) -> bool:
    from gspo_operator.kube import ApiError
    from gspo_operator.render import JOBSET_API

    try:
        return await ctx.kube.serves(JOBSET_API, "JobSet")
    except ApiError as exc:
        log.warning("Cannot tell whether JobSet is served (%s); reading JobSets by name", exc)
        return False


def configure(settings: kopf.OperatorSettings, *, scanning: bool = True) -> None:
    settings.scanning.disabled = not scanning
    settings.posting.level = logging.INFO  # Events for Normal transitions too
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Progress lives in annotations, so `kubectl get -o yaml` stays readable.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="gspo.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="gspo.dev")
    # No handler needs a finalizer; kopf removes this one, which older releases added to
    # every job, the first time it sees such a job.
    settings.persistence.finalizer = "gspo.dev/finalizer"
    label_selectors(settings)


async def serve(
    ctx: Context,
    *,
    namespaces: Collection[str] = (),
    login: Callable[..., Any] | None = None,
    scanning: bool | None = None,
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    on_signal: Callable[[signal.Signals], None] | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (or forever). With `on_signal`, SIGTERM and
    SIGINT call it instead of stopping kopf directly (run_elected).

    `scanning` defaults to on only cluster-wide: with namespaces named exactly, kopf needs no
    namespace list/watch and no CRD watch, so the chart's namespaced install grants neither
    (least privilege); cluster-wide, the CRD watch notices a CRD installed after start-up.
    """
    settings = kopf.OperatorSettings()
    configure(settings, scanning=not namespaces if scanning is None else scanning)
    # JobSets are watched when the cluster serves them at start-up; else each job's JobSet is
    # read by name while it runs, so a JobSet installed later still starts the waiting jobs.
    ctx.watch_jobsets = await _serves_jobsets(ctx)
    # kopf cancels every task born after start-up when it stops; spare those that came before.
    ignored = asyncio.all_tasks()
    tasks = await kopf.spawn_tasks(
        registry=build_registry(ctx, login),
        settings=settings,
        # No kopf peering: one process reconciles at a time, either the only replica or the
        # holder of the leader-election Lease (run_elected).
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=kopf.Memo(),
    )
    if on_signal is not None:  # replaces the handlers spawn_tasks has just installed
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        await kopf.run_tasks(tasks, ignored=ignored)
    finally:
        if ctx.http is not None:
            await ctx.http.close()


@contextlib.asynccontextmanager
async def standby_health(port: int, elector: leader.LeaderElector) -> AsyncIterator[None]:
    """/healthz while standing by: kopf's own liveness endpoint runs only where kopf runs (the
    leader), yet a standby must pass its probes too, or Kubernetes would restart it forever
    and a rolling update would never see it Ready. It answers 200 while this process (its
    event loop, so its lease polling) is alive, and says who leads."""

    async def healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(
            {"leader": False, "identity": elector.identity, "holder": elector.leader}
        )

    app = aiohttp.web.Application()
    app.router.add_get("/healthz", healthz)
    runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield
    finally:
        await runner.cleanup()  # frees the port for kopf's liveness endpoint


async def run_elected(
    ctx: Context,
    elector: leader.LeaderElector,
    *,
    namespaces: Collection[str] = (),
    health_port: int,
    login: Callable[..., Any] | None = None,
    scanning: bool | None = None,
) -> int:
    """Stand by until `elector` holds the Lease, then run kopf until leadership is lost
    (returns EXIT_LOST_LEADERSHIP) or a signal stops it (releases the Lease, returns 0)."""
    ctx.metrics.leader.set(0)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # kopf installs its own once it runs
        loop.add_signal_handler(sig, stopping.set)
    async with standby_health(health_port, elector):
        won = await elector.acquire(stopping)
    if not won:
        log.info("Stopped while standing by")
        return 0
    ctx.metrics.leader.set(1)
    stop_kopf = asyncio.Event()
    # Created before serve() so that kopf, which cancels every task born while it runs when
    # it stops, leaves them alone: the renewals, and a signal that came before kopf put its
    # own handlers in place.
    holding = asyncio.create_task(elector.hold(stop_kopf), name="leader-election renewals")
    forwarding = asyncio.create_task(_forward(stopping, stop_kopf), name="early signals")
    serving = asyncio.create_task(
        serve(
            ctx,
            namespaces=namespaces,
            login=login,
            scanning=scanning,
            liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz",
            stop_flag=stop_kopf,
            # A signal sets the stop flag: kopf stopped by its own signal handling leaves its
            # waiter on the stop flag pending, and waits 5 s for it before it returns.
            on_signal=lambda sig: _stop_on(sig, stop_kopf),
        ),
        name="kopf",
    )
    await asyncio.wait({holding, serving}, return_when=asyncio.FIRST_COMPLETED)
    if holding.done() and holding.result():
        ctx.metrics.leader.set(0)
        log.error(
            "Lost leadership (lease %s in ns %s): %s; stopping",
            elector.lock.name,
            elector.lock.namespace,
            holding.result(),
        )
        stop_kopf.set()
        forwarding.cancel()
        await asyncio.wait({serving}, timeout=LOST_STOP_GRACE_S)
        return EXIT_LOST_LEADERSHIP
    # kopf stopped, or is stopping: a signal, or an error. Hand the Lease over once it is done.
    stop_kopf.set()
    forwarding.cancel()
    await asyncio.wait({serving})
    lost = await holding
    ctx.metrics.leader.set(0)
    if not lost:
        await elector.release()
    serving.result()  # re-raise kopf's error, if any, now that the Lease is released
    return EXIT_LOST_LEADERSHIP if lost else 0


def _stop_on(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("Received %s; stopping", sig.name)
    stop.set()


async def _forward(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:  # the chart's policy values: refuse to start on one that cannot be used, naming it
        policy = ClusterPolicy.from_env()
    except PolicyError as exc:
        log.error("%s", exc)
        return 2
    from prometheus_client import start_http_server

    metrics = OperatorMetrics()
    start_http_server(args.metrics_port, registry=metrics.registry)
    ctx = Context(
        kube=Kube(load_api_client()),
        metrics=metrics,
        interval_s=args.interval,
        progress_write_s=args.progress_write_interval,
        progress_writes_per_minute=args.progress_writes_per_minute,
        policy=policy,
    )
    namespaces = [] if args.all_namespaces else args.namespace
    log.info("Watching %s", ", ".join(namespaces) if namespaces else "all namespaces")
    if not args.leader_elect:
        metrics.leader.set(1)  # the only replica reconciles
        asyncio.run(
            serve(
                ctx,
                namespaces=namespaces,
                liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
            )
        )
        return 0
    timing = leader.Timing(
        lease_duration_s=args.leader_election_lease_duration,
        renew_deadline_s=args.leader_election_renew_deadline,
        retry_period_s=args.leader_election_retry_period,
    )
    namespace = args.leader_election_namespace or leader.default_namespace()
    # Its own API client: renewals never queue behind the handlers' requests.
    lock = leader.LeaseLock(Kube(load_api_client()), namespace, args.leader_election_id)
    elector = leader.LeaderElector(lock, leader.identity_of(), timing)
    with asyncio.Runner() as runner:
        code = runner.run(
            run_elected(ctx, elector, namespaces=namespaces, health_port=args.health_port)
        )
        if code == EXIT_LOST_LEADERSHIP:
            # Exit before the runner joins the worker threads: one may be blocked on an API
            # server that stopped answering (a likely reason the Lease was lost), and nothing
            # of this process may reconcile any more.
            logging.shutdown()
            os._exit(code)
    return code
