"""Every route of the installed vLLM's server, as `gspo rollout-server` builds it, through the
plugin's middlewares: each one that can generate is behind the policy-version gate (503 before
the learner's weights, the version stamped after), each one the gate lets through is listed as
a non-generation route, and every route but the probes asks for the token, websockets too."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any
from unittest import mock

from prometheus_client import CollectorRegistry

from gspo_api import ports
from gspo_trainer.rollout import vllm_plugin
from gspo_trainer.rollout.control import RolloutState

# Routes of vLLM 0.32 that generate; the gate let the last three through unversioned.
GENERATION = (
    "/v1/completions",
    "/v1/chat/completions",
    "/inference/v1/generate",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
    "/generative_scoring",
)
TOKEN = "t0ken"


@functools.cache
def vllm_routes() -> tuple[tuple[str, str], ...]:
    """(type, path) of each route of vLLM's app for the generate task and of the gspo
    plugin's router, path parameters filled in."""
    from starlette.routing import Mount, Route, WebSocketRoute
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    with mock.patch.object(vllm_plugin, "_default_registry", CollectorRegistry):
        plugin_routes = vllm_plugin.GSPOEndpoints()._router().routes
    routes = [*build_app(args, ("generate",)).routes, *plugin_routes]
    found = set()
    for route in routes:
        if isinstance(route, (Route, Mount, WebSocketRoute)):
            kind = "websocket" if isinstance(route, WebSocketRoute) else "http"
            path = route.path_format if not isinstance(route, Mount) else route.path
            found.add((kind, path.format_map({k: "x1" for k in route.param_convertors})))
    return tuple(sorted(found))


def plugin(version: int | None, token: str | None = TOKEN) -> Any:
    return SimpleNamespace(token=token, state=RolloutState(version, registry=CollectorRegistry()))


def call(
    middleware: type,
    plug: Any,
    kind: str,
    path: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the request reached vLLM's app through `middleware`, and what was sent."""
    reached, sent = [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        if kind == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": kind, "path": path, "method": "POST", "headers": headers or []}
    asyncio.run(middleware(app, plugin=plug)(scope, receive, send))
    return bool(reached), sent


def test_vllms_generation_routes_are_all_in_the_route_table() -> None:
    paths = {path for _, path in vllm_routes()}
    assert set(GENERATION) <= paths


def test_every_route_that_generates_waits_for_the_learners_weights() -> None:
    passed = set()
    for kind, path in vllm_routes():
        reached, sent = call(vllm_plugin.GateMiddleware, plugin(None), kind, path)
        if reached:
            passed.add(path)
        else:
            assert sent[0]["type"] == "websocket.close" or sent[0]["status"] == 503, path
    assert not passed & set(GENERATION)
    assert passed == {p for _, p in vllm_routes() if not vllm_plugin.is_generation(p)}
    # What the gate lets through is listed by name, and the list names no stale route.
    for template in vllm_plugin.NON_GENERATION_ROUTES:
        assert any(vllm_plugin.route_pattern(template).fullmatch(p) for p in passed), template


def test_a_route_vllm_adds_later_is_gated_by_default() -> None:
    for path in ("/v1/something_new", "/v2/completions", "/control", "/tokenize/x"):
        assert call(vllm_plugin.GateMiddleware, plugin(None), "http", path)[0] is False, path
    reached, sent = call(vllm_plugin.GateMiddleware, plugin(3), "http", "/v1/messages")
    assert reached and (ports.VERSION_HEADER.encode(), b"3") in sent[0]["headers"]


def test_a_websocket_needs_the_token_and_never_generates() -> None:
    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        reached, sent = call(
            vllm_plugin.TokenMiddleware, plugin(3), "websocket", "/tokenize", headers
        )
        assert not reached and sent[0]["type"] == "websocket.close"
    assert call(vllm_plugin.TokenMiddleware, plugin(3), "websocket", "/tokenize", auth)[0]
    reached, sent = call(vllm_plugin.GateMiddleware, plugin(3), "websocket", "/v1/realtime")
    assert not reached and sent[0]["type"] == "websocket.close"
