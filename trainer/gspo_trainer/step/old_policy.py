"""πold: the policy's log-probs of the step's responses before any update (and the frozen
reference's, for the KL term), with the experts each token chose for routing drift.

πold is the learner's own recompute by default: the engine's log-probs are measured against
it (`logprob_mismatch`, mean |learner - engine| per response token) and replace it only with
algorithm.oldLogprobSource: engine, which saves the policy's forward pass here except on
diagnostics steps (metrics.diagnosticsEverySteps). Off-policy (a rollout sampled by an
older version), the recompute is the proximal policy of the decoupled objective and the
engine's log-probs are the behaviour policy's (see loss.py).

The first mini-batch's recompute is skipped where the update's own forward gives it
(`first_from_update`): that mini-batch is updated first, on the very weights πold is, so its
πold is the update forward's log-probs, detached (fused_loss, `old_logprobs=None`), as TRL
takes πold when nothing has been updated since sampling. Not on a diagnostics step (its πold
forward measures the mismatch and records the experts for drift) nor with routing replay (the
update replays the experts that forward records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gspo_api.spec import AlgorithmConfig
from gspo_trainer.engine import score_with_head
from gspo_trainer.logprobs import token_logprobs_from_hidden
from gspo_trainer.step.batch import Packed
from gspo_trainer.step.plan import MiniBatch
from gspo_trainer.step.policy import Policy, per_layer

if TYPE_CHECKING:
    import torch


@dataclass
class OldPolicy:
    # Per mini-batch, (rows, width - 1): πold at the response tokens; None: the update's own
    # forward gives it (first_from_update).
    logp: list[torch.Tensor | None]
    ref: list[torch.Tensor] | None  # the same for the reference; None without a KL term
    experts: list[torch.Tensor]  # per MoE layer, the first mini-batch's; [] when not measured
    mismatch: float | None  # mean |learner - engine| per response token; None: not measured


def first_from_update(alg: AlgorithmConfig, *, diagnose: bool) -> bool:
    """Whether the first mini-batch's πold is the update forward's own log-probs rather than
    a recompute (see the module's docstring)."""
    return alg.old_logprob_source == "learner" and not alg.routing_replay and not diagnose


def old_policy(
    policy: Policy, packed: Packed, plan: list[MiniBatch], alg: AlgorithmConfig, *, diagnose: bool
) -> OldPolicy:
    """πold of every mini-batch. With oldLogprobSource engine the policy's forward runs only
    on a diagnostics step (`diagnose`), and then on the first mini-batch alone (the sample the
    mismatch and routing drift are measured on); with learner, on every mini-batch but the
    first where `first_from_update`. The reference's runs whenever KL needs it."""
    import torch

    engine_source = alg.old_logprob_source == "engine"
    from_update = first_from_update(alg, diagnose=diagnose)
    logps: list[torch.Tensor | None] = []
    refs, experts = [], []
    mismatch_sum = mismatch_n = None  # on the device, read once at the end
    with torch.no_grad():
        for k, mb in enumerate(plan):
            old = torch.zeros(
                mb.rows.stop - mb.rows.start, packed.width(mb.rows) - 1, device=packed.ids.device
            )
            ref = torch.zeros_like(old) if policy.reference is not None else None
            own = k == 0 and from_update
            forward = (not engine_source or (diagnose and k == 0)) and not own
            chosen = []
            for sub in mb.micro:
                here, L = mb.local(sub), packed.width(sub)
                mask, targets = packed.mask[sub, : L - 1], packed.targets[sub, : L - 1]
                engine_logp = packed.engine_logp[sub, : L - 1]
                old[here, : L - 1] = engine_logp
                if forward:
                    # router logits only where the experts are read: the first mini-batch
                    fwd = policy.forward(packed, sub, router=k == 0, routing="record")
                    logp = score_with_head(
                        policy.module,
                        _logp,
                        fwd.hidden,
                        targets,
                        mask,
                        alg.temperature,
                        policy.chunk_tokens,
                    )
                    gap = torch.where(mask, (logp - engine_logp).abs(), 0).sum()
                    mismatch_sum = gap if mismatch_sum is None else mismatch_sum + gap
                    mismatch_n = mask.sum() if mismatch_n is None else mismatch_n + mask.sum()
                    if not engine_source:
                        old[here, : L - 1] = logp
                    if k == 0 and fwd.router is not None and policy.moe:
                        chosen.append(policy.experts(packed, sub, fwd))
                if ref is not None:
                    h_ref = policy.forward(packed, sub, router=False, model=policy.reference).hidden
                    # through the reference's own head scorer: under ZeRO-3 it gathers lm_head
                    ref[here, : L - 1] = score_with_head(
                        policy.reference,
                        _logp,
                        h_ref,
                        targets,
                        mask,
                        alg.temperature,
                        policy.chunk_tokens,
                    )
            logps.append(None if own else old)
            if ref is not None:
                refs.append(ref)
            if chosen:
                experts = per_layer(chosen)
    mismatch = None
    if mismatch_sum is not None and mismatch_n is not None:
        total, n = torch.stack([mismatch_sum.float(), mismatch_n.float()]).tolist()
        mismatch = total / n if n else None
    return OldPolicy(logps, refs if policy.reference is not None else None, experts, mismatch)


def _logp(hidden, weight, targets, mask, temperature, chunk):
    return token_logprobs_from_hidden(
        hidden, weight.detach(), targets, chunk, temperature=temperature, mask=mask
    ).logp
