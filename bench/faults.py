"""Fault injection across the rollout fleet, the learner and the operator, many trials each.

Each scenario injects one kind of fault at random moments (seeded), checks the promise that
goes with it, and counts trials survived. Prints the table that RELIABILITY.md records:

    python bench/faults.py [--trials 10] [--seed 0] [--only NAME ...]

Every scenario is bounded: a trial that hangs past its deadline counts as not survived.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "trainer"),
    str(REPO / "operator"),
    str(REPO / "tests"),
    str(REPO / "tests" / "trainer" / "rollout"),
]


@dataclass
class Row:
    fault: str
    promise: str
    trials: int = 0
    survived: int = 0
    steps_lost: int = 0
    notes: list[str] = field(default_factory=list)

    def record(self, ok: bool, note: str = "") -> None:
        self.trials += 1
        self.survived += ok
        if note and (not ok or len(self.notes) < 3):
            self.notes.append(note)


Scenario = Callable[[int, random.Random], Awaitable[Row]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn

    return register


# --- the rollout fleet -----------------------------------------------------------------------
# Stand-in server processes (tests/trainer/rollout/rollout_standin.py): vLLM's app shape with
# the project's endpoint plugin and worker extension; only vLLM's engine and /v1/completions
# route are stood in for.


async def _fleet(count: int, seconds: float, engine: str, version: int | None) -> list:  # type: ignore[type-arg]
    from rollout_standin import spawn_standin

    return list(
        await asyncio.gather(*(spawn_standin(seconds, engine, version) for _ in range(count)))
    )


async def _health(url: str) -> dict | None:  # type: ignore[type-arg]
    import aiohttp

    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
            return await resp.json()
    except aiohttp.ClientError:
        return None


@scenario("sync-interrupted")
async def sync_interrupted(trials: int, rng: random.Random) -> Row:
    """A rollout server SIGKILLed at a random moment of a weight sync, then restarted."""
    from rollout_standin import TOKEN, free_port, spawn_standin
    from test_sync_faults import digest, heads, weights

    from gspo_trainer.rollout.client import RolloutClient, SyncOptions

    row = Row(
        "rollout server killed during a weight sync, then restarted",
        "sync completes on the others; next sync brings all to one version; no stale sample",
    )
    servers = await _fleet(3, 0.02, "gloo", None)
    urls = [u for _, u in servers]
    opts = SyncOptions("127.0.0.1", free_port(), bucket_mb=0.01, timeout_s=8.0)
    try:
        async with RolloutClient(urls, token=TOKEN, sync=opts, timeout_s=30) as client:
            await client.sync_weights(weights(0).items(), version=0)
            for trial in range(1, trials + 1):
                killed_v, next_v = 2 * trial - 1, 2 * trial
                victim = rng.randrange(len(servers))
                delay = rng.uniform(0.0, 1.2)  # the sync takes ~1 s: before, during, after
                task = asyncio.create_task(client.sync_weights(weights(killed_v).items(), killed_v))
                await asyncio.sleep(delay)
                proc, url = servers[victim]
                proc.kill()
                proc.wait(timeout=10)
                ok, note = True, f"killed {delay:.2f} s into the sync"
                try:
                    report = await asyncio.wait_for(task, timeout=60)
                    others = [u for u in urls if u != url]
                    if not set(others) <= set(report.servers):
                        ok, note = False, f"trial {trial}: survivors not synced: {report}"
                except Exception as exc:
                    ok, note = False, f"trial {trial}: sync raised {exc!r}"
                port = int(url.rsplit(":", 1)[1])
                servers[victim] = await spawn_standin(0.02, "gloo", None, port)
                try:
                    after = await asyncio.wait_for(
                        client.sync_weights(weights(next_v).items(), next_v), timeout=60
                    )
                    versions = {(await _health(u) or {}).get("policy_version") for u in urls}
                    same = await heads(client) == {(digest(weights(next_v)), next_v)}
                    if sorted(after.servers) != sorted(urls) or versions != {next_v} or not same:
                        ok, note = False, f"trial {trial}: after restart {versions}, same={same}"
                except Exception as exc:
                    ok, note = False, f"trial {trial}: next sync raised {exc!r}"
                row.record(ok, note)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)
    return row


@scenario("server-killed-mid-step")
async def server_killed_mid_step(trials: int, rng: random.Random) -> Row:
    """A rollout server SIGKILLed at a random moment of a batch's generation."""
    from rollout_standin import TOKEN, spawn_standin

    from gspo_trainer.rollout.client import RolloutClient
    from gspo_trainer.rollout.types import SamplingParams

    row = Row(
        "rollout server killed while generating a batch",
        "every prompt gets its whole group from the current version; batch completes",
    )
    params = SamplingParams(n=4, max_tokens=3)
    prompts = [[i % 10 + 2, 5, 6] for i in range(48)]
    servers = await _fleet(3, 0.05, "plain", 0)
    try:
        for trial in range(trials):
            urls = [u for _, u in servers]
            victim = rng.randrange(len(servers))
            async with RolloutClient(urls, TOKEN, chunk_prompts=4, timeout_s=30) as client:
                task = asyncio.create_task(client.generate(prompts, params))
                await asyncio.sleep(rng.uniform(0.0, 0.25))
                servers[victim][0].kill()
                servers[victim][0].wait(timeout=10)
                try:
                    batch = await asyncio.wait_for(task, timeout=60)
                    whole = all(
                        [c.prompt_index for c in g] == [i] * params.n
                        and all(c.policy_version == 0 for c in g)
                        for i, g in enumerate(batch.groups)
                    )
                    row.record(whole, "" if whole else f"trial {trial}: incomplete groups")
                except Exception as exc:
                    row.record(False, f"trial {trial}: generate raised {exc!r}")
            port = int(servers[victim][1].rsplit(":", 1)[1])
            servers[victim] = await spawn_standin(0.05, "plain", 0, port)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)
    return row


@scenario("bad-rollout-requests")
async def bad_rollout_requests(trials: int, rng: random.Random) -> Row:
    """Every malformed request of the rollout bad-input test, against a live server."""
    import aiohttp
    from rollout_standin import TOKEN
    from test_rollout_bad_input import BAD_BODIES, GOOD, message

    row = Row("malformed rollout requests", "4xx naming the field; the server keeps serving")
    ((proc, url),) = await _fleet(1, 0.0, "plain", 0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession(headers=auth) as http:
            for body, status, words in BAD_BODIES:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    error = message(await resp.json())
                    refused = resp.status == status and words in error
                async with http.post(url + "/v1/completions", json=GOOD) as resp:
                    serving = resp.status == 200
                row.record(refused and serving, "" if refused else f"{body!r:.60}: {error}")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return row


# --- the operator ----------------------------------------------------------------------------


@scenario("operator-restarts")
async def operator_restarts(trials: int, rng: random.Random) -> Row:
    """The operator killed and restarted 10 times at random moments of one job's life."""
    row = Row(
        "operator killed and restarted 10x during a job",
        "no duplicate/orphan children, no learner restart, job Succeeded",
    )
    totals = {"duplicates": 0, "orphans": 0, "missing": 0, "learner restarts": 0}
    for _ in range(trials):
        trial = await _operator_restart_trial(rng)
        totals["duplicates"] += trial.duplicates
        totals["orphans"] += trial.orphans
        totals["missing"] += trial.missing
        totals["learner restarts"] += trial.learner_restarts
        row.record(not trial.problems, "; ".join(trial.problems)[:120])
    row.notes.insert(0, ", ".join(f"{k} {v}" for k, v in totals.items()))
    return row


async def _operator_restart_trial(rng: random.Random):  # type: ignore[no-untyped-def]
    import logging

    sys.path.insert(0, str(REPO / "tests" / "operator"))
    from operator_restarts import run_trial

    for noisy in ("kopf", "aiohttp", "kubernetes", "gspo_operator"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)  # a crash a second is expected
    seed = rng.randrange(2**32)
    try:
        return await asyncio.wait_for(run_trial(random.Random(seed), restarts=10), 120)
    except (TimeoutError, AssertionError) as exc:
        from operator_restarts import Trial

        return Trial(problems=[f"seed {seed}: {type(exc).__name__}: {exc}"])


# --- the learner -----------------------------------------------------------------------------
# Learner processes on the tiny MoE with in-process rollouts (tests/trainer/learner_proc.py),
# so these scenarios need neither vLLM nor a GPU.


def _learner_paths() -> None:
    here = str(REPO / "tests" / "trainer")
    if here not in sys.path:
        sys.path.insert(0, here)


@scenario("learner-sigkill")
async def learner_sigkill(trials: int, rng: random.Random) -> Row:
    """The learner SIGKILLed: odd trials inside a checkpoint write, even ones mid-step."""
    import tempfile

    _learner_paths()
    from learner_proc import reference_params, sigkill_trial

    steps, every = 6, 2
    row = Row(
        f"learner SIGKILLed ({steps} steps, checkpoint every {every}; half the kills timed to "
        "land inside a checkpoint write), then restarted",
        "resumes from the newest checksum-verified checkpoint; loses <= one interval; "
        f"parameters at step {steps} equal an uninterrupted run's",
    )
    with tempfile.TemporaryDirectory(prefix="faults-learner-") as tmp:
        root = Path(tmp)
        reference = await asyncio.to_thread(
            reference_params, root / "cache", root / "straight", steps, every
        )
        in_write = 0
        for trial in range(trials):
            work = root / f"trial-{trial}"
            work.mkdir()
            ok, note, lost, landed = await asyncio.to_thread(
                sigkill_trial,
                root / "cache",
                work,
                steps,
                every,
                reference,
                rng,
                trial % 2 == 1,
            )
            in_write += landed
            row.steps_lost = max(row.steps_lost, lost)
            row.record(ok, f"trial {trial}: {note}")
            print(
                f"  trial {trial}: {'ok' if ok else 'FAILED'} {note} (lost {lost})",
                file=sys.stderr,
                flush=True,
            )
        row.notes.insert(0, f"{in_write} of {trials} kills landed inside a checkpoint write")
    return row


def _tamper(path: Path, how: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    else:  # delete
        path.unlink()


def _checkpoint_tampered(trials: int, rng: random.Random) -> Row:
    """The newest checkpoint's file truncated, a bit flipped, or the file deleted."""
    import logging
    import shutil
    import tempfile

    _learner_paths()
    from learner_helpers import make_learner, run
    from learner_proc import manifest

    from gspo_trainer import checkpoint as ckpt

    row = Row(
        "newest checkpoint tampered: a random file truncated, a bit flipped or deleted",
        "resume skips it for the previous good one, with a log line naming it",
    )
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger("gspo.checkpoint").addHandler(handler)
    with tempfile.TemporaryDirectory(prefix="faults-tamper-") as tmp:
        root = Path(tmp)
        base = root / "base"
        assert run(make_learner(root / "cache", base, manifest(2, 1, 3))) == 0
        learner = make_learner(root / "cache", base, manifest(3, 1, 3))  # resumes each copy
        try:
            for trial in range(trials):
                work = root / f"trial-{trial}"
                shutil.copytree(base, work)
                newest = work / "step-000002"
                files = sorted(p for p in newest.rglob("*") if p.is_file())
                victim = files[rng.randrange(len(files))]
                how = ("truncate", "flip", "delete")[trial % 3]
                _tamper(victim, how, rng)
                seen.clear()
                learner.checkpointer.directory = work
                at = learner.resume()
                rel = victim.relative_to(newest).as_posix()
                named = any("step-000002 failed verification" in m for m in seen)
                ok = at == 1 and named and ckpt.verify(work / "step-000001") == []
                row.steps_lost = max(row.steps_lost, 2 - at)
                row.record(
                    ok, f"trial {trial}: {how} {rel} -> resumed at step {at}, logged: {named}"
                )
                shutil.rmtree(work)
        finally:
            logging.getLogger("gspo.checkpoint").removeHandler(handler)
    return row


@scenario("checkpoint-tampered")
async def checkpoint_tampered(trials: int, rng: random.Random) -> Row:
    """In a thread: these learners run their own event loop, in this process."""
    return await asyncio.to_thread(_checkpoint_tampered, trials, rng)


def _checkpoint_disk_full(trials: int, rng: random.Random) -> Row:
    """A checkpoint write that fails part-way: RLIMIT_FSIZE set in the learner's process."""
    import resource
    import shutil
    import tempfile

    _learner_paths()
    from learner_helpers import make_learner, run
    from learner_proc import manifest

    from gspo_trainer import checkpoint as ckpt
    from gspo_trainer.checkpointer import MAX_CHECKPOINT_FAILURES, CheckpointError
    from gspo_trainer.learner_state import LearnerState

    row = Row(
        "checkpoint write fails part-way (RLIMIT_FSIZE at a random size in the learner process)",
        f"each failure logged and counted, retried at the next step; after "
        f"{MAX_CHECKPOINT_FAILURES} in a row the run stops with an error; the previous "
        "checkpoint stays intact and is the one resumed from",
    )
    with tempfile.TemporaryDirectory(prefix="faults-full-") as tmp:
        root = Path(tmp)
        base = root / "base"
        assert run(make_learner(root / "cache", base, manifest(2, 1, 3))) == 0
        biggest = max(p.stat().st_size for p in (base / "step-000002").rglob("*") if p.is_file())
        learner = make_learner(root / "cache", base, manifest(6, 1, 3))  # reused for each copy
        for trial in range(trials):
            work = root / f"trial-{trial}"
            shutil.copytree(base, work)
            learner.checkpointer.directory = work
            vars(learner.state).update(vars(LearnerState()))  # shared by the learner's parts
            learner.checkpointer.failures = 0  # consecutive failures, per run
            before = learner.metrics.checkpoint_failures._value.get()
            limit = rng.randrange(4096, biggest)
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                try:
                    run(learner)
                    stopped = False
                except CheckpointError:
                    stopped = True
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            failures = learner.metrics.checkpoint_failures._value.get() - before
            intact = ckpt.verify(work / "step-000002") == []
            kept = {"step-000001", "step-000002"}
            leftover = [
                p.name for p in work.iterdir() if p.name.startswith("step-") and p.name not in kept
            ]
            stopped_at = learner.state.step
            vars(learner.state).update(vars(LearnerState()))  # the parts hold this one object
            at = learner.resume()
            ok = (
                stopped
                and failures == MAX_CHECKPOINT_FAILURES
                and intact
                and not leftover
                and at == 2
                and stopped_at == 2 + MAX_CHECKPOINT_FAILURES
            )
            row.steps_lost = max(row.steps_lost, stopped_at - at)
            row.record(
                ok,
                f"trial {trial}: limit {limit} B: stopped={stopped} at step "
                f"{stopped_at}, failures={failures:.0f}, previous intact="
                f"{intact}, left over {leftover}, resumed at {at}",
            )
            shutil.rmtree(work)
    return row


@scenario("checkpoint-disk-full")
async def checkpoint_disk_full(trials: int, rng: random.Random) -> Row:
    """In a thread: these learners run their own event loop, in this process."""
    return await asyncio.to_thread(_checkpoint_disk_full, trials, rng)


@scenario("learner-bad-input")
async def learner_bad_input(trials: int, rng: random.Random) -> Row:
    """Every bad input of the learner bad-input test, through `gspo learner` as a process."""
    import os
    import subprocess
    import tempfile

    _learner_paths()
    from test_learner_bad_input import BAD_INPUTS, refuse

    row = Row(
        "bad learner inputs: " + ", ".join(sorted(BAD_INPUTS)),
        "exit 2 at start-up with one line naming the spec field; no checkpoint dir made",
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}

    def gspo_learner(argv: list[str]) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "gspo_operator.cli", "learner", *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        return done.returncode, done.stderr

    for name in sorted(BAD_INPUTS):
        with tempfile.TemporaryDirectory(prefix="faults-bad-") as tmp:
            problem = await asyncio.to_thread(refuse, name, Path(tmp), gspo_learner, 60)
        row.record(not problem, f"{name}: {problem or 'refused'}")
    return row


# --- the table -------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| fault | promise checked | trials | survived | steps lost | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        notes = "; ".join(r.notes[:3])
        lines.append(
            f"| {r.fault} | {r.promise} | {r.trials} | {r.survived} | {r.steps_lost} | {notes} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[Row]:
    rows = []
    for name in args.only or list(SCENARIOS):
        start = time.perf_counter()
        print(f"[{name}] {args.trials} trials ...", file=sys.stderr, flush=True)
        row = await SCENARIOS[name](args.trials, random.Random(f"{args.seed}-{name}"))
        print(
            f"[{name}] {row.survived}/{row.trials} survived in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    rows = asyncio.run(main_async(p.parse_args()))
    print(table(rows))
    sys.exit(0 if all(r.survived == r.trials for r in rows) else 1)


if __name__ == "__main__":
    main()
