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
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "trainer")]


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
