"""Routing Replay (Zheng et al. 2025, "Group Sequence Policy Optimization", §5.3): the update's
forward routes each token to the experts the πold forward chose for it.

The paper's GRPO baseline needs it on MoE models: after an update about a tenth of a token's
activated experts change, so a token's ratio πθ/πold compares two different networks and
swings. Replaying πold's experts keeps the network the same; the gate weights still come from
the current router (softmax of its logits, restricted to the recorded experts and normalised
as the model's own top-k is), so the router keeps learning.

A thin adapter on the model's router modules (transformers' `*TopKRouter`, which return
`(logits, scores, indices)` and whose sparse block runs the experts from `scores, indices`):
a forward hook that, when recording, copies the chosen indices out, and when replaying,
returns the recorded indices with recomputed scores. The loss code never sees it.

The record is kept per token of the step's batch, not per forward: each token of `Packed`
has one slot (row r's position p at `offset[r] + p`), and every forward says where each of
its router's rows goes (`slots`). So a micro-batch runs packed or padded, in any rows, and
replays what its tokens chose in πold, whatever micro-batch recorded them. Rows that are not
a real token (padding, a packed row's filler tail) go to one spare slot, never read back.

The state stays set after a forward, until the next: gradient checkpointing runs each layer's
forward again inside `backward`, and that recompute must route the same way. Under DeepSpeed
the hooks sit on the very router modules the engine runs (ZeRO-3 gathers an MoE block whole,
the router with it, before the hook reads the router's output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from gspo_api.validation import ConfigError

if TYPE_CHECKING:
    import torch

    from gspo_trainer.step.batch import Packed

Mode = Literal["record", "replay"]

# Routers that softmax their logits, take the top-k and (always, or with the config's
# norm_topk_prob) renormalise the k probabilities; transformers 5's modeling_<model>.py.
SOFTMAX_TOP_K_ROUTERS = frozenset(
    {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"}
)


def find_routers(module: Any) -> list[Any]:
    """The router modules of `module`, in layer order; [] for a dense model. ConfigError naming
    spec.algorithm.routingReplay for a mixture of experts whose router this does not know."""
    routers = [m for m in module.modules() if type(m).__name__ in SOFTMAX_TOP_K_ROUTERS]
    config = getattr(module, "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts and not routers:
        raise ConfigError(
            f"spec.algorithm.routingReplay: {type(module).__name__} has experts but no router "
            f"this learner can replay (it knows {', '.join(sorted(SOFTMAX_TOP_K_ROUTERS))}); "
            "set it to false"
        )
    return routers


def replay_scores(logits: torch.Tensor, chosen: torch.Tensor, normalise: bool) -> torch.Tensor:
    """The gate weights of the experts `chosen` (N, k) under router `logits` (N, E): their
    softmax probabilities, divided by their sum when the router normalises its top-k
    (norm_topk_prob), as the router computes them for its own choice. (N, k) float32."""
    probs = logits.float().softmax(-1)  # (N, E)
    scores = probs.gather(1, chosen)  # (N, k)
    return scores / scores.sum(-1, keepdim=True) if normalise else scores


class RoutingReplay:
    """Records the experts each token of a step chose in πold and replays them in the updates.

    `forward_slots` is called by the policy's forward before it runs the model; `end` turns the
    hooks off for forwards that must route freely (routing drift is measured that way)."""

    def __init__(self, module: Any) -> None:
        self.routers = find_routers(module)
        if not self.routers:
            raise ConfigError(
                f"spec.algorithm.routingReplay: {type(module).__name__} has no experts (a "
                "dense model routes nothing); set it to false or use a mixture-of-experts model"
            )
        self.top_k = int(self.routers[0].top_k)
        self.mode: Mode | None = None
        self.slots: torch.Tensor | None = None  # (rows,) each router row's slot, this forward
        self.batch: torch.Tensor | None = None  # the recorded step's Packed.ids
        self.store: list[torch.Tensor] = []  # per router, (tokens + 1, k) expert ids
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def forward_slots(self, mode: Mode | None, packed: Packed, slots: torch.Tensor | None) -> None:
        """Route the next forward (and its recompute in backward) by `mode`: record into the
        record of `packed` (a new one for a new batch), replay from it, or neither (None).
        `slots`: each row the router sees, its slot (`token_slots`)."""
        import torch

        self.mode, self.slots = mode, slots
        if mode == "record" and self.batch is not packed.ids:
            tokens = sum(packed.seq_lengths)
            # distinct ids in a never-written slot: a row of the same expert k times is legal
            # but costs the expert twice
            init = torch.arange(self.top_k, dtype=torch.int16, device=packed.ids.device)
            self.store = [init.repeat(tokens + 1, 1) for _ in self.routers]
            self.batch = packed.ids
        elif mode == "replay" and self.batch is not packed.ids:
            raise RuntimeError("routing replay: no πold forward recorded this batch's experts")

    def end(self) -> None:
        self.mode = self.slots = None

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            if self.mode is None:
                return None
            logits, scores, indices = output  # (N, E), (N, k), (N, k)
            slots = self.slots
            if slots is None or slots.shape[0] != logits.shape[0]:
                raise RuntimeError(
                    f"routing replay: router {layer} routed {logits.shape[0]} rows, the forward "
                    f"declared {None if slots is None else slots.shape[0]}"
                )
            store = self.store[layer]
            if self.mode == "record":
                store.index_copy_(0, slots, indices.to(store.dtype))
                return None
            chosen = store.index_select(0, slots).to(indices.dtype)  # (N, k)
            normalise = getattr(module, "norm_topk_prob", True)  # Mixtral's always does
            return logits, replay_scores(logits, chosen, normalise).to(scores.dtype), chosen

        return hook


def token_slots(seq_lengths: tuple[int, ...], rows: slice, width: int) -> torch.Tensor:
    """(n*width,) the slot of each position of `rows` laid out padded to `width`: row r's
    position p < seq_lengths[r] at sum(seq_lengths[:r]) + p, every other position at the spare
    slot sum(seq_lengths). On the host."""
    import torch

    spare = sum(seq_lengths)
    start = sum(seq_lengths[: rows.start])
    lengths = torch.tensor(seq_lengths[rows])  # (n,)
    offsets = start + torch.cumsum(lengths, 0) - lengths  # (n,)
    pos = torch.arange(width)  # (width,)
    slots = offsets[:, None] + pos[None, :]  # (n, width)
    return torch.where(pos[None, :] < lengths[:, None], slots, spare).reshape(-1)
