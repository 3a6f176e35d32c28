"""Run under torchrun: a real Learner on every rank, rollouts in process on rank 0 only.

Writes rank 0's final parameters to argv[1], so a test compares 1-rank and 2-rank runs;
argv[3] and argv[4] set the ZeRO stage and learner.microBatchTokens. With argv[5:9]
(checkpoint directory, maxSteps, a file-size limit in bytes, a step) the run checkpoints every
step, resuming from what is there, and rank 1 alone cannot write a file past that limit once
the checkpoint of that step is written (a limit of 0: none): one rank's disk fills while the
other's does not.
MAX_STALENESS in the environment sets algorithm.maxStaleness (default 0).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import torch

from gspo_api.validation import parse_spec
from gspo_trainer.engine import exit_rank, load_model, resolve_model_path
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.learner import Learner
from gspo_trainer.param_stream import ParamStream
from gspo_trainer.rollout.local import LocalRollout


def varied(prompt: str, completion: str, answer: str) -> float:
    """A reward with spread inside every group from the first step (so gradients are not 0)."""
    return float(sum(map(ord, completion)) % 7)


def main(
    out: str,
    cache: str,
    stage: int,
    micro_tokens: int,
    ckpt: str | None = None,
    max_steps: int = 2,
    fsize_limit: int = 0,
    limit_after: int = 0,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ['RANK']}] %(message)s")
    world = int(os.environ["WORLD_SIZE"])
    manifest = tiny_manifest()
    manifest["spec"]["model"]["name"] = "builtin:tiny-qwen3-moe"  # the smallest: cheapest steps
    manifest["spec"]["algorithm"].update(
        maxSteps=max_steps,
        miniBatches=2,
        learningRate=1e-3,
        maxStaleness=int(os.environ.get("MAX_STALENESS", "0")),
    )
    manifest["spec"]["checkpoint"].update(everySteps=1, keep=5)
    manifest["spec"]["reward"] = {"kind": "python", "function": "two_rank_worker:varied"}
    manifest["spec"]["learner"].update(
        replicas=world, zeroStage=stage, microBatchTokens=micro_tokens
    )
    manifest["spec"]["checkpoint"]["exportHf"] = ckpt is not None  # gathered from every rank
    # The router aux loss is not a mean over responses (E * sum f_e P_e of the whole batch),
    # so ranks sharing a batch compute a slightly different one: leave it out here.
    manifest["spec"]["model"]["moe"]["routerAuxLossCoef"] = 0.0
    spec = parse_spec(manifest["spec"])
    path = resolve_model_path(spec, cache)
    rollout = None
    if int(os.environ["RANK"]) == 0:
        model, tok = load_model(spec, path)
        rollout = LocalRollout(model, tok.pad_token_id, tok.eos_token_id)
    learner = Learner.build(spec, rollout, checkpoint_dir=ckpt and Path(ckpt), model_path=path)
    if fsize_limit and learner.rank == 1:
        import resource

        checkpoint = learner.checkpointer.checkpoint

        def then_fill(*, final: bool = False) -> None:
            """The disk fills once that step's checkpoint is on it."""
            checkpoint(final=final)
            if learner.state.step >= limit_after:
                _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, hard))

        learner.checkpointer.checkpoint = then_fill
    assert asyncio.run(learner.run()) == 0
    stream = ParamStream.of(learner.engine, learner.ranks)  # gathers ZeRO-3 shards, layer by layer
    if learner.rank == 0:
        params = {n: t.detach().clone() for n, t in stream}
        stream.finish()
    else:
        stream.follow()
    if learner.rank == 0:
        torch.save({"params": params, "history": learner.state.history}, out)


if __name__ == "__main__":
    extra = sys.argv[5:9]
    if extra:
        main(
            *sys.argv[1:3],
            int(sys.argv[3]),
            int(sys.argv[4]),
            extra[0],
            *map(int, extra[1:]),
        )
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    Path(sys.argv[1] + ".done").write_text("ok")
    exit_rank(0)  # as the learner's command ends a rank: no interpreter teardown
