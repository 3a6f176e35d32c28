"""reward.sandbox.mode service: the same sandbox behind HTTP with the job's token; a service
that is down or refuses the token is a counted sandbox failure, never a wrong answer. (The
hostile programs run through it in test_code_sandbox_hostile.py.)"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from gspo_api.ports import ENV_JOB_TOKEN, ENV_SANDBOX_URL
from gspo_api.spec import CodeConfig, SandboxConfig
from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.code import service as service_module
from gspo_trainer.code.runner import CodeRunner, CodeScorer, build_code_scorer, wait_for_service
from gspo_trainer.code.sandbox import SETUP_SECONDS, LocalSandbox, RunResult
from gspo_trainer.code.service import RemoteSandbox, request_timeout, serve_sandbox
from gspo_trainer.reward_types import Scored

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
    monkeypatch.setenv(ENV_JOB_TOKEN, TOKEN)
    scorer = build_code_scorer(CodeConfig(), cfg)
    assert scorer.score([item("a, b = map(int, input().split())\nprint(a + b)")]) == [1.0]
    monkeypatch.setenv(ENV_JOB_TOKEN, "stale")
    with pytest.raises(ValueError, match=r"serviceUrl .* answered 401"):
        build_code_scorer(CodeConfig(), cfg)


BASE = {"model": {"name": "builtin:tiny-qwen3"}, "data": {"source": "builtin:addition"}}


@pytest.mark.parametrize(
    ("sandbox", "field", "says"),
    [
        ({"serviceUrl": "http://x:1"}, "serviceUrl", "only read when reward.sandbox.mode is"),
        ({"replicas": 2}, "replicas", "only read when reward.sandbox.mode is service"),
        ({"runtimeClassName": "gvisor"}, "runtimeClassName", "only read when"),
        (
            {"mode": "service", "serviceUrl": "http://x:1", "resources": {}},
            "resources",
            "not read when serviceUrl names your own sandbox service",
        ),
        ({"mode": "service", "runtimeClassName": "Not_A_Name"}, "runtimeClassName", "match"),
        ({"mode": "service", "replicas": 11}, "replicas", "10"),
        (
            {
                "mode": "service",
                "isolation": "none",
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            },
            "resources.limits[nvidia.com/gpu]",
            "get no GPU",
        ),
    ],
)
def test_sandbox_pod_settings_are_refused_where_no_sandbox_pods_run(sandbox, field, says) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "reward": {"kind": "code", "sandbox": sandbox}})
    (problem,) = err.value.problems
    assert problem.path == f"spec.reward.sandbox.{field}" and says in problem.message, problem


def test_the_operators_sandbox_pods_need_a_runtime_class_for_namespaces() -> None:
    """Under the node's default seccomp profile and no capabilities, the operator's pods
    cannot create namespaces (containerd's contrib/seccomp/seccomp_default.go allows unshare
    and namespace-creating clone only with CAP_SYS_ADMIN): refused at validation, naming
    runtimeClassName and the explicit way out, not every sandbox pod failing on the cluster."""
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "reward": {"kind": "code", "sandbox": {"mode": "service"}}})
    (problem,) = err.value.problems
    assert problem.path == "spec.reward.sandbox.runtimeClassName"
    assert "seccomp" in problem.message and "isolation: none" in problem.message
    for ok in ({"runtimeClassName": "gvisor"}, {"isolation": "none"}, {"serviceUrl": "http://s"}):
        parse_spec({**BASE, "reward": {"kind": "code", "sandbox": {"mode": "service", **ok}}})


def test_a_sandbox_server_refused_its_isolation_exits_2_saying_why(monkeypatch, capsys) -> None:
    """Exit 2, which the sandbox Job's podFailurePolicy fails at once on (tests/operator)."""
    from gspo_trainer.code import service

    monkeypatch.setattr(
        LocalSandbox, "probe_run", lambda self: ("unshare: Operation not permitted", False)
    )
    monkeypatch.setattr(service, "undumpable", lambda: None)  # not this test process
    monkeypatch.setattr(service.signal, "signal", lambda *a: None)
    with tempfile.NamedTemporaryFile("w", suffix=".sha256") as f:
        f.write("0" * 64)
        f.flush()
        with pytest.raises(SystemExit) as exit_:
            service.main(["--port=0", f"--token-sha256-file={f.name}"])
    assert exit_.value.code == 2
    assert "cannot run a program here: unshare: Operation not permitted" in capsys.readouterr().err


def test_mode_service_is_read_only_with_a_code_reward() -> None:
    with pytest.raises(SpecError, match=r"reward.sandbox.mode: is only read when a code reward"):
        parse_spec({**BASE, "reward": {"kind": "math", "sandbox": {"mode": "service"}}})
    pods = {"mode": "service", "replicas": 3, "runtimeClassName": "gvisor"}
    spec = parse_spec({**BASE, "reward": {"kind": "code", "sandbox": pods}})
    assert spec.reward.sandbox.replicas == 3  # the operator runs them (tests/operator)


def test_mode_service_with_no_url_and_no_cluster_names_the_field(monkeypatch) -> None:
    """Under gspo train no operator runs sandbox pods: the preflight names serviceUrl."""
    from gspo_trainer.code.preflight import check_code_reward

    monkeypatch.delenv(ENV_SANDBOX_URL, raising=False)
    sandbox = {"mode": "service", "runtimeClassName": "gvisor"}
    spec = parse_spec({**BASE, "reward": {"kind": "code", "sandbox": sandbox}})
    ((field, message),) = check_code_reward(spec)
    assert field == "spec.reward.sandbox.serviceUrl"
    assert message.startswith("must be set when reward.sandbox.mode is service and no operator")
    assert "gspo train" in message and "mode: local" in message


def test_the_learner_finds_the_jobs_sandbox_pods_in_its_env(service, monkeypatch) -> None:
    """On a cluster the operator puts the sandbox Service's URL in the learner's env; the
    learner sends concurrency x replicas test cases at once (each pod runs concurrency)."""
    monkeypatch.setenv(ENV_SANDBOX_URL, service)
    monkeypatch.setenv(ENV_JOB_TOKEN, TOKEN)
    cfg = SandboxConfig(mode="service", replicas=3, concurrency=2)
    scorer = build_code_scorer(CodeConfig(), cfg)
    assert scorer.concurrency == 6
    assert scorer.score([item("a, b = map(int, input().split())\nprint(a + b)")]) == [1.0]


class FlakyStart:
    """A sandbox service that answers only from its `up_at`-th probe on (a pod starting)."""

    def __init__(self, up_at: int) -> None:
        self.up_at, self.calls = up_at, 0

    def run(self, files, argv, stdin=b"", env=None) -> RunResult:
        self.calls += 1
        if self.calls < self.up_at:
            return RunResult(None, b"", b"", 0.0, failure=f"unreachable ({self.calls})")
        return RunResult(0, b"ok\n", b"", 0.01)


def test_the_learner_waits_for_the_sandbox_pods_to_start_then_names_why() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    flaky = FlakyStart(up_at=4)
    assert wait_for_service(flaky, 600, clock=lambda: now[0], sleep=sleep) is None
    assert flaky.calls == 4 and sum(slept) == 6.0
    never = FlakyStart(up_at=10**6)
    now[0] = 0.0
    why = wait_for_service(never, 10, clock=lambda: now[0], sleep=sleep)
    assert why is not None and why.startswith("unreachable") and now[0] >= 10
    once = FlakyStart(up_at=2)
    assert wait_for_service(once, 0, clock=lambda: now[0], sleep=sleep) == "unreachable (1)"


def test_a_service_holding_the_tokens_sha256_accepts_the_token_alone() -> None:
    """What the operator's sandbox pods hold: a program that reads it has no usable token."""
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    server = serve_sandbox(LocalSandbox(LIMITS), digest, "127.0.0.1", 0, hashed=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        program = item("a, b = map(int, input().split())\nprint(a + b)")
        assert scorer_for(url, TOKEN).score([program]) == [1.0]
        for wrong in (digest, "", "not-the-token"):
            scores, stats = scorer_for(url, wrong).score_components([program])
            assert scores == [0.0] and stats["code_tests/sandbox_failure"] == 1, wrong
    finally:
        server.shutdown()
        server.server_close()


def test_sandbox_pods_that_never_answer_stop_the_learner_naming_them(monkeypatch) -> None:
    """The learner's preflight does not wait for the job's sandbox pods (it runs before the
    learner's status server serves, and Kueue's WaitForPodsReady would evict a pod not Ready);
    the learner waits for them afterwards, and pods that never answer are a retryable
    SandboxUnavailable (exit 1) naming where to look, not a configuration error (exit 2)."""
    from gspo_api import ports
    from gspo_trainer.code import runner
    from gspo_trainer.code.preflight import check_code_reward

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{free.getsockname()[1]}"
    monkeypatch.setenv(ENV_SANDBOX_URL, down)
    monkeypatch.setenv(ports.ENV_JOB_NAME, "exp")
    waits: list[float] = []
    monkeypatch.setattr(runner, "wait_for_service", lambda remote, s: waits.append(s) or "down")
    sandbox = {"mode": "service", "runtimeClassName": "gvisor"}
    spec = parse_spec({**BASE, "reward": {"kind": "code", "sandbox": sandbox}})
    problems = check_code_reward(spec)  # builtin:addition has no tests: that one only
    assert [f for f, _ in problems] == ["spec.data.source"] and waits == []
    with pytest.raises(runner.SandboxUnavailable) as err:
        build_code_scorer(CodeConfig(), spec.reward.sandbox)
    assert waits == [ports.SANDBOX_STARTUP_SECONDS]
    assert not isinstance(err.value, ValueError)  # ValueError is the spec's: exit 2
    message = str(err.value)
    assert message.startswith(f"reward.sandbox.mode service: the job's sandbox pods at {down}")
    assert "gspo.dev/job-name=exp,gspo.dev/role=sandbox" in message


class Gate:
    """A sandbox whose programs run until the test lets them go; counts those running."""

    def __init__(self) -> None:
        self.running, self.most, self.runs = 0, 0, 0
        self.lock, self.entered, self.release = (
            threading.Lock(),
            threading.Event(),
            threading.Event(),
        )

    def run(self, files, argv, stdin=b"", env=None) -> RunResult:
        with self.lock:
            self.running += 1
            self.runs += 1
            self.most = max(self.most, self.running)
        self.entered.set()
        self.release.wait(30)
        with self.lock:
            self.running -= 1
        return RunResult(0, b"ok\n", b"", 0.01)


def test_a_sandbox_pod_runs_at_most_concurrency_programs_at_once() -> None:
    """More requests than reward.sandbox.concurrency (the Service spreads them unevenly) wait
    for a slot rather than running beside the others past the pod's memory."""
    gate = Gate()
    server = serve_sandbox(gate, TOKEN, "127.0.0.1", 0, concurrency=2, queue_seconds=30)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    remote = RemoteSandbox(f"http://127.0.0.1:{server.server_address[1]}", TOKEN, 30)
    results: list[RunResult] = []
    callers = [
        threading.Thread(target=lambda: results.append(remote.run({}, ["x"]))) for _ in range(5)
    ]
    try:
        for t in callers:
            t.start()
        assert gate.entered.wait(10)
        deadline = time.monotonic() + 0.3  # time for the other requests to arrive
        while time.monotonic() < deadline and gate.running < 5:
            time.sleep(0.01)
        assert gate.running == 2
        gate.release.set()
        for t in callers:
            t.join(30)
        assert gate.most == 2 and [r.exit_code for r in results] == [0] * 5
    finally:
        gate.release.set()
        server.shutdown()
        server.server_close()


def test_the_learner_sends_test_cases_past_any_proxy_its_environment_names(
    service, monkeypatch
) -> None:
    """A proxy env var (inherited by the learner) must not receive the job's bearer token."""
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(8)
        proxy.setblocking(False)
        at = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
            monkeypatch.setenv(var, at)
        for var in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
        program = item("a, b = map(int, input().split())\nprint(a + b)")
        assert scorer_for(service, TOKEN).score([program]) == [1.0]
        with pytest.raises(BlockingIOError):
            proxy.accept()  # nothing connected to the proxy


def test_a_request_that_finds_no_slot_in_time_gets_503_and_its_program_never_runs() -> None:
    """The client gives up after request_timeout; a program queued longer than the server's
    wait would run for nobody and hold a slot from live requests."""
    gate = Gate()
    server = serve_sandbox(gate, TOKEN, "127.0.0.1", 0, concurrency=1, queue_seconds=0.3)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    remote = RemoteSandbox(f"http://127.0.0.1:{server.server_address[1]}", TOKEN, 30)
    first: list[RunResult] = []
    holder = threading.Thread(target=lambda: first.append(remote.run({}, ["x"])))
    try:
        holder.start()
        assert gate.entered.wait(10)
        queued = remote.run({}, ["y"])
        assert queued.failure and "503" in queued.failure, queued
        gate.release.set()
        holder.join(30)
        assert first[0].exit_code == 0 and gate.runs == 1
    finally:
        gate.release.set()
        server.shutdown()
        server.server_close()


def test_the_learner_waits_for_a_slot_and_a_run_before_giving_up() -> None:
    cfg = SandboxConfig(timeout_seconds=4)
    assert request_timeout(cfg) > 2 * (SETUP_SECONDS + cfg.timeout_seconds)


def test_the_sandbox_server_is_undumpable_and_retries_a_probe_that_only_ran_late(
    monkeypatch, tmp_path
) -> None:
    """Its process holds the job's token (every /run carries it): a program run as its user
    with isolation none must not ptrace it. A probe that ran out of time exits 1 (the Job
    retries); one the isolation refused exits 2 (the pod failure policy fails it at once)."""
    script = (
        "import ctypes; from gspo_trainer.code.service import undumpable; undumpable(); "
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"  # PR_GET_DUMPABLE
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == "0", out.stderr
    token = tmp_path / "token"
    token.write_text(TOKEN)
    calls: list[str] = []
    monkeypatch.setattr(service_module, "undumpable", lambda: calls.append("undumpable"))
    monkeypatch.setattr(service_module.signal, "signal", lambda *a: calls.append("signal"))
    for passing, code in [(True, 1), (False, 2)]:
        monkeypatch.setattr(LocalSandbox, "probe_run", lambda _s, p=passing: ("refused", p))
        with pytest.raises(SystemExit) as exit_:
            service_module.main(["--token-file", str(token), "--sandbox", '{"isolation": "none"}'])
        assert exit_.value.code == code
    assert calls[:2] == ["undumpable", "signal"]
