"""The updates of one step: one optimizer step per mini-batch, its gradient accumulated over
micro-batches, each micro-batch's loss weighted by its share of the mini-batch's responses.

The loss is computed straight from hidden states (`fused_loss`), clipped against πold.
Off-policy (`behaviour=True`: rollouts may come from an older version than πold) it is the
decoupled objective: each response (each token, with per-token advantages) weighted by its
truncated importance weight πold / μ, μ being the engine's log-probs of the version that
sampled (loss.py). On a diagnostics step
of an MoE model, routing drift as the GSPO paper counts it: per layer, the share of the
first mini-batch's activated experts that its one update changed, measured by a forward that
routes freely (with algorithm.routingReplay the updates' forwards replay πold's experts, and
the drift is then the router's, not the one the updates ran with).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo_api.spec import AlgorithmConfig
from gspo_trainer.engine import score_with_head
from gspo_trainer.loss import LEVEL_OF, LossOptions
from gspo_trainer.step.batch import Packed
from gspo_trainer.step.old_policy import OldPolicy
from gspo_trainer.step.plan import MiniBatch
from gspo_trainer.step.policy import Policy, per_layer

if TYPE_CHECKING:
    import torch

# Stats reported as the largest over micro-batches (and ranks), not as a mean.
MAX_STATS = ("importance_weight_max",)
# Loss stats summed into the step's (mean over its mini-batches); the behaviour weights'
# only when off-policy.
LOSS_STATS = ("loss", "clip_fraction_low", "clip_fraction_high", "log_ratio_abs", "kl")
IMPORTANCE_STATS = ("importance_weight_mean", "importance_truncated_fraction")


@dataclass
class UpdateStats:
    sums: dict[str, float] = field(default_factory=dict)  # summed over mini-batches
    maxima: dict[str, float] = field(default_factory=dict)
    grad_norm: float | None = None
    drift: list[float] | None = None  # per MoE layer; None when not measured
    # Per MoE layer, the first mini-batch's experts as its update's forward chose them, when
    # that forward stood in for πold's (first_from_update); [] otherwise.
    experts: list[torch.Tensor] = field(default_factory=list)
    positions: int = 0  # token positions the updates' forwards ran (padding included)
    tokens: int = 0  # real tokens among them

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def local(self, mini_batches: int) -> dict[str, float]:
        """This rank's step stats: means over the mini-batches, clip_fraction their sum."""
        out = {key: value / mini_batches for key, value in self.sums.items()}
        out["clip_fraction"] = out["clip_fraction_low"] + out["clip_fraction_high"]
        return out


def update(
    policy: Policy,
    packed: Packed,
    plan: list[MiniBatch],
    old: OldPolicy,
    advantages: torch.Tensor,
    alg: AlgorithmConfig,
    *,
    aux_coef: float,
    behaviour: bool,
    diagnose: bool,
) -> UpdateStats:
    import torch

    from gspo_trainer.moe import router_aux_loss

    out = UpdateStats()
    sums: dict[str, torch.Tensor] = {}  # on the device, read once at the end (`_read`)
    maxima: dict[str, torch.Tensor] = {}
    options = loss_options(alg, behaviour=behaviour)
    engine = policy.engine
    chosen = []
    for k, mb in enumerate(plan):
        # This forward is also πold's (first_from_update): its router logits give the
        # experts the first mini-batch chose, as πold's forward would have recorded them.
        own = k == 0 and old.logp[0] is None and policy.moe is not None
        for j, sub in enumerate(mb.micro):
            here, share = mb.local(sub), mb.share(sub)
            fwd = policy.forward(packed, sub, router=aux_coef > 0 or own, routing="replay")
            if own and fwd.router is not None:
                with torch.no_grad():
                    chosen.append(policy.experts(packed, sub, fwd))
            out.positions, out.tokens = out.positions + fwd.positions, out.tokens + fwd.tokens
            mask, targets = fwd.mask(packed, sub), fwd.targets(packed, sub)
            ref = old.ref[k][here, : fwd.L - 1] if old.ref is not None else None
            mu = packed.engine_logp[sub, : fwd.L - 1] if behaviour else None
            adv = advantages[sub] if advantages.dim() == 1 else advantages[sub, : fwd.L - 1]
            first = old.logp[k]  # None: this forward's own log-probs (first_from_update)
            old_logp = first[here, : fwd.L - 1] if first is not None else None
            loss, stats, scores = score_with_head(
                policy.module,
                _fused,
                fwd.hidden,
                targets,
                mask,
                old_logp,
                adv,
                options,
                ref,
                mu,
                alg.temperature,
                policy.chunk_tokens,
            )
            if fwd.router is not None and policy.moe and aux_coef > 0:
                token_mask = policy.token_mask(packed, sub, fwd.L)
                aux = router_aux_loss(fwd.router, token_mask, *policy.moe)
                loss = loss + aux_coef * aux
                _add(sums, "router_aux_loss", share * aux.detach())
            # DeepSpeed steps the optimizer only after the mini-batch's last micro-batch.
            engine.set_gradient_accumulation_boundary(j == len(mb.micro) - 1)
            engine.backward(loss * share)
            engine.step()
            for key in LOSS_STATS + (IMPORTANCE_STATS if behaviour else ()):
                if key in stats:
                    _add(sums, key, share * stats[key].float())
                else:
                    out.add(key, 0.0)
            for key in MAX_STATS if behaviour else ():
                v = stats[key].float()
                maxima[key] = v if key not in maxima else torch.maximum(maxima[key], v)
            if scores.entropy is not None:  # mean over the response tokens, 0 without any
                ent = (scores.entropy * mask).sum() / mask.sum().clamp(min=1)
                _add(sums, "entropy", share * ent)
        if k == 0 and diagnose and old.experts:
            out.drift = routing_drift_after(policy, packed, mb, old.experts)
    if chosen:
        out.experts = per_layer(chosen)
    read = _read(
        {
            **{("sum", k): v for k, v in sums.items()},
            **{("max", k): v for k, v in maxima.items()},
            ("grad_norm", ""): engine.get_global_grad_norm(),
        }
    )
    for (kind, key), value in read.items():
        if kind == "grad_norm":
            out.grad_norm = value
        elif value is None:  # the sums and maxima are tensors
            raise TypeError(f"{kind} {key} is None")
        elif kind == "sum":
            out.add(key, value)
        else:
            out.maxima[key] = value
    return out


def loss_options(alg: AlgorithmConfig, *, behaviour: bool) -> LossOptions:
    """The spec's objective as the loss takes it; `behaviour`: rollouts an older policy
    sampled, whose importance weight the loss caps at algorithm.importanceWeightCap."""
    if alg.clip_low is None or alg.clip_high is None:  # set by the spec's level defaults
        raise ValueError("algorithm.clipLow and clipHigh are unset: validate the spec first")
    return LossOptions(
        LEVEL_OF[alg.loss_level],
        alg.clip_low,
        alg.clip_high,
        kl_coef=alg.kl_coef,
        is_cap=alg.importance_weight_cap if behaviour else None,
        entropy_coef=alg.entropy_coef,
    )


def _add(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    sums[key] = value if key not in sums else sums[key] + value


def _read(values: dict[Any, Any]) -> dict[Any, float | None]:
    """`values` (0-dim tensors, numbers or None) as floats, the tensors read from the device
    in one transfer: each read on its own would wait for the device again."""
    import torch

    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: None if v is None else float(v) for k, v in values.items() if k not in keys}
    if keys:
        device = values[keys[0]].device
        stacked = torch.stack([values[k].detach().float().reshape(()).to(device) for k in keys])
        out.update(zip(keys, stacked.tolist(), strict=True))
    return out


def routing_drift_after(
    policy: Policy, packed: Packed, mb: MiniBatch, old_experts: list[torch.Tensor]
) -> list[float]:
    """Per MoE layer, the share of the mini-batch's activated experts (under πold) that the
    policy no longer activates."""
    import torch

    from gspo_trainer.moe import routing_drift

    with torch.no_grad():
        chosen = [
            policy.experts(packed, sub, policy.forward(packed, sub, router=True))
            for sub in mb.micro
        ]
    return routing_drift(old_experts, per_layer(chosen))


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    options: LossOptions,
    ref_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
) -> Any:
    from gspo_trainer.fused_loss import policy_loss_from_hidden

    return policy_loss_from_hidden(
        hidden,
        weight,
        targets,
        mask,
        old_logp,
        advantages,
        options,
        ref_logprobs=ref_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        temperature=temperature,
        chunk_size=chunk_size,
    )
