"""What the code reward's sandbox costs: one test case in the sandbox vs a bare subprocess.run.

The same program (a stdin/stdout solution from examples/data/code-problems.jsonl, run through
the same harness) is run three ways in this process, alternating: a bare
`subprocess.run([python, -I, -S, harness.py, program.py])` in a temporary directory (the
baseline: no limits, no isolation), the sandbox with reward.sandbox.isolation none (limits,
process group, scrubbed environment) and with namespaces (the default). Reported: the median
seconds per run of each and the ratio to the baseline (start-up overhead), then the scoring
time per response of a step's worth of responses (--responses, each with the problem's 3
tests) through CodeScorer at reward.sandbox.concurrency.

    python bench/bench_code_sandbox.py [--repeats 30] [--responses 32] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from gspo_api.spec import CodeConfig, SandboxConfig  # noqa: E402
from gspo_trainer.code.runner import HARNESS, PROGRAM, CodeRunner, CodeScorer  # noqa: E402
from gspo_trainer.code.sandbox import LocalSandbox  # noqa: E402
from gspo_trainer.code.tasks import task_from_row  # noqa: E402
from gspo_trainer.reward_types import Scored  # noqa: E402


def bare(program: str, harness: str, stdin: str) -> float:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as box:
        Path(box, PROGRAM).write_text(program)
        Path(box, HARNESS).write_text(harness)
        python = os.path.realpath(sys.executable)
        subprocess.run(
            [python, "-I", "-S", HARNESS, PROGRAM],
            input=stdin.encode(),
            cwd=box,
            capture_output=True,
            timeout=10,
            check=True,
        )
    return time.perf_counter() - t0


def sandboxed(runner: CodeRunner, program: str, row: dict) -> float:
    task = task_from_row(row, runner.cfg)
    t0 = time.perf_counter()
    result = runner.run_case(program, task, task.cases[0])
    assert result.outcome == "passed", result
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--responses", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    args = p.parse_args()
    rows = [json.loads(line) for line in (REPO / "examples/data/code-problems.jsonl").open()]
    row = next(r for r in rows if r["id"] == "sort-numbers")
    program, stdin = row["answer"], row["tests"][0]["input"]
    runners = {
        iso: CodeRunner(LocalSandbox(SandboxConfig(isolation=iso)), CodeConfig())
        for iso in ("none", "namespaces")
    }
    times: dict[str, list[float]] = {"bare": [], "none": [], "namespaces": []}
    harness = runners["none"].harness
    for _ in range(args.repeats):
        times["bare"].append(bare(program, harness, stdin))
        for iso, runner in runners.items():
            times[iso].append(sandboxed(runner, program, row))
    base = statistics.median(times["bare"])
    print(f"one test case, median of {args.repeats} (seconds, ratio to bare subprocess.run):")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:11s} {med * 1e3:7.1f} ms  x{med / base:.2f}")
    sandbox = LocalSandbox(SandboxConfig(concurrency=args.concurrency))
    scorer = CodeScorer(CodeRunner(sandbox, CodeConfig()), concurrency=args.concurrency)
    items = [Scored("", f"```python\n{row['answer']}```", "", True, row=row)] * args.responses
    t0 = time.perf_counter()
    scores = scorer.score(items)
    seconds = time.perf_counter() - t0
    assert scores == [1.0] * args.responses
    print(
        f"scoring {args.responses} responses x {len(row['tests'])} tests at concurrency "
        f"{args.concurrency}: {seconds:.2f} s, {seconds / args.responses * 1e3:.0f} ms per "
        f"response"
    )


if __name__ == "__main__":
    main()
