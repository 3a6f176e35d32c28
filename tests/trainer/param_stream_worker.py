"""Run under torchrun with 2 ranks: a ZeRO-3 engine on the tiny MoE, then rank 0 reads a
ParamStream the way a failed and a retried sync do while rank 1 follows. Writes what it saw
to argv[1] (rank 0)."""

from __future__ import annotations

import json
import sys

import deepspeed
from learner_helpers import staged_spec

from gspo_trainer.engine import build_engine, exit_rank, load_model, resolve_model_path
from gspo_trainer.param_stream import ParamStream
from gspo_trainer.ranks import Ranks


def main(out: str, cache: str) -> None:
    spec = staged_spec(3)
    model, _ = load_model(spec, resolve_model_path(spec, cache))
    engine = build_engine(spec, model)
    ranks = Ranks()
    stream = ParamStream.of(engine, ranks)
    # Every rank's shard is part of a parameter: the model really is split over the two.
    partitioned = all(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters()
                      if p.ds_numel > 1)  # fmt: skip
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
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = {n: p.data.clone() for n, p in engine.module.named_parameters()}
    if ranks.rank == 0:
        equal = list(seen) == list(whole) and all(seen[n].equal(t) for n, t in whole.items())
        result = {"passes_followed": followed, "equal": equal, "partitioned": partitioned}
        with open(out, "w") as f:
            json.dump(result, f)
    ranks.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
