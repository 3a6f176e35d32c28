"""Run under torchrun with 2 ranks: a ZeRO-3 engine on the tiny MoE, then rank 0 reads a
ParamStream the way a failed and a retried sync do while rank 1 follows, then an export
fails on rank 0 before its first layer. Writes what it saw to argv[1] (rank 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
from learner_helpers import staged_spec

from gspo_trainer import checkpoint as ckpt
from gspo_trainer.checkpointer import Checkpointer, CheckpointError
from gspo_trainer.engine import (
    build_engine,
    exit_rank,
    init_distributed,
    load_model,
    resolve_model_path,
)
from gspo_trainer.learner_state import LearnerState
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.param_stream import ParamStream
from gspo_trainer.ranks import Ranks

# Ranks left in mismatched collectives fail within this, not DeepSpeed's 10 minutes.
GROUP_TIMEOUT_S = 60


def export_failing_before_its_first_layer(engine, ranks: Ranks, out: str) -> bool:  # type: ignore[no-untyped-def]
    """Every rank exports; rank 0's write fails before it reads a layer (a volume that
    refuses the directory). True when both ranks end with the export's error and agree
    afterwards (no gather was left unmatched)."""

    def refuse(layers, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError("read-only checkpoint volume")

    ckpt.export_hf = refuse  # rank 0's write
    saver = Checkpointer(
        Path(out).parent / "ckpt", 1, engine, None, ranks, LearnerMetrics(), LearnerState(), dict
    )
    try:
        saver.export(1 << 20)
        failed = False
    except CheckpointError:
        failed = True
    return ranks.all(failed)


def main(out: str, cache: str) -> None:
    init_distributed(GROUP_TIMEOUT_S)
    spec = staged_spec(3)
    model, _ = load_model(spec, resolve_model_path(spec, cache))
    engine = build_engine(spec, model)
    ranks = Ranks()
    stream = ParamStream.of(engine, ranks)
    # Every rank's shard is part of a parameter: the model really is split over the two.
    partitioned = all(
        p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters() if p.ds_numel > 1
    )
    seen = {}
    if ranks.rank == 0:
        first = iter(stream)
        next(first), next(first)
        first.close()  # the rest of this pass is still gathered, as rank 1 does
        seen = {name: t.clone() for name, t in stream}
        stream.finish()
        followed = ranks.max_int(0)  # rank 1's count
    else:
        followed = ranks.max_int(stream.follow())
    export_failed_on_both = export_failing_before_its_first_layer(engine, ranks, out)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = {n: p.data.clone() for n, p in engine.module.named_parameters()}
    if ranks.rank == 0:
        equal = list(seen) == list(whole) and all(seen[n].equal(t) for n, t in whole.items())
        result = {
            "passes_followed": followed,
            "equal": equal,
            "partitioned": partitioned,
            "export_failed_on_both": export_failed_on_both,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    ranks.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
