"""Under ZeRO-3 the learner's forwards run as the top module's forward, so DeepSpeed's
prefetch trace completes: its pre-hook on the top module (parameter_offload.py,
`_start_of_forward_hook`) calls the parameter coordinator's `reset_step`, the first call turns
recording on, the second freezes the trace (partitioned_param_coordinator.py,
ZeRoTraceMode.COMPLETE) and the layers' gathers are prefetched from then on. The learner calls
the base model (it wants hidden states, not logits): called directly, the trace stays INVALID
and every gather waits."""

from __future__ import annotations

import pytest
import torch
from learner_helpers import staged_spec

from gspo_trainer import engine as eng
from gspo_trainer.config import AlgorithmConfig
from gspo_trainer.moe import moe_shape
from gspo_trainer.step.batch import pack
from gspo_trainer.step.old_policy import old_policy
from gspo_trainer.step.plan import MiniBatch
from gspo_trainer.step.policy import Policy
from gspo_trainer.step.update import update


def small_batch(vocab: int, rows: int = 4) -> tuple:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (5,), generator=g).tolist() for _ in range(rows // 2)]
    responses = [torch.randint(3, vocab, (3 + i,), generator=g).tolist() for i in range(rows)]
    logps = [[-1.0] * len(r) for r in responses]
    packed = pack(prompts, responses, logps, [float(i % 2) for i in range(rows)], 2, 0)
    advantages = torch.tensor([1.0, -1.0] * (rows // 2))
    return packed, advantages


@pytest.fixture(scope="module")
def zero3_policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    spec = staged_spec(3)
    path = eng.resolve_model_path(spec, str(tmp_path_factory.mktemp("models")))
    model, _ = eng.load_model(spec, path, shard=True)
    engine = eng.build_engine(spec, model)
    return Policy(engine, moe_shape(model.config), None, pack=True)


def trace_mode(policy: Policy) -> str:
    coordinator = policy.engine.optimizer.parameter_offload.get_param_coordinator()
    if coordinator.is_complete_trace():
        return "COMPLETE"
    return "RECORD" if coordinator.is_record_trace() else "INVALID"


def test_the_zero3_trace_completes_after_two_steps(zero3_policy: Policy) -> None:
    policy = zero3_policy
    packed, advantages = small_batch(policy.module.config.vocab_size)
    plan = [MiniBatch(slice(0, 4), [slice(0, 2), slice(2, 4)])]
    alg = AlgorithmConfig()
    modes = []
    for _ in range(2):
        old = old_policy(policy, packed, plan, alg, diagnose=True)
        update(policy, packed, plan, old, advantages, alg, aux_coef=0.01, behaviour=False,
               diagnose=True)  # fmt: skip
        modes.append(trace_mode(policy))
    assert modes[-1] == "COMPLETE", modes
