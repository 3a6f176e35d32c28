"""`gspo operator`: run the GSPOJob operator (kopf), its /metrics and its liveness probe."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

import kopf

from gspo_operator.handlers import DEFAULT_INTERVAL_S, Context, register
from gspo_operator.kube import Kube, load_api_client
from gspo_operator.metrics import OperatorMetrics
from gspo_trainer import ports

log = logging.getLogger("gspo_operator")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gspo operator", description=__doc__.split("\n")[0])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--metrics-port", type=int, default=ports.OPERATOR_METRICS_PORT)
    p.add_argument("--health-port", type=int, default=ports.OPERATOR_HEALTH_PORT)
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
        help="seconds between reconciliations of each job",
    )
    return p.parse_args(argv)


def build_registry(ctx: Context, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    kopf.on.login(registry=registry)(login or kopf.login_via_client)
    return registry


def configure(settings: kopf.OperatorSettings, *, scanning: bool = True) -> None:
    settings.scanning.disabled = not scanning
    settings.posting.level = logging.INFO  # Events for Normal transitions too
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Progress lives in annotations, so `kubectl get -o yaml` stays readable.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="gspo.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="gspo.dev")
    settings.persistence.finalizer = "gspo.dev/finalizer"
    # A GSPOJob deleted while its timer is mid-reconcile (the ttlSecondsAfterFinished delete
    # is issued by that very timer) keeps its finalizer until kopf looks again: every second,
    # not kopf's default minute.
    settings.background.cancellation_polling = 1.0


async def serve(
    ctx: Context,
    *,
    namespaces: Collection[str] = (),
    login: Callable[..., Any] | None = None,
    scanning: bool = True,
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (or forever)."""
    settings = kopf.OperatorSettings()
    configure(settings, scanning=scanning)
    # kopf cancels every task born after start-up when it stops; spare those that came before.
    ignored = asyncio.all_tasks()
    tasks = await kopf.spawn_tasks(
        registry=build_registry(ctx, login),
        settings=settings,
        standalone=True,  # one replica (the chart's Deployment uses Recreate); no peering
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=kopf.Memo(),
    )
    try:
        await kopf.run_tasks(tasks, ignored=ignored)
    finally:
        if ctx.http is not None:
            await ctx.http.close()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    from prometheus_client import start_http_server

    metrics = OperatorMetrics()
    start_http_server(args.metrics_port, registry=metrics.registry)
    ctx = Context(kube=Kube(load_api_client()), metrics=metrics, interval_s=args.interval)
    namespaces = [] if args.all_namespaces else args.namespace
    log.info("Watching %s", ", ".join(namespaces) if namespaces else "all namespaces")
    asyncio.run(
        serve(
            ctx,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
        )
    )
    return 0
