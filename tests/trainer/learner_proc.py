"""A learner process on the tiny MoE with in-process rollouts, for fault-injection trials.

    python tests/trainer/learner_proc.py --cache DIR --ckpt DIR --steps N --every K
        [--params-out FILE] [--fsize-limit BYTES]

Exit status as `gspo learner`: 0 at maxSteps, 1 on a fatal error (a failed checkpoint write
among them). Writes <ckpt>/history.jsonl (one line per step) and, on success, the policy's
parameters to --params-out. --fsize-limit sets RLIMIT_FSIZE after the model is built, so a
checkpoint write fails part-way the way a full disk makes it fail.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "trainer")]


RESUMED = re.compile(r"Resumed from \S*step-(\d+) at step (\d+) \(checksums verified\)")


def spawn(
    cache: Path,
    ckpt: Path,
    steps: int,
    every: int,
    log: Path,
    *,
    params_out: Path | None = None,
    fsize_limit: int | None = None,
) -> subprocess.Popen:
    """Start this file as a learner process; its output goes to `log`."""
    cmd = [sys.executable, __file__, "--cache", str(cache), "--ckpt", str(ckpt),
           "--steps", str(steps), "--every", str(every)]  # fmt: skip
    if params_out:
        cmd += ["--params-out", str(params_out)]
    if fsize_limit:
        cmd += ["--fsize-limit", str(fsize_limit)]
    from gspo_trainer.train import own_group_env

    env = own_group_env(os.environ)  # a group of its own
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def steps_done(ckpt: Path) -> int:
    """The last step the learner finished (its history has one line per step)."""
    import json

    path = ckpt / "history.jsonl"
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    steps = []
    for ln in lines:
        with contextlib.suppress(ValueError, KeyError):  # a line cut by the kill
            steps.append(int(json.loads(ln)["step"]))
    return max(steps, default=0)


def writing(ckpt: Path) -> bool:
    return ckpt.is_dir() and any(p.name.endswith(".tmp") for p in ckpt.iterdir())


def params_equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    return [n for n in a if n not in b or not torch.equal(a[n], b[n])] + [
        n for n in b if n not in a
    ]


def sigkill_trial(cache: Path, work: Path, steps: int, every: int, reference: dict[str, Any],
                  rng: random.Random, mid_write: bool,
                  max_delay_s: float = 0.04,
                  deadline_s: float = 300) -> tuple[bool, str, int, bool]:  # fmt: skip
    """Kill a learner with SIGKILL (inside a checkpoint write, or at a random moment of a
    random step), resume it to `steps`, and check the promises. Returns (ok, note, steps
    lost, whether the kill landed inside a checkpoint write)."""
    import torch

    from gspo_trainer import checkpoint as ckpt_mod

    ckpt = work / "ckpt"
    proc = spawn(cache, ckpt, steps, every, work / "killed.log")
    end = time.monotonic() + deadline_s
    try:
        if mid_write:  # kill at a random moment of a randomly chosen checkpoint write
            skip = rng.randrange(max(steps // every - 1, 1))
            seen = 0
            while proc.poll() is None and time.monotonic() < end:
                if writing(ckpt):
                    if seen == skip:
                        break
                    seen += 1
                    while writing(ckpt) and time.monotonic() < end:
                        time.sleep(0.0005)
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, max_delay_s))
        else:  # at a random moment of a random step
            target = rng.randrange(1, steps)
            while proc.poll() is None and steps_done(ckpt) < target and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))  # a step takes ~0.4 s here
        if proc.poll() is not None:
            return False, f"the learner ended (exit {proc.returncode}) before the kill", 0, False
        in_write = writing(ckpt)
        proc.kill()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    done = steps_done(ckpt)
    newest = ckpt_mod.newest_intact(ckpt)
    base = int(newest.name.split("-")[1]) if newest else 0
    lost = done - base
    out = work / "params.pt"
    proc = spawn(cache, ckpt, steps, every, work / "resumed.log", params_out=out)
    try:
        code = proc.wait(timeout=max(end - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return False, "the resumed run hung", lost, in_write
    log = (work / "resumed.log").read_text(errors="replace")
    m = RESUMED.search(log)
    resumed_at = int(m.group(2)) if m else 0
    where = f"killed at step {done}{' mid-write' if in_write else ''}, resumed at {resumed_at}"
    if code != 0:
        return False, f"{where}: resumed run exited {code}", lost, in_write
    if resumed_at != base or (base and not m):
        return False, f"{where}: newest intact checkpoint was step {base}", lost, in_write
    if lost > every:
        return False, f"{where}: lost {lost} steps > interval {every}", lost, in_write
    if writing(ckpt):
        return False, f"{where}: a .tmp checkpoint was left behind", lost, in_write
    differ = params_equal(torch.load(out), reference)
    if differ:
        return (
            False,
            f"{where}: parameters differ from the straight run: {differ[:3]}",
            lost,
            in_write,
        )
    return True, where, lost, in_write


def reference_params(cache: Path, work: Path, steps: int, every: int) -> dict[str, Any]:
    """The parameters of an uninterrupted run to `steps` (its own process, like the trials)."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    out = work / "params.pt"
    proc = spawn(cache, work / "ckpt", steps, every, work / "straight.log", params_out=out)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the straight run failed: see {work / 'straight.log'}")
    return torch.load(out)


def manifest(steps: int, every: int, keep: int) -> dict:
    from learner_helpers import tiny_spec

    m = tiny_spec(maxSteps=steps)
    m["spec"]["checkpoint"] = {"everySteps": every, "keep": keep}
    return m


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--params-out")
    p.add_argument("--fsize-limit", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    from learner_helpers import make_learner, params, run

    torch.set_num_threads(1)
    ckpt = Path(args.ckpt)
    learner = make_learner(Path(args.cache), ckpt, manifest(args.steps, args.every, args.keep),
                           history_path=ckpt / "history.jsonl")  # fmt: skip
    if args.fsize_limit:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, hard))
    try:
        code = run(learner)
    except Exception:
        logging.getLogger("gspo.learner").exception("The learner failed")
        return 1
    if code == 0 and args.params_out:
        torch.save(params(learner), args.params_out)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
