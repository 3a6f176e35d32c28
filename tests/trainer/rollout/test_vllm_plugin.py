"""vLLM's own OpenAI server with our endpoint plugin and worker extension (CPU build, one
engine start): what the rollout server adds, seen through vLLM's routes.

The server is started from `serve_command` (the one place its command line is built, which
`gspo rollout-server` execs); weights arrive through the control routes and bucketed
broadcast the learner's client drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from rollout_standin import REPO, TOKEN, free_port
from server_env import SERVER_ENV
from test_vllm_e2e import (
    LOGPROB_ATOL,
    PROMPTS,
    SAMPLE,
    check_batch,
    hf_logprobs,
    max_logprob_gap,
)

from gspo_api import ports
from gspo_trainer.rollout.client import RequestRefused, RolloutClient, SyncOptions
from gspo_trainer.rollout.launch import command, parse_args
from gspo_trainer.tiny import build_tiny_model

pytestmark = pytest.mark.e2e

NAME = "builtin:tiny-qwen3"
PROMPT = [3, 4, 13, 5, 14]


def call(
    url: str, body: dict[str, Any] | None = None, token: str | None = TOKEN, timeout_s: float = 60
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of a GET (no body) or POST."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def complete(url: str, temperature: float = 0.7, **kw: Any) -> tuple[int, dict[str, str], Any]:
    body = {
        "model": NAME,
        "prompt": [PROMPT],
        "max_tokens": 8,
        "n": 2,
        "logprobs": 0,
        "return_token_ids": True,
        "temperature": temperature,
        "seed": 5,
    }
    return call(url + "/v1/completions", body, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One plugin server, started unsynced (no initial version), on the tiny dense model."""
    root = tmp_path_factory.mktemp("plugin")
    port = free_port()
    # What `gspo rollout-server` would exec: the builtin model built, CPU defaults, no chat
    # template in the tiny tokenizer so the plain one, the plugin and token in the env.
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    args = parse_args(["--model", NAME, "--host", "127.0.0.1", "--port", str(port),
                       "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "16",
                       "--cache-dir", str(root / "models"),
                       "--weights-dir", str(root / "weights")])  # fmt: skip
    environ = {
        **os.environ,
        ports.ENV_JOB_TOKEN: TOKEN,
        "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}",
        **SERVER_ENV,
    }
    argv, env = command(args, environ)
    assert "--chat-template" in argv and env["VLLM_API_KEY"] == TOKEN
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:  # stopped however the start ends: a server that never answered is not left running
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if call(url + "/health", token=None, timeout_s=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(log.read_text()[-3000:])
        yield url, root
    finally:  # the group: vLLM's engine core outlives a server that died alone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_server_serves_nothing_until_the_learner_syncs_it(server: Any) -> None:
    url, _ = server
    status, _, health = call(url + "/health", token=None)
    assert status == 200 and health["synced"] is False and health["policy_version"] is None
    assert call(url + "/ready", token=None)[0] == 503
    status, _, body = complete(url)
    assert status == 503 and "not synced" in body["error"]
    # vLLM's other generation routes wait for the weights too (Anthropic's, SageMaker's).
    messages = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "1"}]}
    for path, request in (
        ("/v1/messages", messages),
        ("/invocations", messages),
        ("/generative_scoring", {"model": NAME}),
    ):
        assert call(url + path, request)[0] == 503, path
    assert call(url + "/tokenize", {"model": NAME, "prompt": "1+2"})[0] == 200


def test_the_token_guards_every_route_but_the_probes_and_metrics(server: Any) -> None:
    url, _ = server
    tokenize = {"model": NAME, "prompt": "1+2"}
    for path, body in (
        ("/tokenize", tokenize),
        ("/v1/completions", {"model": NAME}),
        ("/control/pause", {}),
        ("/control/sync/update", {}),
    ):
        assert call(url + path, body, token=None)[0] == 401, path
        assert call(url + path, body, token="wrong")[0] == 401, path
    assert call(url + "/tokenize", tokenize)[0] == 200
    assert call(url + "/v1/models", token=None)[0] == 401
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    # vLLM's own series and ours, on vLLM's /metrics.
    assert "vllm:num_requests_waiting" in text and "gspo_rollout_policy_version" in text


def test_weights_from_the_learner_are_what_generates_and_each_response_names_its_version(
    server: Any,
) -> None:
    url, root = server
    model, _ = build_tiny_model(NAME)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.2 * torch.randn_like(p))

    async def sync(weights: Any, version: int, method: str = "broadcast") -> Any:
        opts = SyncOptions(
            master_addr="127.0.0.1",
            master_port=free_port(),
            timeout_s=120,
            method=method,
            directory=str(root / "weights"),
        )
        async with RolloutClient([url], TOKEN, sync=opts) as client:
            return await client.sync_weights(weights.named_parameters(), version=version)

    report = asyncio.run(sync(new, 3))
    assert report.servers == [url] and report.servers_failed == []
    assert call(url + "/ready", token=None)[2] == {"ready": True, "policy_version": 3}
    status, headers, body = complete(url)
    assert status == 200 and headers[ports.VERSION_HEADER] == "3"
    for choice in body["choices"]:
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        # Processed log-probs: the distribution after temperature, as the learner scores.
        assert (hf_logprobs(new, PROMPT, choice["token_ids"], 0.7) - got).abs().max() < LOGPROB_ATOL
        assert (hf_logprobs(model, PROMPT, choice["token_ids"], 0.7) - got).abs().max() > 0.05
    # The same through the shared volume (weightSync.method filesystem).
    report = asyncio.run(sync(model, 4, "filesystem"))
    assert report.servers == [url]
    status, headers, body = complete(url)
    assert headers[ports.VERSION_HEADER] == "4"
    got = torch.tensor(body["choices"][0]["logprobs"]["token_logprobs"])
    ids = body["choices"][0]["token_ids"]
    assert (hf_logprobs(model, PROMPT, ids, 0.7) - got).abs().max() < LOGPROB_ATOL


def test_the_learners_client_generates_through_vllms_generate_route(server: Any) -> None:
    """The client sees the plugin in /health (the served model's name) and samples through
    /inference/v1/generate: one request per prompt with its own seed, each completion
    carrying the version the header names; a prompt the model cannot hold is refused by
    index."""
    url, _ = server
    model, _ = build_tiny_model(NAME)  # what the filesystem sync above loaded, as version 4

    async def run() -> tuple[Any, Any, Any]:
        async with RolloutClient([url], TOKEN, timeout_s=120) as client:
            batch = await client.generate(PROMPTS, SAMPLE)
            again = await client.generate(PROMPTS, SAMPLE)
            too_long = [PROMPTS[0], [3] * 200, PROMPTS[1]]
            with pytest.raises(RequestRefused) as refused:
                await client.generate(too_long, SAMPLE)
            after = await client.generate(PROMPTS[:1], SAMPLE)  # no server was benched
            return batch, again, (refused.value, after)

    batch, again, (refused, after) = asyncio.run(run())
    check_batch(batch, SAMPLE, version=4)
    assert max_logprob_gap(model, batch) < LOGPROB_ATOL
    # Seeded: the same batch again is the same samples; prompts do not share one stream.
    assert [[c.token_ids for c in g] for g in again.groups] == [
        [c.token_ids for c in g] for g in batch.groups
    ]
    assert refused.prompt_index == 1 and "128" in str(refused)
    assert after.groups[0][0].policy_version == 4 and not after.servers_failed


BAD_GENERATIONS = {
    "a negative token id": {"token_ids": [3, -1]},
    "a token id past the vocabulary": {"token_ids": [3, 10**6]},
    "no prompt": {"token_ids": []},
    "more samples than the server runs at once": {"sampling_params": {"n": 17}},
    "a negative temperature": {"sampling_params": {"temperature": -1.0}},
    "a prompt that is not token ids": {"token_ids": "1+2="},
}


def test_bad_generation_requests_are_refused_and_leave_nothing_held(server: Any) -> None:
    """Each bad body gets vLLM's 4xx with a message, stamped with the version like any
    generation; none stays admitted (a leak would hang the next sync's drain) and the server
    answers the next good request."""
    url = server[0] + "/inference/v1/generate"
    good = {
        "model": NAME,
        "token_ids": PROMPT,
        "output_mode": "tokens",
        "sampling_params": {"n": 1, "max_tokens": 4, "logprobs": 0},
    }
    for what, change in BAD_GENERATIONS.items():
        body = {**good, **change}
        if "sampling_params" in change:
            body["sampling_params"] = {**good["sampling_params"], **change["sampling_params"]}
        status, headers, reply = call(url, body)
        assert status in (400, 422), (what, status, reply)
        assert reply["error"] if "error" in reply else reply["detail"], what
        assert headers.get(ports.VERSION_HEADER) == "4", what
    status, _, health = call(server[0] + "/health", token=None)
    assert status == 200 and health["active_requests"] == 0 and health["paused"] is False
    status, headers, reply = call(url, good)
    assert status == 200 and len(reply["choices"]) == 1
    assert headers[ports.VERSION_HEADER] == "4"


def test_anyone_with_the_token_can_chat_with_the_live_policy(server: Any) -> None:
    url, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4}
    assert call(url + "/v1/chat/completions", body, token=None)[0] == 401
    status, headers, reply = call(url + "/v1/chat/completions", body)
    assert status == 200 and headers[ports.VERSION_HEADER] == "4"
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_a_paused_server_holds_generations_until_it_resumes(server: Any) -> None:
    url, _ = server
    if call(url + "/ready", token=None)[0] != 200:
        pytest.skip("needs the sync test's weights")
    assert call(url + "/control/pause", {"timeout_s": 30})[0] == 200
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(complete(url)))
    worker.start()
    worker.join(timeout=2.0)
    assert worker.is_alive() and not result  # held at the gate, not refused
    assert call(url + "/control/resume", {})[0] == 200
    worker.join(timeout=60)
    status, headers, _ = result[0]
    assert status == 200 and ports.VERSION_HEADER in headers
    # A control body that is not JSON is refused with the reason, not a server error.
    req = urllib.request.Request(
        url + "/control/pause",
        b"{nope",
        method="POST",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "not JSON" in json.loads(err.value.read())["error"]
