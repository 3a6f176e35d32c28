"""The rollout server as vLLM's own OpenAI-compatible server plus this endpoint plugin.

`serve_command.py` starts `python -m vllm.entrypoints.openai.api_server` with our worker
extension (`--worker-extension-cls`: the weight receiver, `worker_ext.py`) and this plugin
enabled (`VLLM_PLUGINS=gspo`, entry point group `vllm.endpoint_plugins`). The plugin adds
what a rollout server needs beside vLLM's routes, reaching the engine only through the
EngineClient it is handed (`collective_rpc`, `reset_prefix_cache`), with vLLM's development
mode off:

    GET  /health               200 with this server's state while the engine lives (replaces
                               vLLM's bare /health; 503 once the engine is dead)
    GET  /ready                200 only once the server holds the learner's weights (not the
                               pods' readiness probe: that is /health, see docs/rollout.md)
    POST /control/pause        stop admitting generations and drain those in flight
    POST /control/resume
    POST /control/sync/init    join the learner's weight-sync group
    POST /control/sync/update  receive one bucketed broadcast, load it, bump the version
    POST /control/sync/load    {"name": "v00000007", "version": 7}: load that version from
                               $GSPO_WEIGHTS_DIR (weightSync.method filesystem)

Two middlewares wrap vLLM's app. The gate admits each generation request whole under one
policy version, holds new ones while a sync runs, answers 503 before the first sync, and
stamps every response with the version that produced it (header `x-gspo-policy-version`).
Every route is a generation route but those `NON_GENERATION_ROUTES` lists (probes, metrics,
tokenization, model listing, control): a route a later vLLM adds is gated until it is listed
here. A websocket can carry generations across a sync, so one to a gated route is refused.
The token check asks for the job's token ($GSPO_JOB_TOKEN, also vLLM's --api-key) on every
route, websockets included, but /health, /ready, /metrics, /ping and /version: vLLM's
--api-key guards only /v1, leaving /tokenize, /invocations, ... open.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

# Module level: FastAPI reads the routes' annotations (strings here) in this module.
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gspo_api import ports
from gspo_trainer.rollout.control import (
    ControlError,
    RolloutState,
)

log = logging.getLogger("gspo.rollout")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/ping", "/version"})
CONTROL_PREFIX = "/control/"
# The routes of vLLM 0.32's server (generate task) that generate nothing, so answer outside
# the policy-version gate; `{name}` is one path segment. Every other route is gated.
NON_GENERATION_ROUTES = (
    *sorted(OPEN_PATHS),
    CONTROL_PREFIX + "{action}",
    CONTROL_PREFIX + "sync/{action}",
    "/load",  # the server's load, for routers
    "/kv_event_sources",
    "/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/chat/completions/render",  # a request as prompt tokens, without generating
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/v1/responses/{response_id}",  # a stored response, read back
    "/v1/responses/{response_id}/cancel",
    "/inference/v1/abort_requests",  # must reach the engine while a sync holds the gate
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
)
ADMIT_TIMEOUT_S = 600.0  # how long a generation waits for a sync in progress


class GSPOEndpoints:
    """The `vllm.endpoint_plugins` entry point (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "gspo"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        _log_to_stderr()
        self.token = ports.job_token(os.environ)
        weights = os.environ.get(ports.ENV_WEIGHTS_DIR)
        self.weights_dir = Path(weights) if weights else None
        initial = os.environ.get(ports.ENV_INITIAL_VERSION)
        self.state = RolloutState(int(initial) if initial else None, registry=_default_registry())
        self.engine: Any = None
        self.model_name: str | None = None  # what requests name as "model"
        self.workers = 1  # the engine's workers: ranks in the weight-sync group

    def attach_router(self, app: Any) -> None:
        app.add_middleware(GateMiddleware, plugin=self)
        app.add_middleware(TokenMiddleware, plugin=self)  # outside the gate: refuse first
        app.include_router(self._router())

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from gspo_trainer.rollout.core_share import engine_yields
        from gspo_trainer.rollout.engine import warm_up

        if engine_client is None:
            raise RuntimeError("the gspo endpoint plugin needs an engine (not a render server)")
        self.engine = engine_client
        served = getattr(args, "served_model_name", None)
        self.model_name = served[0] if served else args.model
        self.workers = int(engine_client.vllm_config.parallel_config.world_size)
        if self.token is None:
            log.warning("$%s is not set: control routes are disabled", ports.ENV_JOB_TOKEN)
        engine_yields(os.environ)  # its engine runs by now: a child of this process
        await warm_up(engine_client)

    def _router(self) -> Any:
        router = APIRouter()

        async def answer(handle: Any, request: Request) -> JSONResponse:
            try:
                return JSONResponse(await handle(await _body(request)))
            except ControlError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)

        @router.get("/health")
        async def health() -> JSONResponse:
            try:
                await self.engine.check_health()
            except Exception as exc:
                return JSONResponse({"status": "engine dead", "error": str(exc)}, 503)
            gate, version = self.state.gate, self.state.policy_version
            return JSONResponse(
                {
                    "status": "ok",
                    "policy_version": version,
                    "synced": version is not None,
                    "paused": gate.paused,
                    "active_requests": gate.active,
                    "model": self.model_name,
                    "workers": self.workers,
                }
            )

        @router.get("/ready")
        async def ready() -> JSONResponse:
            if self.state.policy_version is None:
                return JSONResponse({"error": "not synced: waiting for the learner's weights"}, 503)
            return JSONResponse({"ready": True, "policy_version": self.state.policy_version})

        @router.post("/control/pause")
        async def pause(request: Request) -> JSONResponse:
            return await answer(self._pause, request)

        @router.post("/control/resume")
        async def resume() -> JSONResponse:
            return JSONResponse(self.state.resume())

        @router.post("/control/sync/init")
        async def sync_init(request: Request) -> JSONResponse:
            return await answer(self._join, request)

        @router.post("/control/sync/update")
        async def sync_update(request: Request) -> JSONResponse:
            return await answer(self._receive, request)

        @router.post("/control/sync/load")
        async def sync_load(request: Request) -> JSONResponse:
            return await answer(self._load, request)

        return router

    async def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.state.pause(float(body.get("timeout_s", 300)))

    async def _join(self, body: dict[str, Any]) -> dict[str, Any]:
        from gspo_trainer.rollout.engine import init_sync_group

        workers = await self.state.join(body, functools.partial(init_sync_group, self.engine))
        return {"joined": True, "workers": workers}

    async def _receive(self, body: dict[str, Any]) -> dict[str, Any]:
        from gspo_trainer.rollout.engine import receive_weights

        return await self.state.receive(body, functools.partial(receive_weights, self.engine))

    async def _load(self, body: dict[str, Any]) -> dict[str, Any]:
        from gspo_trainer.rollout.engine import load_weights_file

        load = functools.partial(load_weights_file, self.engine)
        setting = f"${ports.ENV_WEIGHTS_DIR}"
        return await self.state.load_file(body, self.weights_dir, setting, load)


async def _body(request: Any) -> dict[str, Any]:
    """A control request's JSON object (empty when it has no body); 400 otherwise."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ControlError(400, f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ControlError(400, "body must be a JSON object")
    return body


async def _send_json(
    send: Any, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class TokenMiddleware:
    """The job's token on every route but the probes and /metrics (pure ASGI)."""

    def __init__(self, app: Any, plugin: GSPOEndpoints) -> None:
        self.app, self.plugin = app, plugin

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        token = self.plugin.token
        if path not in OPEN_PATHS:
            if token is None and path.startswith(CONTROL_PREFIX):
                return await _send_json(
                    send,
                    403,
                    {"error": f"control routes are disabled: set ${ports.ENV_JOB_TOKEN}"},
                )
            if token is not None and not _authorized(scope, token):
                if kind == "websocket":
                    return await _refuse_websocket(send, "missing or wrong bearer token")
                return await _send_json(
                    send,
                    401,
                    {"error": "missing or wrong bearer token"},
                    ((b"www-authenticate", b"Bearer"),),
                )
        await self.app(scope, receive, send)


class GateMiddleware:
    """Generation requests admitted whole under one policy version, which their response
    carries (pure ASGI: the version cannot change until the response's last byte is sent)."""

    def __init__(self, app: Any, plugin: GSPOEndpoints) -> None:
        self.app, self.plugin = app, plugin

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not is_generation(_route_path(scope)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await _refuse_websocket(send, "generation is served over HTTP only")
        state = self.plugin.state
        if state.policy_version is None:
            return await _send_json(
                send, 503, {"error": "not synced: waiting for the learner's weights"}
            )
        try:
            async with state.gate.admit(ADMIT_TIMEOUT_S):
                version = str(state.policy_version).encode()
                status = 500

                async def stamped(message: dict[str, Any]) -> None:
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = int(message["status"])
                        headers = [
                            *message.get("headers", []),
                            (ports.VERSION_HEADER.encode(), version),
                        ]
                        message = {**message, "headers": headers}
                    await send(message)

                try:
                    await self.app(scope, receive, stamped)
                finally:
                    state.requests.labels("ok" if status < 400 else "error").inc()
        except TimeoutError:
            await _send_json(
                send, 503, {"error": f"paused for a weight sync for over {ADMIT_TIMEOUT_S:.0f} s"}
            )


def route_pattern(template: str) -> re.Pattern[str]:
    """The paths a route template matches: its text, each `{name}` (escaped `\\{name\\}` by
    re.escape) one path segment."""
    return re.compile(re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(template)))


_NON_GENERATION = tuple(route_pattern(t) for t in NON_GENERATION_ROUTES)


def is_generation(path: str) -> bool:
    """Whether a request to `path` goes through the gate: every route but those listed."""
    return not any(p.fullmatch(path) for p in _NON_GENERATION)


def _route_path(scope: Any) -> str:
    """The path the app routes on (vLLM's --root-path removed)."""
    return str(scope.get("path", "")).removeprefix(scope.get("root_path", ""))


async def _refuse_websocket(send: Any, reason: str) -> None:
    """Close a websocket before accepting it: the client gets HTTP 403 (ASGI spec)."""
    await send({"type": "websocket.close", "code": 1008, "reason": reason})


def _authorized(scope: Any, token: str) -> bool:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                given.encode(), token.encode()
            )
    return False


def _log_to_stderr() -> None:
    """Our INFO lines (weights loaded, versions) in the server's log: vLLM configures only its
    own logger, and Python's fallback handler prints warnings and worse."""
    gspo = logging.getLogger("gspo")
    if not gspo.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        gspo.addHandler(handler)
        gspo.setLevel(logging.INFO)


def _default_registry() -> Any:
    """The registry vLLM's /metrics serves: the process's default one (one API server)."""
    from prometheus_client import REGISTRY

    return REGISTRY
