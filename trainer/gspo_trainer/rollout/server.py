"""`gspo rollout-server`: a vLLM engine behind a small authenticated HTTP API.

Routes (JSON bodies; `Authorization: Bearer <token>` on every /control route, and on
/v1/generate with --require-token-for-generate; the token comes from $GSPO_SYNC_TOKEN):

    POST /v1/generate          {"prompts": [[ids]|"text"], "sampling": {...}} -> completions
    GET  /health               liveness and state (200 while the process serves)
    GET  /ready                200 only once the server holds the learner's weights
    GET  /metrics              Prometheus text: ours (gspo_rollout_*) and vLLM's own
    POST /control/pause        stop admitting generations and drain those in flight
    POST /control/resume
    POST /control/sync/init    join the learner's weight-sync group
    POST /control/sync/update  receive one bucketed broadcast, load it, bump the version
    POST /control/sync/load    {"name": "v00000007", "version": 7}: load that version from
                               --weights-dir (weightSync.method filesystem), bump the version

A generation request is admitted whole under one policy version and the version cannot
change while any admitted request runs, so no response mixes two versions.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gspo_trainer import ports
from gspo_trainer.rollout.control import (
    ControlError,
    RolloutState,
)
from gspo_trainer.rollout.engine import Engine, EngineOptions, Sample
from gspo_trainer.rollout.types import SamplingParams

log = logging.getLogger("gspo.rollout")

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine")
STATE_KEY: web.AppKey[ServerState] = web.AppKey("state")


class ServerState(RolloutState):
    def __init__(self, token: str | None, require_token_for_generate: bool,
                 version: int | None, weights_dir: Path | None = None) -> None:  # fmt: skip
        super().__init__(version)
        self.token = token
        self.require_token_for_generate = require_token_for_generate
        self.weights_dir = weights_dir  # where /control/sync/load finds versions


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _bad_request(message: str, prompt_index: int | None = None) -> web.HTTPBadRequest:
    """A 400 to raise from parsing helpers, with the same JSON body as `_error`, and the index
    of the prompt it refuses when one prompt is the cause (the client drops that one alone)."""
    body: dict[str, Any] = {"error": message}
    if prompt_index is not None:
        body["prompt_index"] = prompt_index
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


def _authorized(state: ServerState, request: web.Request) -> bool:
    header = request.headers.get("Authorization", "")
    if state.token is None or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header.removeprefix("Bearer ").encode(), state.token.encode())


def _guarded(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE_KEY]
        if state.token is None:
            return _error(403, f"control routes are disabled: set ${ports.ENV_SYNC_TOKEN}")
        if not _authorized(state, request):
            return _error(401, "missing or wrong bearer token")
        return await handler(request)

    return wrapped


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise _bad_request(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad_request("body must be a JSON object")
    return body


MAX_SAMPLES_PER_REQUEST = 65536  # prompts x n in one request
MAX_N = 1024
MAX_BODY_BYTES = 64 * 1024 * 1024


def parse_sampling(raw: dict[str, Any], max_model_len: int) -> SamplingParams:
    if not isinstance(raw, dict):
        raise _bad_request("sampling: give a JSON object of sampling parameters")
    allowed = set(SamplingParams.__dataclass_fields__)
    unknown = set(raw) - allowed
    if unknown:
        raise _bad_request(
            f"sampling: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}"
        )
    try:
        params = SamplingParams(**{**raw, "stop_token_ids": tuple(raw.get("stop_token_ids", ()))})
    except TypeError as exc:
        raise _bad_request(f"sampling: {exc}") from exc
    problems = []
    if not isinstance(params.n, int) or not 1 <= params.n <= MAX_N:
        problems.append(f"sampling.n must be an integer in 1..{MAX_N}, got {params.n!r}")
    if not isinstance(params.max_tokens, int) or not 1 <= params.max_tokens < max_model_len:
        problems.append(
            f"sampling.max_tokens must be an integer in 1..{max_model_len - 1} "
            f"(the server's --max-model-len is {max_model_len}), got {params.max_tokens!r}"
        )
    if not isinstance(params.temperature, int | float) or params.temperature < 0:
        problems.append(f"sampling.temperature must be >= 0, got {params.temperature!r}")
    if not isinstance(params.top_p, int | float) or not 0 < params.top_p <= 1:
        problems.append(f"sampling.top_p must be in (0, 1], got {params.top_p!r}")
    if problems:
        raise _bad_request("; ".join(problems))
    return params


def parse_prompts(raw: Any, engine: Engine, params: SamplingParams) -> list[list[int]]:
    """Token-id prompts that fit the model with room for max_tokens, or 400 naming the first
    that does not."""
    if not isinstance(raw, list) or not raw:
        raise _bad_request("prompts: give a non-empty list of token-id lists or strings")
    if len(raw) * params.n > MAX_SAMPLES_PER_REQUEST:
        raise _bad_request(
            f"prompts x sampling.n is {len(raw) * params.n}, above "
            f"{MAX_SAMPLES_PER_REQUEST} per request: split the batch"
        )
    prompts = []
    room = engine.max_model_len - params.max_tokens
    for i, prompt in enumerate(raw):
        if isinstance(prompt, str):
            prompt = engine.tokenize(prompt)
        elif not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size
            for t in prompt
        ):
            raise _bad_request(
                f"prompts[{i}]: give a string or a list of token ids in 0..{engine.vocab_size - 1}",
                i,
            )
        if not prompt:
            raise _bad_request(f"prompts[{i}] is empty", i)
        if len(prompt) > room:
            raise _bad_request(
                f"prompts[{i}] has {len(prompt)} tokens; with sampling.max_tokens "
                f"{params.max_tokens} the model holds at most {room} (--max-model-len "
                f"{engine.max_model_len}): shorten the prompt or max_tokens",
                i,
            )
        prompts.append(prompt)
    return prompts


async def generate(request: web.Request) -> web.Response:
    state, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    if state.require_token_for_generate and not _authorized(state, request):
        return _error(401, "missing or wrong bearer token")
    body = await _json(request)
    unknown = set(body) - {"prompts", "sampling", "timeout_s"}
    if unknown:
        return _error(
            400, f"unknown fields {sorted(unknown)}; allowed: prompts, sampling, timeout_s"
        )
    params = parse_sampling(body.get("sampling", {}), engine.max_model_len)
    token_prompts = parse_prompts(body.get("prompts"), engine, params)
    if state.policy_version is None:
        return _error(503, "not synced: waiting for the learner's weights")
    timeout_s = float(body.get("timeout_s", 600))
    try:
        async with state.gate.admit(timeout_s):
            version = state.policy_version
            # Each prompt its own seed (SamplingParams.seed): one seed for every request
            # would draw every prompt's samples from one random stream.
            groups = await asyncio.gather(
                *(engine.generate(p, params.for_prompt(i)) for i, p in enumerate(token_prompts))
            )
    except Exception as exc:
        state.requests.labels("error").inc()
        log.exception("generation failed")
        return _error(503, f"generation failed: {exc}")
    state.requests.labels("ok").inc()
    results = [
        {
            "prompt_index": i,
            "prompt_token_ids": token_prompts[i],
            "completions": [_completion_json(s, version) for s in samples],
        }
        for i, samples in enumerate(groups)
    ]
    return web.json_response({"policy_version": version, "results": results})


def _completion_json(sample: Sample, version: int | None) -> dict[str, Any]:
    """By hand, not dataclasses.asdict: that deep-copies every token id and log-prob, and
    was most of the HTTP path's cost."""
    return {"token_ids": sample.token_ids, "logprobs": sample.logprobs,
            "finish_reason": sample.finish_reason, "policy_version": version}  # fmt: skip


async def health(request: web.Request) -> web.Response:
    state, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    return web.json_response(
        {
            "status": "ok",
            "policy_version": state.policy_version,
            "synced": state.policy_version is not None,
            "paused": state.gate.paused,
            "active_requests": state.gate.active,
            "workers": engine.workers,
        }
    )


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.policy_version is None:
        return _error(503, "not synced: waiting for the learner's weights")
    return web.json_response({"ready": True, "policy_version": state.policy_version})


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import REGISTRY, generate_latest

    text = generate_latest(request.app[STATE_KEY].registry) + generate_latest(REGISTRY)
    return web.Response(body=text, content_type="text/plain", charset="utf-8")


@_guarded
async def pause(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _json(request) if request.can_read_body else {}
    return await _answer(state.pause(float(body.get("timeout_s", 300))))


@_guarded
async def resume(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].resume())


@_guarded
async def sync_init(request: web.Request) -> web.Response:
    state, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]

    async def join() -> dict[str, Any]:
        await state.join(await _json(request), engine.init_sync_group)
        return {"joined": True, "workers": engine.workers}

    return await _answer(join())


@_guarded
async def sync_update(request: web.Request) -> web.Response:
    state, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    return await _answer(state.receive(await _json(request), engine.receive_weights))


@_guarded
async def sync_load(request: web.Request) -> web.Response:
    state, engine = request.app[STATE_KEY], request.app[ENGINE_KEY]
    body = await _json(request)
    return await _answer(state.load_file(body, state.weights_dir, "--weights-dir",
                                         engine.load_weights_file))  # fmt: skip


async def _answer(result: Awaitable[dict[str, Any]]) -> web.Response:
    try:
        return web.json_response(await result)
    except ControlError as exc:
        return _error(exc.status, str(exc))


def build_app(
    engine: Engine,
    *,
    token: str | None,
    require_token_for_generate: bool = False,
    initial_version: int | None = None,
    weights_dir: Path | None = None,
) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = ServerState(token, require_token_for_generate, initial_version, weights_dir)
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/control/pause", pause)
    app.router.add_post("/control/resume", resume)
    app.router.add_post("/control/sync/init", sync_init)
    app.router.add_post("/control/sync/update", sync_update)
    app.router.add_post("/control/sync/load", sync_load)
    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gspo rollout-server",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF name, local path, or a built-in model (builtin:tiny-qwen3-moe, ...)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address the HTTP API listens on")
    p.add_argument("--port", type=int, default=ports.ROLLOUT_HTTP_PORT, help="HTTP API port")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (model.dtype)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vLLM's max_model_len (model.maxModelLen); None: the model's",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="vLLM's max_num_seqs: sequences in flight (rollout.maxNumSeqs)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="vLLM's gpu_memory_utilization (rollout.gpuMemoryUtilization)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM's tensor_parallel_size (rollout.tensorParallelSize)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vLLM engine argument (repeatable); VALUE is parsed as JSON when it can be",
    )
    p.add_argument(
        "--require-token-for-generate",
        action="store_true",
        help="/v1/generate needs the sync token too (the control API always does)",
    )
    p.add_argument(
        "--initial-policy-version",
        type=int,
        default=None,
        help="serve the loaded weights as this version at once; without it the "
        "server is not ready until the learner's first update",
    )
    p.add_argument("--cache-dir", default=None, help="where builtin:* models are written")
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="the learner's weight directory on a shared volume, for "
        "weightSync.method filesystem (/control/sync/load)",
    )
    return p.parse_args(argv)


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r}: write KEY=VALUE, e.g. seed=0")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


def resolve_model(model: str, cache_dir: str | None) -> str:
    if model.startswith("builtin:"):
        from gspo_trainer.tiny import materialize

        return str(materialize(model, cache_dir))
    return model


async def serve(args: argparse.Namespace) -> None:
    from gspo_trainer.rollout.engine import VLLMEngine

    token = os.environ.get(ports.ENV_SYNC_TOKEN) or None
    if token is None:
        log.warning("$%s is not set: control routes are disabled", ports.ENV_SYNC_TOKEN)
    options = EngineOptions(
        model=resolve_model(args.model, args.cache_dir),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        extra=parse_engine_args(args.engine_arg),
    )
    engine = await VLLMEngine.start(options)
    app = build_app(
        engine,
        token=token,
        require_token_for_generate=args.require_token_for_generate,
        initial_version=args.initial_policy_version,
        weights_dir=args.weights_dir,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("Serving %s on %s:%s", options.model, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await engine.shutdown()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.model.startswith("builtin:"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built on the spot, never downloaded
    asyncio.run(serve(args))
    return 0
