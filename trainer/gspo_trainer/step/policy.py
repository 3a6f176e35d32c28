"""The learner's model as the stages use it: final hidden states (and router logits) of some
rows, the token mask router logits are laid out by, and the frozen KL reference.

Log-probs and the loss are computed from hidden states through the lm_head (`score_with_head`
gathers its weight under ZeRO-3), so the full (rows, L, vocabulary) logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gspo_trainer.engine import begin_forward
from gspo_trainer.moe import MoEShape
from gspo_trainer.step.batch import Packed

if TYPE_CHECKING:
    import torch


@dataclass
class Forward:
    hidden: torch.Tensor  # (n, L-1, H) final hidden states, row t predicting targets[:, t]
    L: int  # the rows' length (the longest of them)
    router: Any  # tuple of (n*L, E) router logits per MoE layer, or None

    def mask(self, packed: Packed, rows: slice) -> torch.Tensor:
        return packed.mask[rows, : self.L - 1]  # (n, L-1)

    def targets(self, packed: Packed, rows: slice) -> torch.Tensor:
        return packed.targets[rows, : self.L - 1]  # (n, L-1)


@dataclass
class Policy:
    engine: Any  # the DeepSpeed engine training the policy
    moe: MoEShape | None  # None: dense, or model.moe unset
    reference: Any = None  # the frozen starting policy (algorithm.klCoef > 0), else None

    @property
    def module(self) -> Any:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        """Where DeepSpeed put the model (cuda:local_rank on GPUs): every tensor the forward,
        the loss and the collectives read goes there."""
        return self.engine.device

    def forward(self, packed: Packed, rows: slice, *, router: bool, model: Any = None) -> Forward:
        """The policy's (or `model`'s) forward over `rows`, cut to their own length."""
        module = model
        if module is None:
            begin_forward(self.engine)
            module = self.engine.module
        attn = packed.attn[rows]
        L = int(attn.sum(-1).max())
        base = getattr(module, module.base_model_prefix)
        kw = {"output_router_logits": True} if (router and self.moe) else {}
        out = base(input_ids=packed.ids[rows, :L], attention_mask=attn[:, :L], **kw)
        return Forward(out.last_hidden_state[:, : L - 1], L, getattr(out, "router_logits", None))

    def token_mask(self, packed: Packed, rows: slice, L: int) -> torch.Tensor:
        """(n*L,) True at response-token positions, the layout of router logits."""
        import torch

        m = packed.mask[rows, : L - 1]
        return torch.cat([torch.zeros_like(m[:, :1]), m], 1).reshape(-1)

    def experts(self, packed: Packed, rows: slice, fwd: Forward) -> list[torch.Tensor]:
        """Per MoE layer, the top-k experts each response token of `rows` chose."""
        from gspo_trainer.moe import top_k_experts

        assert self.moe is not None
        return top_k_experts(fwd.router, self.token_mask(packed, rows, fwd.L), self.moe.top_k)


def per_layer(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-layer expert choices of several micro-batches, joined per layer."""
    import torch

    return [torch.cat(layer) for layer in zip(*parts, strict=True)]
