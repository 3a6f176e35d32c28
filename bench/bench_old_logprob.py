"""What algorithm.oldLogprobSource engine saves: the learner's work per step, engine vs learner.

Two learners on the embedded default's model and batch (16 prompts x 16 samples, two
mini-batches), in this process, with the in-process rollout source (transformers generate on
a copy of the policy; its time is not counted): one recomputes πold (`learner`, the default),
one takes the engine's log-probs (`engine`), which skips the πold forward pass except on
diagnostics steps (metrics.diagnosticsEverySteps, 10). They alternate step by step so drift
in the machine falls on both. Reports the medians of `old_policy_seconds` (πold) and
`update_seconds` (updates, and on diagnostics steps routing drift) and the ratio of the sums.

    python bench/bench_old_logprob.py [--steps 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO / "tests" / "trainer")]

from learner_helpers import make_learner  # noqa: E402

from gspo_trainer.jobs import tiny_manifest  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    learners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in ("learner", "engine"):
            manifest = tiny_manifest()
            manifest["spec"]["algorithm"].update(
                oldLogprobSource=source, evalEverySteps=0, maxStaleness=0
            )
            learners[source] = make_learner(Path(tmp), None, manifest)
            asyncio.run(learners[source].sync(0))
        for step in range(1, args.steps + 1):
            for learner in learners.values():
                asyncio.run(learner.train_step(step))
    print(f"{'oldLogprobSource':>16} {'logprob s':>10} {'update s':>9} {'learner work s':>15}")
    work = {}
    for source, learner in learners.items():
        history = learner.state.history[5:]  # past the first steps' warm-up of the allocator
        logprob = statistics.median(r["old_policy_seconds"] for r in history)
        update = statistics.median(r["update_seconds"] for r in history)
        work[source] = statistics.median(
            r["old_policy_seconds"] + r["update_seconds"] for r in history
        )
        print(f"{source:>16} {logprob:>10.4f} {update:>9.4f} {work[source]:>15.4f}")
    print(
        f"\nlearner work per step, engine vs learner πold: "
        f"{work['engine'] / work['learner']:.2f}x (medians over {args.steps - 5} steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
