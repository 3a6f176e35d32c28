"""The router load-balancing loss is transformers' own formula (the oracle), masked tokens
left out, so routerAuxLossCoef weighs what a model's router_aux_loss_coef weighs."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from gspo_trainer.moe import router_aux_loss


@pytest.mark.parametrize(("experts", "top_k"), [(4, 2), (8, 1), (16, 4)])
def test_equals_transformers_load_balancing_loss(experts: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(experts * 10 + top_k)
    batch, seq = 3, 5
    logits = tuple(torch.randn(batch * seq, experts, generator=g) for _ in range(2))
    mask = torch.rand(batch, seq, generator=g) > 0.3
    ours = router_aux_loss(logits, mask.reshape(-1), experts, top_k)
    theirs = load_balancing_loss_func(logits, experts, top_k, attention_mask=mask.long())
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)


def test_a_uniform_router_scores_top_k() -> None:
    """f_e sums to k over experts and P_e = 1/E: E * sum f_e / E = k."""
    logits = (torch.zeros(6, 8),)
    loss = router_aux_loss(logits, torch.ones(6, dtype=torch.bool), 8, 2)
    assert float(loss) == pytest.approx(2.0)
