"""A rollout server as the pods run it, vLLM's OpenAI-compatible server with the gspo endpoint
plugin, with vLLM's engine and its /v1/completions and /inference/v1/generate routes stood in
for (tests and benches).

Real, not stood in for:
- the plugin (`gspo_trainer.rollout.vllm_plugin.GSPOEndpoints`): constructed with the
  environment it reads set ($GSPO_JOB_TOKEN, $GSPO_INITIAL_POLICY_VERSION, $GSPO_WEIGHTS_DIR),
  wired as vLLM wires an endpoint plugin: `attach_router(app)` while the app is built (its
  token and generation-gate middlewares, /health, /ready, /control/*), `init_state(engine
  client, app.state, args)` awaited at start-up (which runs the real `engine.warm_up`);
- the engine operations the control routes call (`gspo_trainer.rollout.engine`), through the
  stand-in EngineClient's `collective_rpc` and `reset_prefix_cache`;
- with engine "gloo", the project's worker extension (`worker_ext.WeightSyncExtension`): it
  joins the learner's sync group and receives weights over real gloo, or loads a version's
  files; only vLLM's model runner is replaced (a dict that can load slowly on purpose);
- the pieces of vLLM the route reuses: its request model (`CompletionRequest`: a body vLLM
  refuses is refused here by the same validation), `SamplingParams` (its own checks of n,
  temperature, top_p, ...), `get_max_tokens`, its JSON-request check, its exception handlers
  (the error body `{"error": {"message", "type", "param", "code"}}`) and output classes.

Modelled on vLLM 0.32's serving code (vllm/entrypoints/openai/completion/serving.py,
vllm/renderers/params.py and base.py, vllm/v1/engine/input_processor.py):
- POST /v1/completions, not streamed: `prompt` as token ids (one list, or a list of lists: one
  engine request per prompt, named "cmpl-<id>-<i>", choices numbered in prompt order) or as
  text (tokenized by the stand-in model); `model` must be the served name (404 otherwise);
  refused with 400 and vLLM's message: max_tokens over max_model_len, a prompt longer than
  max_model_len, a token id outside the vocabulary, an empty prompt. A prompt that fits but
  leaves fewer than max_tokens free gets fewer tokens ("length"), as vLLM clamps max_tokens.
  Each choice: index, text "" (no detokenizer), token_ids and prompt_token_ids (with
  return_token_ids), logprobs {text_offset, token_logprobs, tokens "token_id:N",
  top_logprobs} (with logprobs), finish_reason, stop_reason.
- POST /inference/v1/generate (the token-in/token-out route the learner's client uses),
  output_mode "tokens", not streamed: `token_ids`, `sampling_params` (vLLM's SamplingParams,
  max_tokens clamped as vLLM does), the same prompt refusals; each choice: index, token_ids,
  logprobs {content: [{token_id, logprob}]} (with sampling_params.logprobs), finish_reason.
- The EngineClient (`StandInEngineClient`): `generate` (an async generator of one final
  RequestOutput), `collective_rpc(method, timeout, args, kwargs)` (as vLLM's
  MultiprocExecutor: the worker runs calls one at a time in order, the caller reads the next
  reply off a queue without a call id, so a call that timed out leaves its reply for the next
  call; one result per worker, world size 1), `reset_prefix_cache`,
  `check_health` (raises EngineDeadError once `dead` is set), `model_config` (max_model_len,
  vocabulary size) and `vllm_config.parallel_config.world_size`.
- The model (`StandInEngine`): completion k of prompt p is [sum(p) % 15, k, 1, 1, ...] cut
  at max_tokens ("length") or after the first of the request's stop_token_ids ("stop"), each
  token with log-prob -0.5, after `delay_s` per request; with "gloo" the first token is a
  digest of the weights the worker holds, so servers' weights can be compared by samples.
- GET /metrics: a Prometheus registry mounted as vLLM mounts its own. A spawned stand-in,
  one server per process as vLLM, serves the process's default registry, where the plugin
  registers its series; in-process (`serve_in_process`, several servers in one process) each
  app gets a registry of its own, handed to the plugin in place of the default one.

Not modelled: streaming, chat and vLLM's other routes, vLLM's own --api-key middleware (on a
real server it guards /v1 with the same token the plugin checks), vLLM's /health (the plugin
replaces it), tokenizers and text output, EOS, sampling (the seed is recorded, not used), top
log-probs beyond the sampled token, scheduling limits (max_num_seqs), LoRA, an engine dying
mid-request.

Run as a script it serves one stand-in on the given port (`spawn_standin`), so a test can
SIGKILL a whole server process.
"""

# No `from __future__ import annotations`: FastAPI reads the route's annotations, which name
# classes imported inside `build_app`.
import argparse
import asyncio
import contextlib
import itertools
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

from gspo_api.ports import free_port

TOKEN = "s3cret"
REPO = Path(__file__).resolve().parents[3]
MODEL = "stand-in"  # the served model name: what /health names and requests give as "model"
MODEL_PATH = "/models/stand-in"  # vLLM's --model: what the engine loaded
STARTUP_TIMEOUT_S = 90.0  # a spawned stand-in imports vLLM's serving pieces (seconds of CPU)


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended it


class _PlainWorker:
    """The plain stand-in's one worker: an update 'receives' version 99 without a group; it
    joins no sync group and loads no files (a test that reaches those fails)."""

    def __init__(self, engine: "StandInEngine") -> None:
        self.engine = engine

    def gspo_receive_weights(self) -> dict[str, int]:
        self.engine.weights_loaded += 1
        return {"version": 99, "bytes": 0, "tensors": 0}

    def gspo_init_sync_group(self, **coords: Any) -> int:
        raise AssertionError("the plain stand-in joins no sync group: use engine 'gloo'")

    def gspo_load_weights_file(self, path: str) -> dict[str, int]:
        raise AssertionError("the plain stand-in loads no weight files: use engine 'gloo'")


ROUTE_REQUESTS = ("cmpl-", "generate-tokens-")  # request ids of /v1/completions, /inference/...


class StandInEngine:
    """Completion k of prompt p is [sum(p) % 15, k, 1, ...]; remembers every request."""

    max_model_len = 64
    vocab_size = 15

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        # (request id, prompt, vLLM SamplingParams) of every engine request, warm-up included.
        self.requests: list[tuple[str, list[int], Any]] = []
        self.weights_loaded = 0
        self.prefix_cache_resets = 0
        self.worker: Any = _PlainWorker(self)

    @property
    def seen(self) -> list[list[int]]:
        """The prompts the generation routes sent to the engine (vLLM names those requests
        cmpl-* and generate-tokens-*)."""
        return [prompt for rid, prompt, _ in self.requests if rid.startswith(ROUTE_REQUESTS)]

    @property
    def warm_ups(self) -> list[str]:
        """Ids of the engine requests that did not come from a generation route."""
        return [rid for rid, _, _ in self.requests if not rid.startswith(ROUTE_REQUESTS)]

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 15 for c in text]

    def head(self, prompt: list[int]) -> int:
        return sum(prompt) % 15

    async def output(self, prompt: list[int], params: Any, request_id: str) -> Any:
        """The engine's final output for one request: a vLLM RequestOutput holding the n
        samples (log-probs as vLLM gives them: the sampled token's, when asked for)."""
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        samples = await self.generate(prompt, params, request_id)
        with_logprobs = params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=k,
                text="",
                token_ids=s.token_ids,
                cumulative_logprob=sum(s.logprobs),
                logprobs=[
                    {t: Logprob(lp, rank=1)} for t, lp in zip(s.token_ids, s.logprobs, strict=True)
                ]
                if with_logprobs
                else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for k, s in enumerate(samples)
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=list(prompt),
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
        )

    async def generate(self, prompt: list[int], params: Any, request_id: str) -> list[Sample]:
        self.requests.append((request_id, list(prompt), params))
        await asyncio.sleep(self.delay_s)
        head = self.head(prompt)
        stops = set(params.stop_token_ids or ())
        samples = []
        for k in range(params.n):
            tokens = [head, k, *[1] * max(0, params.max_tokens - 2)][: params.max_tokens]
            finish, reason = "length", None
            for t, tok in enumerate(tokens):
                if tok in stops:
                    tokens, finish, reason = tokens[: t + 1], "stop", tok
                    break
            samples.append(Sample(tokens, [-0.5] * len(tokens), finish, reason))
        return samples


class _ModelRunner:
    """Where vLLM's model runner would load weights: a dict, loaded slowly on purpose."""

    def __init__(self, seconds_per_tensor: float) -> None:
        self.seconds_per_tensor = seconds_per_tensor
        self.weights: dict[str, Any] = {}

    def get_model(self) -> Any:
        import torch

        return torch.nn.Module()  # no layers: nothing for the extension to prepare

    def reload_weights(self, weights_iterator: Any) -> None:
        for name, tensor in weights_iterator:
            time.sleep(self.seconds_per_tensor)
            self.weights[name] = tensor.clone()


class GlooEngine(StandInEngine):
    """Its worker is the project's own worker extension: it joins the learner's sync group and
    receives weights over real gloo, or loads a version's files; only vLLM's model runner is
    replaced. Its samples start with a digest of the weights it holds."""

    def __init__(self, seconds_per_tensor: float = 0.0) -> None:
        super().__init__()
        import torch.distributed  # noqa: F401 - loaded at start-up, as in a vLLM worker

        from gspo_trainer.rollout.worker_ext import WeightSyncExtension

        class Worker(WeightSyncExtension):
            rank = 0
            model_runner = _ModelRunner(seconds_per_tensor)

        self.worker = Worker()

    def digest(self) -> int:
        weights = self.worker.model_runner.weights
        return int(sum(float(t.double().sum()) for t in weights.values())) % 15

    def head(self, prompt: list[int]) -> int:
        return self.digest()


class StandInEngineClient:
    """The part of vLLM's EngineClient that the plugin and the route use, over a stand-in
    engine with one worker."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine
        self.dead = False  # set: check_health raises, as vLLM's does once the engine died
        self.rpcs: list[str] = []  # collective_rpc method names, in order
        self._calls: queue.Queue[Any] | None = None  # the worker's call and reply queues
        self._replies: queue.Queue[Any] | None = None
        self.model_config = SimpleNamespace(
            max_model_len=engine.max_model_len, get_vocab_size=lambda: engine.vocab_size
        )
        self.vllm_config = SimpleNamespace(
            model_config=self.model_config, parallel_config=SimpleNamespace(world_size=1)
        )

    async def generate(
        self, prompt: dict[str, Any], sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """One final RequestOutput holding all n samples (the route's and warm-up's
        FINAL_ONLY output)."""
        yield await self.engine.output(
            list(prompt["prompt_token_ids"]), sampling_params, request_id
        )

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """As vLLM's MultiprocExecutor.collective_rpc: the worker runs calls one at a time, in
        order, and the caller reads the next reply off the worker's reply queue, without a
        call id; a call that times out leaves its reply there for the next call to read."""
        self.rpcs.append(method)
        if self._calls is None:
            self._calls, self._replies = queue.Queue(), queue.Queue()
            threading.Thread(target=self._serve_calls, daemon=True).start()
        self._calls.put((method, args, kwargs or {}))
        try:
            ok, result = await asyncio.to_thread(self._replies.get, True, timeout)
        except queue.Empty:
            raise TimeoutError(f"RPC call to {method} timed out.") from None
        if not ok:
            raise RuntimeError(
                f"Worker failed with error '{result}', please check the stack "
                "trace above for the root cause"
            )
        return [result]

    def _serve_calls(self) -> None:
        """The worker process's loop: each call in turn, its reply queued."""
        assert self._calls is not None and self._replies is not None
        while True:
            method, args, kwargs = self._calls.get()
            try:
                self._replies.put((True, getattr(self.engine.worker, method)(*args, **kwargs)))
            except Exception as exc:  # the worker reports it and serves the next call
                self._replies.put((False, exc))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.engine.prefix_cache_resets += 1
        return True

    async def check_health(self) -> None:
        if self.dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()


def plugin_env(
    initial_version: int | None = 0,
    token: str | None = TOKEN,
    weights_dir: Path | str | None = None,
) -> dict[str, str | None]:
    """The plugin's settings as a server's environment gives them (None: unset)."""
    from gspo_api import ports

    return {
        ports.ENV_JOB_TOKEN: token,
        ports.ENV_JOB_TOKEN_EARLIER: None,  # whatever this process has, the server reads token
        ports.ENV_INITIAL_VERSION: None if initial_version is None else str(initial_version),
        ports.ENV_WEIGHTS_DIR: None if weights_dir is None else str(weights_dir),
    }


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _prompts(prompt: Any, engine: StandInEngine) -> list[list[int]]:
    """The request's prompts as token ids (vLLM's renderer, without its tokenizer; the
    request model has already refused a missing prompt)."""
    from vllm.renderers.inputs.preprocess import prompt_to_seq

    return [engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompt_to_seq(prompt)]


def _check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """vLLM's checks of a token prompt: length (renderers/params.py), vocabulary
    (renderers/base.py), empty (v1/engine/input_processor.py); same messages."""
    from vllm.exceptions import VLLMValidationError

    if len(ids) > max_model_len:
        raise VLLMValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {len(ids)} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            parameter="input_tokens",
            value=len(ids),
        )
    if ids and min(ids) < 0:
        raise VLLMValidationError(f"Token id {min(ids)} is out of vocabulary", parameter="prompt")
    if ids and max(ids) > vocab_size - 1:
        raise VLLMValidationError(f"Token id {max(ids)} is out of vocabulary", parameter="prompt")
    if not ids:
        raise VLLMValidationError("The decoder prompt cannot be empty")


def _choice(index: int, out: Any, prompt_ids: list[int], request: Any) -> dict[str, Any]:
    logprobs = None
    if request.logprobs is not None:
        tokens = [f"token_id:{t}" for t in out.token_ids]
        offsets = list(itertools.accumulate((len(tok) for tok in tokens[:-1]), initial=0))
        token_logprobs = [
            max(step[t].logprob, -9999.0)
            for t, step in zip(out.token_ids, out.logprobs, strict=True)
        ]
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, token_logprobs, strict=True)],
        }
    ids = request.return_token_ids
    return {
        "index": index,
        "text": "",
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt_ids) if ids else None,
        "token_ids": list(out.token_ids) if ids else None,
    }


def build_app(
    engine: StandInEngine, env: dict[str, str | None] | None = None, registry: Any = None
) -> Any:
    """A stand-in server's FastAPI app: the plugin attached, its state initialized when the
    app starts (lifespan). `env`: the plugin's settings (`plugin_env`), set while it is
    constructed; None: as this process's environment has them. `registry`: the Prometheus
    registry the plugin registers in and /metrics serves; None: the process's default."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse
    from prometheus_client import REGISTRY, make_asgi_app
    from starlette.routing import Mount
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens, validate_json_request

    from gspo_trainer.rollout import vllm_plugin

    client = StandInEngineClient(engine)
    args = argparse.Namespace(model=MODEL_PATH, served_model_name=[MODEL], log_error_stack=False)
    with contextlib.ExitStack() as stack:
        if env is not None:
            stack.enter_context(_environ(env))
        if registry is not None:
            # The seam a second server in one process needs: its own registry.
            stack.enter_context(_patched(vllm_plugin, "_default_registry", lambda: registry))
        plugin = vllm_plugin.GSPOEndpoints()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await plugin.init_state(client, app.state, args)  # as vLLM's init_app_state does
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.args = args
    app.state.engine_client = client
    app.state.gspo_plugin = plugin

    def error(message: str, err_type: str, status: int, param: str | None = None) -> Any:
        body = create_error_response(message, err_type, HTTPStatus(status), param)
        return JSONResponse(body.model_dump(), status_code=status)

    @app.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        if request.stream:
            return error("the stand-in does not stream", "NotImplementedError", 501)
        if request.model and request.model != MODEL:
            return error(
                f"The model `{request.model}` does not exist. Valid aliases: {MODEL}.",
                "NotFoundError",
                404,
                "model",
            )
        max_model_len = engine.max_model_len
        request.build_tok_params(client.model_config)  # max_tokens over max_model_len: 400
        prompts = _prompts(request.prompt, engine)
        for ids in prompts:
            _check_prompt(ids, max_model_len, engine.vocab_size)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generators = []
        for i, ids in enumerate(prompts):
            max_tokens = get_max_tokens(
                max_model_len,
                request.max_tokens,
                len(ids),
                {},
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
            params = request.to_sampling_params(max_tokens, {})
            engine_input = {"prompt_token_ids": ids}
            generators.append(client.generate(engine_input, params, f"{request_id}-{i}"))

        async def final(generator: AsyncIterator[Any]) -> Any:
            outputs = [out async for out in generator]
            return outputs[-1]

        results = await asyncio.gather(*(final(g) for g in generators))
        choices: list[dict[str, Any]] = []
        for ids, result in zip(prompts, results, strict=True):
            for out in result.outputs:
                choices.append(_choice(len(choices), out, ids, request))
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion_tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    @app.post("/inference/v1/generate", dependencies=[Depends(validate_json_request)])
    async def generate_tokens(raw_request: Request) -> Any:
        """vLLM's token-in/token-out route (--enable-scale-out), output_mode "tokens", not
        streamed: `token_ids` and `sampling_params` as vLLM's SamplingParams takes them."""
        from vllm.sampling_params import SamplingParams

        body = await raw_request.json()
        if body.get("model") not in (None, MODEL):
            return error(
                f"The model `{body['model']}` does not exist. Valid aliases: {MODEL}.",
                "NotFoundError",
                404,
                "model",
            )
        ids = list(body.get("token_ids") or [])
        _check_prompt(ids, engine.max_model_len, engine.vocab_size)
        raw = dict(body.get("sampling_params") or {})
        max_tokens = get_max_tokens(engine.max_model_len, raw.pop("max_tokens", None), len(ids), {})
        params = SamplingParams(max_tokens=max_tokens, **raw)
        request_id = f"generate-tokens-{uuid.uuid4().hex}"
        outputs = [
            out async for out in client.generate({"prompt_token_ids": ids}, params, request_id)
        ]
        choices = []
        for k, out in enumerate(outputs[-1].outputs):
            content = None
            if params.logprobs is not None:
                steps = zip(out.token_ids, out.logprobs, strict=True)
                content = [
                    {"token_id": t, "logprob": max(step[t].logprob, -9999.0)} for t, step in steps
                ]
            choices.append(
                {
                    "index": k,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "token_ids": list(out.token_ids),
                    "logprobs": {"content": content},
                }
            )
        return JSONResponse(
            {"request_id": request_id, "model": MODEL, "output_mode": "tokens", "choices": choices}
        )

    metrics = Mount("/metrics", make_asgi_app(registry=registry or REGISTRY))
    metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as vLLM: no 307 to /metrics/
    app.routes.append(metrics)
    plugin.attach_router(app)  # after the core routes, as vLLM's build_app
    init_exception_handler(app)
    return app


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)  # AttributeError if the seam is gone: the stand-in must change
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _uvicorn_server(app: Any, port: int) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


class InProcessServer:
    """A stand-in app served by uvicorn on this event loop (for tests that need the engine
    object; `spawn_standin` for one that can be SIGKILLed)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server: Any = None
        self.task: asyncio.Task[None] | None = None
        self.url = ""

    @property
    def engine_client(self) -> StandInEngineClient:
        return self.app.state.engine_client

    async def start(self) -> str:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.server = _uvicorn_server(self.app, port)
        self.server.capture_signals = contextlib.nullcontext  # leave the test's signals alone
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if self.task.done():  # uvicorn exits when the app's start-up (lifespan) fails
                raise RuntimeError("the server stopped while starting: see its log above")
            if time.monotonic() > deadline:
                raise TimeoutError("the in-process stand-in did not start")
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.server.should_exit = True
            await self.task


async def serve_in_process(
    engine: StandInEngine,
    initial_version: int | None = 0,
    *,
    token: str | None = TOKEN,
    weights_dir: Path | None = None,
) -> tuple[InProcessServer, str]:
    """Serve a stand-in around `engine` in this process: (the server, its URL). Each gets its
    own Prometheus registry (several may run at once; a real server is a process of its own)."""
    from prometheus_client import CollectorRegistry

    env = plugin_env(initial_version, token, weights_dir)
    server = InProcessServer(build_app(engine, env, registry=CollectorRegistry()))
    return server, await server.start()


async def spawn_standin(
    delay_s: float,
    engine: str = "plain",
    initial_version: int | None = 0,
    port: int = 0,
    weights_dir: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start this file as a server process; return it and its URL once /health answers.

    engine "plain": StandInEngine(delay_s); "gloo": GlooEngine(delay_s per loaded tensor).
    initial_version None: the server starts unsynced. A given port restarts a server where
    one was, as a container restarted in its pod would.
    """
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'trainer'}:{REPO / 'operator'}"}
    for key, value in plugin_env(initial_version, TOKEN, weights_dir).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    args = [sys.executable, __file__, str(port), str(delay_s), engine]
    proc = subprocess.Popen(args, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    proc.kill()
    proc.wait(timeout=10)
    raise TimeoutError(
        f"stand-in server on {url} did not answer /health within "
        f"{STARTUP_TIMEOUT_S:.0f} s (exit status {proc.returncode})"
    )


def _main(argv: Sequence[str]) -> None:
    port, delay, kind = int(argv[0]), float(argv[1]), argv[2]
    engine = GlooEngine(delay) if kind == "gloo" else StandInEngine(delay)
    # The plugin reads its settings from this process's environment, as on a real server.
    _uvicorn_server(build_app(engine), port).run()


if __name__ == "__main__":
    _main(sys.argv[1:])
