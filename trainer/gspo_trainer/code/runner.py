"""reward.kind code: each response's program run against its row's tests, in the sandbox.

Score = the share of test cases passed (reward.code.scoring fraction) or 1 only when all pass
(all). Every test case run ends in one outcome, counted under one name everywhere (history
key code_tests/<outcome>, Prometheus gspo_code_tests_total{outcome}):

    passed          the output matched (stdin/stdout) or every assert held
    wrong_answer    the output differed, an assert failed, or the program exited early
    timeout         past reward.sandbox.timeoutSeconds of wall clock or CPU
    memory          past reward.sandbox.memoryMiB (a MemoryError)
    runtime_error   raised, crashed, or wrote past outputBytes or fileBytes
    compile_error   not valid Python
    sandbox_failure the sandbox could not run it, or the row's tests are unreadable: the
                    reward's fault, not the program's; also counted in
                    gspo_reward_failures_total{reason="error"} and logged

Test cases of every response in a batch run at once, up to reward.sandbox.concurrency.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from gspo_api.spec import CodeConfig, SandboxConfig
from gspo_trainer.code.sandbox import LocalSandbox, RunResult
from gspo_trainer.code.tasks import (
    BadTests,
    Case,
    CodeTask,
    extract_program,
    outputs_match,
    task_from_row,
)
from gspo_trainer.metrics import CODE_TESTS_PREFIX
from gspo_trainer.reward_types import BatchOutcome

log = logging.getLogger("gspo.rewards.code")

Outcome = Literal[
    "passed",
    "wrong_answer",
    "timeout",
    "memory",
    "runtime_error",
    "compile_error",
    "sandbox_failure",
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)  # == metrics.CODE_OUTCOMES (tested)
OUTCOME_KEY = CODE_TESTS_PREFIX  # history key code_tests/<outcome>: a count per step
PASS_RATE_KEY = "code_pass_rate"  # share of responses that passed every test case

# harness.py's exit codes, and the signals the limits send (shell-style 128 + signal).
COMPILE_ERROR, MEMORY_ERROR, ASSERTION_FAILED = 96, 97, 98
SIGKILL_EXIT, SIGXCPU_EXIT = 128 + 9, 128 + 24
PROGRAM, TEST, DONE = "program.py", "test.py", "done"
HARNESS = "harness.py"


class Sandbox(Protocol):
    """Where programs run: LocalSandbox here; the interface leaves room for a remote one."""

    def run(
        self,
        files: dict[str, str],
        argv: list[str],
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
    ) -> RunResult: ...


@dataclass(frozen=True)
class CaseResult:
    outcome: Outcome
    detail: str = ""


def _harness_source() -> str:
    from pathlib import Path

    return Path(__file__).with_name(HARNESS).read_text(encoding="utf-8")


@dataclass
class CodeRunner:
    """Runs one program against one test case of a task (Python)."""

    sandbox: Sandbox
    cfg: CodeConfig
    harness: str = field(default_factory=_harness_source)

    def run_case(self, program: str, task: CodeTask, case: Case | None) -> CaseResult:
        files = {PROGRAM: program, HARNESS: self.harness}
        argv = ["{python}", "-I", "-S", HARNESS, PROGRAM]
        token = ""
        if case is None:  # assert-style: the harness prints the token once the tests held
            token = secrets.token_hex(16)
            files[TEST], files[DONE] = task.test or "", token
            argv += [TEST, task.entry_point or "", DONE]
        result = self.sandbox.run(files, argv, case.input.encode() if case else b"")
        outcome = classify(result)
        if outcome != "passed":
            return CaseResult(
                outcome, result.failure or result.stderr[-500:].decode(errors="replace")
            )
        out = result.stdout.decode(errors="replace")
        if case is None:
            ok = out.rstrip().endswith(token)
        else:
            ok = outputs_match(out, case.output, self.cfg.float_tolerance)
        return CaseResult("passed" if ok else "wrong_answer")


def classify(result: RunResult) -> Outcome:
    """The outcome of a run from how it ended ("passed" here means: exited cleanly; the
    output is judged by the caller)."""
    if result.failure is not None:
        return "sandbox_failure"
    if result.timed_out:
        return "timeout"
    if result.output_capped:  # killed for it: before the exit code
        return "runtime_error"
    if result.exit_code in (SIGXCPU_EXIT, SIGKILL_EXIT):  # the CPU limit's soft, then hard
        return "timeout"
    by_exit_code: dict[int, Outcome] = {
        0: "passed",
        COMPILE_ERROR: "compile_error",
        MEMORY_ERROR: "memory",
        ASSERTION_FAILED: "wrong_answer",
    }
    return by_exit_code.get(result.exit_code or 0, "runtime_error")


@dataclass
class CodeScorer:
    """The code reward over a batch (same interface as rewards.RewardScorer)."""

    runner: CodeRunner
    concurrency: int = 4
    scoring: str = "fraction"
    on_failure: Callable[[str], None] | None = None
    failures: dict[str, int] = field(default_factory=lambda: {"error": 0, "timeout": 0})
    counts: Counter[str] = field(default_factory=Counter)  # since the scorer was made
    # The latest batch as rewards.RewardScorer reports it (reward.maxFailedSteps reads it): a
    # response fails when any of its cases is a sandbox failure.
    last: BatchOutcome = field(default_factory=BatchOutcome)

    def score(self, items: Sequence[Any]) -> list[float]:
        return self.score_components(items)[0]

    def score_components(self, items: Sequence[Any]) -> tuple[list[float], dict[str, float]]:
        """Each item's score, and the batch's code_pass_rate and code_tests/<outcome>."""
        self.last = BatchOutcome(calls=len(items))
        work: list[tuple[int, str, CodeTask, list[Case | None]]] = []
        results: dict[int, list[CaseResult]] = {i: [] for i in range(len(items))}
        for i, item in enumerate(items):
            try:
                task = task_from_row(getattr(item, "row", None), self.runner.cfg)
            except BadTests as exc:
                results[i].append(CaseResult("sandbox_failure", f"unusable tests: {exc}"))
                continue
            program = extract_program(item.completion, self.runner.cfg.extract)
            cases: list[Case | None] = list(task.cases) if task.test is None else [None]
            work.append((i, program, task, cases))
        self._run_all(work, results)
        scores, batch = [], Counter({outcome: 0 for outcome in OUTCOMES})
        for i in range(len(items)):
            outcomes = [r.outcome for r in results[i]]
            batch.update(outcomes)
            passed = outcomes.count("passed")
            full = passed == len(outcomes) > 0
            scores.append(float(full) if self.scoring == "all" else passed / max(1, len(outcomes)))
            failures = [r for r in results[i] if r.outcome == "sandbox_failure"]
            if failures:
                self._fail(i, failures[0].detail)
        self.counts.update(batch)
        stats = {OUTCOME_KEY + o: float(batch[o]) for o in OUTCOMES}
        full_marks = sum(
            1
            for i in range(len(items))
            if results[i] and all(r.outcome == "passed" for r in results[i])
        )
        stats[PASS_RATE_KEY] = full_marks / max(1, len(items))
        return scores, stats

    def _run_all(
        self,
        work: list[tuple[int, str, CodeTask, list[Case | None]]],
        results: dict[int, list[CaseResult]],
    ) -> None:
        """Every case of every program, `concurrency` at once. Each program's first case runs
        first: a program that does not compile counts compile_error for all its cases
        without running the others (early in training, most responses do not compile)."""
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="gspo-code") as pool:
            pending: dict[Future[CaseResult], tuple[int, str, CodeTask, list[Case | None]]] = {}

            def start(i: int, program: str, task: CodeTask, cases: list[Case | None]) -> None:
                future = pool.submit(self.runner.run_case, program, task, cases[0])
                pending[future] = (i, program, task, cases[1:])

            for job in work:
                start(*job)
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    i, program, task, rest = pending.pop(future)
                    result = future.result()
                    results[i].append(result)
                    if result.outcome == "compile_error":
                        results[i] += [result] * len(rest)
                    else:
                        for case in rest:
                            start(i, program, task, [case])

    def _fail(self, i: int, detail: str) -> None:
        self.failures["error"] += 1
        self.last.failed["error"] += 1
        self.last.first = self.last.first or f"item {i}: {detail}"
        if self.on_failure is not None:
            self.on_failure("error")
        log.warning("Code reward for item %d: sandbox failure (%s); scored 0", i, detail)


class SandboxUnavailable(RuntimeError):
    """The job's own sandbox pods did not answer within ports.SANDBOX_STARTUP_SECONDS: a
    state of the cluster (pods Pending, or failing at start), not of the spec, so the
    learner exits 1 and JobSet may retry, where a configuration error (exit 2) is final."""


def build_code_scorer(
    code: CodeConfig,
    sandbox: SandboxConfig,
    on_failure: Callable[[str], None] | None = None,
    *,
    wait: bool = True,
) -> CodeScorer:
    """The scorer for reward.kind code. Refuses to start when reward.sandbox.isolation asks
    for namespaces and this machine forbids them (naming the setting), or when the sandbox
    service (mode service) cannot run a program; warns loudly when isolation is off. With
    `wait` False (the learner's preflight, before its status server serves) the job's own
    sandbox pods are not waited for: the learner does that once its pod reports Ready."""
    if sandbox.mode == "service":
        return _service_scorer(code, sandbox, on_failure, wait)
    local = LocalSandbox(sandbox)
    why = local.probe()
    if why is not None:
        fix = (
            "allow unprivileged user namespaces (kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0, a seccomp profile that permits unshare), or set "
            "reward.sandbox.isolation: none to run model-written programs without isolation"
            if sandbox.isolation == "namespaces"
            else "check that the learner can start processes"
        )
        raise ValueError(
            f"reward.sandbox.isolation {sandbox.isolation}: a program cannot run here ({why}); "
            f"{fix}"
        )
    if sandbox.isolation == "none":
        log.warning(
            "reward.sandbox.isolation is none: model-written programs run with only "
            "resource limits; they can read what the learner can, reach the network, and "
            "signal or trace the learner (docs/rewards.md, 'What holds where')"
        )
    return CodeScorer(CodeRunner(local, code), sandbox.concurrency, code.scoring, on_failure)


def _service_scorer(
    code: CodeConfig,
    sandbox: SandboxConfig,
    on_failure: Callable[[str], None] | None,
    wait: bool,
) -> CodeScorer:
    """mode service: the same runner, its programs sent to the service with the job's token:
    the one at serviceUrl, or the job's own sandbox pods (the operator's Service, named in
    $GSPO_SANDBOX_URL), which start with the learner and are waited for."""
    import os

    from gspo_api.ports import (
        ENV_JOB_NAME,
        ENV_SANDBOX_URL,
        SANDBOX_STARTUP_SECONDS,
        job_token,
    )
    from gspo_trainer.code.service import RemoteSandbox, request_timeout

    url, wait_s, pods = sandbox.service_url, 0.0, 1
    if url is None:
        url = os.environ.get(ENV_SANDBOX_URL)
        wait_s, pods = SANDBOX_STARTUP_SECONDS, sandbox.replicas or 1
    if not url:
        raise ValueError(
            "reward.sandbox.serviceUrl: must be set when reward.sandbox.mode is service and no "
            "operator runs the job's sandbox pods (as under gspo train): the URL of a sandbox "
            "service you run (gspo sandbox-server), or use mode: local"
        )
    remote = RemoteSandbox(url, job_token(os.environ) or "", timeout_s=request_timeout(sandbox))
    concurrency = sandbox.concurrency * pods  # each pod runs `concurrency` at once
    if sandbox.service_url is None and not wait:
        return CodeScorer(CodeRunner(remote, code), concurrency, code.scoring, on_failure)
    why = wait_for_service(remote, wait_s)
    if why is not None and sandbox.service_url is None:
        job = os.environ.get(ENV_JOB_NAME, "<job>")
        raise SandboxUnavailable(
            f"reward.sandbox.mode service: the job's sandbox pods at {url} did not run a "
            f"program within {wait_s:.0f} s ({why}); see why with kubectl describe pods -l "
            f"gspo.dev/job-name={job},gspo.dev/role=sandbox (docs/rewards.md, runbook)"
        )
    if why is not None:
        where = f"reward.sandbox.serviceUrl {url}"
        fix = "check that the sandbox service is up and has this job's token"
        raise ValueError(f"{where}: a program cannot run there ({why}); {fix}")
    return CodeScorer(CodeRunner(remote, code), concurrency, code.scoring, on_failure)


def wait_for_service(
    remote: Sandbox,
    timeout_s: float,
    *,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> str | None:
    """Probe `remote` until it runs a trivial program or `timeout_s` has passed (0: once):
    None when it did, else why the last probe failed."""
    import time

    from gspo_trainer.code.sandbox import probe

    clock, sleep = clock or time.monotonic, sleep or time.sleep
    deadline, said = clock() + timeout_s, False
    while True:
        why = probe(remote)
        if why is None or clock() >= deadline:
            return why
        if not said:
            log.info("Waiting up to %.0f s for the sandbox service: %s", timeout_s, why)
            said = True
        sleep(2.0)
