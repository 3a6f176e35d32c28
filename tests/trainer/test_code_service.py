"""reward.sandbox.mode service: the same sandbox behind HTTP with the job's token; a service
that is down or refuses the token is a counted sandbox failure, never a wrong answer. (The
hostile programs run through it in test_code_sandbox_hostile.py.)"""

from __future__ import annotations

import socket
import threading

import pytest

from gspo_trainer.code.runner import CodeRunner, CodeScorer, build_code_scorer
from gspo_trainer.code.sandbox import LocalSandbox
from gspo_trainer.code.service import RemoteSandbox, serve_sandbox
from gspo_trainer.config import CodeConfig, SandboxConfig
from gspo_trainer.ports import ENV_SYNC_TOKEN
from gspo_trainer.rewards import Scored
from gspo_trainer.validation import SpecError, parse_spec

TOKEN = "job-token-abc"
ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}]}
LIMITS = SandboxConfig(timeout_seconds=1, memory_mib=256, output_bytes=1 << 16)


@pytest.fixture
def service():
    server = serve_sandbox(LocalSandbox(LIMITS), TOKEN, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def scorer_for(url: str, token: str) -> CodeScorer:
    return CodeScorer(CodeRunner(RemoteSandbox(url, token, timeout_s=10), CodeConfig()), 2)


def item(program: str) -> Scored:
    return Scored("p", program, "", True, row=ADD)


def test_a_wrong_token_or_a_service_that_is_down_is_a_sandbox_failure(service) -> None:
    refused = scorer_for(service, "not-the-token")
    scores, stats = refused.score_components([item("print(5)")])
    assert scores == [0.0] and stats["code_tests/sandbox_failure"] == 1
    assert refused.failures["error"] == 1
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{free.getsockname()[1]}"
    scores, stats = scorer_for(down, TOKEN).score_components([item("print(5)")])
    assert scores == [0.0] and stats["code_tests/sandbox_failure"] == 1
    assert stats["code_tests/wrong_answer"] == 0


def test_mode_service_probes_the_service_with_the_jobs_token(service, monkeypatch) -> None:
    cfg = SandboxConfig(mode="service", service_url=service)
    monkeypatch.setenv(ENV_SYNC_TOKEN, TOKEN)
    scorer = build_code_scorer(CodeConfig(), cfg)
    assert scorer.score([item("a, b = map(int, input().split())\nprint(a + b)")]) == [1.0]
    monkeypatch.setenv(ENV_SYNC_TOKEN, "stale")
    with pytest.raises(ValueError, match=r"serviceUrl .* answered 401"):
        build_code_scorer(CodeConfig(), cfg)


def test_service_url_goes_with_mode_service() -> None:
    base = {"model": {"name": "builtin:tiny-qwen3"}, "data": {"source": "builtin:addition"}}
    for sandbox, says in (({"mode": "service"}, "must be set"),
                          ({"serviceUrl": "http://x:1"}, "only read")):  # fmt: skip
        with pytest.raises(SpecError, match=says):
            parse_spec({**base, "reward": {"kind": "code", "sandbox": sandbox}})
