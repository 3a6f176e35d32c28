"""Mixture-of-experts bookkeeping from router logits: aux loss, expert load, routing drift.

Router logits come from a transformers MoE forward with `output_router_logits=True`: one
(B*L, E) tensor per MoE layer. Only positions where `mask` is set (the scored response
tokens) count. Pure torch; no model code here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class MoEShape(NamedTuple):
    experts: int  # routed experts per layer
    top_k: int  # experts each token activates


def moe_shape(config: Any) -> MoEShape | None:
    """The experts and top-k of a transformers MoE config (Qwen-MoE or Mixtral names); None
    if dense."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return MoEShape(int(experts), int(top_k)) if experts and top_k else None


def router_aux_loss(router_logits, mask: torch.Tensor, num_experts: int, top_k: int):
    """Switch-style load-balancing loss, E * sum_e f_e P_e over masked tokens and all layers,
    as transformers' `load_balancing_loss_func` (so model.moe.routerAuxLossCoef means what
    the model's own router_aux_loss_coef means): f_e counts the tokens that routed to e in
    any of their top-k slots per token, so f sums to k and a uniform router scores k.

    router_logits: tuple of (N, E); mask (N,) bool. Differentiable in the logits.
    """
    import torch

    m = mask.reshape(-1).bool()
    count = torch.zeros(num_experts, device=m.device)
    prob = torch.zeros(num_experts, device=m.device)
    rows = 0
    for logits in router_logits:
        probs = logits[m].float().softmax(-1)  # (n, E)
        chosen = probs.topk(top_k, dim=-1).indices  # (n, k)
        count = count + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        prob = prob + probs.sum(0)
        rows += probs.shape[0]
    if rows == 0:
        return prob.sum() * 0.0
    return num_experts * ((count / rows) * (prob / rows)).sum()


def top_k_experts(router_logits, mask: torch.Tensor, top_k: int) -> list[torch.Tensor]:
    """Per layer, the sorted top-k expert ids of each masked token: (n, k) int64."""
    m = mask.reshape(-1).bool()
    return [lg.detach()[m].topk(top_k, dim=-1).indices.sort(-1).values for lg in router_logits]


def expert_load(chosen: list[torch.Tensor], num_experts: int) -> dict[int, list[float]]:
    """layer -> share of routed (token, slot) pairs each expert received."""
    import torch

    out = {}
    for layer, ids in enumerate(chosen):
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts).float()
        out[layer] = (counts / counts.sum().clamp(min=1)).tolist()
    return out


def routing_drift(old: list[torch.Tensor], new: list[torch.Tensor]) -> list[float]:
    """Per MoE layer, the share of activated experts that changed between two forwards of the
    same tokens, as the GSPO paper counts it: of each token's k activated experts, those the
    second forward does not activate, over every token's k. old, new: per layer (n, k)."""
    out = []
    for a, b in zip(old, new, strict=True):
        if a.numel() == 0:
            out.append(0.0)
            continue
        kept = (a[:, :, None] == b[:, None, :]).any(-1)  # (n, k): still activated
        out.append(float(1.0 - kept.float().mean()))
    return out
