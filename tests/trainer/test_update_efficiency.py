"""How the update uses the device.

Under ZeRO-3 the learner's forwards run as the top module's forward, so DeepSpeed's
prefetch trace completes: its pre-hook on the top module (parameter_offload.py,
`_start_of_forward_hook`) calls the parameter coordinator's `reset_step`, the first call turns
recording on, the second freezes the trace (partitioned_param_coordinator.py,
ZeRoTraceMode.COMPLETE) and the layers' gathers are prefetched from then on. The learner calls
the base model (it wants hidden states, not logits): called directly, the trace stays INVALID
and every gather waits.

Host syncs: every read of a device value on the host (`.item()`, `float(t)`, `.tolist()`,
`bool(t)`, a boolean-mask index, `nonzero`) waits for the GPU to finish all the work queued
before it, so the host cannot queue the next kernels meanwhile. The learner's own code reads
at most one per micro-batch (the scored tokens' layout, which sizes the chunks), and its
stats once per step."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_helpers import staged_spec

from gspo_api.spec import AlgorithmConfig
from gspo_trainer import engine as eng
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
        update(
            policy,
            packed,
            plan,
            old,
            advantages,
            alg,
            aux_coef=0.01,
            behaviour=False,
            diagnose=True,
        )
        modes.append(trace_mode(policy))
    assert modes[-1] == "COMPLETE", modes


TRAINER = str(Path(__file__).resolve().parents[2] / "trainer" / "gspo_trainer")
# Tensor methods that read a device value on the host (on a GPU each waits for the stream).
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero", "cpu")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts host reads of tensors made by the learner's own code (trainer/gspo_trainer:
    DeepSpeed's and torch's own are theirs), by method, with boolean-mask indexing as
    "mask_index"."""
    counts: Counter = Counter()

    def ours() -> bool:
        return sys._getframe(2).f_code.co_filename.startswith(TRAINER)

    def spy(name: str, real: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if ours():
                counts[name] += 1
            return real(self, *args, **kw)

        return method

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    real_getitem = torch.Tensor.__getitem__

    def getitem(self: torch.Tensor, index: Any) -> Any:
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts) and ours():
            counts["mask_index"] += 1
        return real_getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    return counts


def test_host_syncs_per_micro_batch(zero3_policy: Policy, host_reads: Counter) -> None:
    """The learner's host reads over a step of 2 micro-batches and one of 4: what the two more
    micro-batches add is what each micro-batch costs."""
    policy = zero3_policy
    packed, advantages = small_batch(policy.module.config.vocab_size, rows=8)
    alg = AlgorithmConfig()
    totals = []
    for micro in (2, 4):
        step = 8 // micro
        plan = [MiniBatch(slice(0, 8), [slice(a, a + step) for a in range(0, 8, step)])]
        host_reads.clear()
        old = old_policy(policy, packed, plan, alg, diagnose=False)
        update(
            policy,
            packed,
            plan,
            old,
            advantages,
            alg,
            aux_coef=0.01,
            behaviour=True,
            diagnose=False,
        )
        totals.append(dict(host_reads))
    per_micro = (sum(totals[1].values()) - sum(totals[0].values())) / 2
    # The update's forward reads the scored tokens' layout once, and a πold forward, where it
    # runs (not here: the one mini-batch's πold is its update's own), once more.
    assert per_micro <= 2, totals
