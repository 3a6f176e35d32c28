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

    # Masked by weights, not by indexing: a boolean index sizes its result from the mask,
    # which on a GPU waits for the device once per layer.
    w = mask.reshape(-1).float()  # (N,)
    count = torch.zeros(num_experts, device=w.device)
    prob = torch.zeros(num_experts, device=w.device)
    for logits in router_logits:
        probs = logits.float().softmax(-1)  # (N, E)
        chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
        count = count.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob = prob + (probs * w[:, None]).sum(0)
    rows = (w.sum() * len(router_logits)).clamp(min=1)  # no masked token: count = prob = 0
    return num_experts * ((count / rows) * (prob / rows)).sum()


def top_k_experts(router_logits, top_k: int) -> list[torch.Tensor]:
    """Per layer, the sorted top-k expert ids of every position: (N, k) int64. Every position,
    masked or not: selecting the scored ones waits for the device, so the caller does it once
    for many forwards."""
    return [lg.detach().topk(top_k, dim=-1).indices.sort(-1).values for lg in router_logits]


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
