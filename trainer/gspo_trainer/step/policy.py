"""The learner's model as the stages use it: final hidden states (and router logits) of some
rows, the token mask router logits are laid out by, and the frozen KL reference. The rows run
padded or, with learner.packSequences, packed without padding (`Policy.forward`); either way
the stages read the same padded layout.

Log-probs and the loss are computed from hidden states through the lm_head (`score_with_head`
gathers its weight under ZeRO-3), so the full (rows, L, vocabulary) logits never exist.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gspo_trainer.engine import begin_forward
from gspo_trainer.moe import MoEShape
from gspo_trainer.step.batch import Packed
from gspo_trainer.step.routing_replay import Mode, RoutingReplay, token_slots

if TYPE_CHECKING:
    import torch


@dataclass
class Forward:
    hidden: torch.Tensor  # (n, L-1, H) final hidden states, row t predicting targets[:, t]
    L: int  # the rows' length (the longest of them)
    router: Any  # tuple of (n*L, E) router logits per MoE layer, or None
    positions: int = 0  # token positions the model ran (n*L padded, the real tokens packed)
    tokens: int = 0  # real tokens among them (the rows' lengths, summed)

    def mask(self, packed: Packed, rows: slice) -> torch.Tensor:
        return packed.mask[rows, : self.L - 1]  # (n, L-1)

    def targets(self, packed: Packed, rows: slice) -> torch.Tensor:
        return packed.targets[rows, : self.L - 1]  # (n, L-1)


# Attention implementations that keep sequences packed into one row apart by their position
# ids: eager, sdpa and flex through masking_utils' packed-sequence mask, flash attention
# through its varlen kernel (cu_seqlens from the position ids).
PACKABLE_ATTENTION = frozenset(
    {
        "eager",
        "sdpa",
        "flex_attention",
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
    }
)
# Those among them whose cost follows the sequences, not the row: flash attention's varlen
# kernel, flex attention's block mask (it skips the blocks the mask empties). A micro-batch
# runs with them as one row of its real tokens. eager and sdpa compute every (query, key)
# pair of a row, masked or not, so one row of T tokens would cost T^2 where the padded rows
# cost n * L^2: with them the sequences go into as few rows of the longest one's length as
# they fit (first fit, longest first), which never costs more than the padded rows.
ONE_ROW_ATTENTION = frozenset(
    {"flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)


def can_pack(module: Any) -> bool:
    """Whether `module` (a transformers causal LM) keeps sequences packed into one row from
    attending to each other when given position ids restarting at 0 per sequence and no
    attention mask. It does when its base model takes `position_ids` and builds its mask with
    transformers' `masking_utils.create_causal_mask` (which, with no attention mask and no
    cache, finds the sequences with `find_packed_sequence_indices` and adds the block-diagonal
    `packed_sequence_mask_function`; the sliding-window mask likewise), under an attention
    implementation of PACKABLE_ATTENTION (flash attention ignores that mask and runs varlen
    from the position ids: `_flash_attention_forward` -> `_is_packed_sequence` ->
    `prepare_fa_kwargs_from_position_ids`). Qwen3, Qwen3-MoE, Qwen2(-MoE), Mixtral, Mistral
    and Llama in transformers 5 do. Anything else (remote code with its own mask, another
    attention kernel) is run padded."""
    base = getattr(module, getattr(module, "base_model_prefix", ""), None)
    if base is None:
        return False
    impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
    # A class is hashable; mypy checks type[...] against Hashable through its metaclass.
    return impl in PACKABLE_ATTENTION and _masks_packed(type(base))  # type: ignore[arg-type]


@functools.cache
def _masks_packed(cls: type[Any]) -> bool:
    import inspect
    import sys

    from transformers import masking_utils

    if "position_ids" not in inspect.signature(cls.forward).parameters:
        return False
    defined_in = sys.modules.get(cls.__module__)
    return getattr(defined_in, "create_causal_mask", None) is masking_utils.create_causal_mask


@dataclass
class Policy:
    engine: Any  # the DeepSpeed engine training the policy
    moe: MoEShape | None  # None: dense, or model.moe unset
    reference: Any = None  # the frozen starting policy (algorithm.klCoef > 0), else None
    pack: bool = True  # learner.packSequences: run each micro-batch packed when the model can
    attention: str | None = None  # model.attnImplementation; None: as the model was loaded
    replay: RoutingReplay | None = None  # algorithm.routingReplay: on the policy's routers

    def __post_init__(self) -> None:
        if self.attention is not None:
            for model in (self.module, self.reference):
                if model is not None:
                    set_attention(model, self.attention)

    @property
    def module(self) -> Any:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        """Where DeepSpeed put the model (cuda:local_rank on GPUs): every tensor the forward,
        the loss and the collectives read goes there."""
        return self.engine.device

    @functools.cached_property
    def chunk_tokens(self) -> int:
        """Tokens per chunk of the log-prob and loss computations (logprobs.chunk_tokens):
        a few hundred on a CPU, thousands on a GPU."""
        from gspo_trainer.logprobs import device_chunk_tokens

        return device_chunk_tokens(self.device, int(self.module.config.vocab_size))

    def packs(self, model: Any = None) -> bool:
        """Whether forwards of the policy (or `model`) run packed: packSequences on and a
        model that keeps packed sequences apart (`can_pack`)."""
        return self.pack and can_pack(self.module if model is None else model)

    def forward(
        self,
        packed: Packed,
        rows: slice,
        *,
        router: bool,
        model: Any = None,
        routing: Mode | None = None,
    ) -> Forward:
        """The policy's (or `model`'s: the KL reference) forward over `rows`, cut to their own
        length. Padded, the rows run right-padded to the longest with an attention mask.
        Packed (`packs`), the sequences run without padding (`pack_rows`): as one row of their
        real tokens under flash or flex attention, in as few rows of the longest one's length
        as they fit under sdpa or eager (ONE_ROW_ATTENTION says why), position ids restarting
        at 0 per sequence, no attention mask and no cache (with one, transformers does not
        look for packed sequences), so that transformers builds the block-diagonal causal mask
        (or runs flash attention varlen). The last hidden states and router logits are
        scattered back into the padded layout (zeros at padding; the scatter passes
        gradients), so everything downstream reads the same tensors either way.
        `routing` (with algorithm.routingReplay): the policy's forward records its experts
        (πold) or replays them (an update); any other forward of the policy routes freely."""
        module = model
        if module is None:
            begin_forward(self.engine)
            module = self.engine.module
        lengths = list(packed.seq_lengths[rows])  # on the host: no wait for the device
        L = max(lengths)
        base = getattr(module, module.base_model_prefix)
        kw = {"output_router_logits": True} if (router and self.moe) else {}
        n = rows.stop - rows.start
        replay = self.replay if model is None else None
        if replay is not None and routing is None:
            replay.end()
            replay = None
        if not self.packs(module):
            if replay is not None:
                slots = token_slots(packed.seq_lengths, rows, L).to(packed.ids.device)
                replay.forward_slots(routing, packed, slots)
            out = as_forward_of(
                module,
                base,
                input_ids=packed.ids[rows, :L],
                attention_mask=packed.attn[rows, :L],
                **kw,
            )
            return Forward(
                out.last_hidden_state[:, : L - 1],
                L,
                getattr(out, "router_logits", None),
                n * L,
                sum(lengths),
            )
        one_row = base.config._attn_implementation in ONE_ROW_ATTENTION
        ids, positions, src, dst = pack_rows(
            packed.ids[rows, :L], lengths, sum(lengths) if one_row else L
        )
        if replay is not None:  # each real token's slot, from the padded layout to the packed
            padded = token_slots(packed.seq_lengths, rows, L).to(dst.device)
            slots = padded.new_full((ids.numel(),), sum(packed.seq_lengths))
            replay.forward_slots(routing, packed, slots.index_copy(0, src, padded[dst]))
        out = as_forward_of(
            module, base, input_ids=ids, position_ids=positions, use_cache=False, **kw
        )

        def unpack(x: torch.Tensor) -> torch.Tensor:  # (k*W, D) -> (n*L, D), zeros at padding
            x = x.reshape(-1, x.shape[-1])[src]
            return x.new_zeros(n * L, x.shape[-1]).index_copy(0, dst, x)

        hidden = unpack(out.last_hidden_state).reshape(n, L, -1)[:, : L - 1]
        router_logits = getattr(out, "router_logits", None)
        if router_logits is not None:
            router_logits = tuple(unpack(r) for r in router_logits)
        return Forward(hidden, L, router_logits, ids.numel(), sum(lengths))

    def token_mask(self, packed: Packed, rows: slice, L: int) -> torch.Tensor:
        """(n*L,) True at response-token positions, the layout of router logits."""
        import torch

        m = packed.mask[rows, : L - 1]
        return torch.cat([torch.zeros_like(m[:, :1]), m], 1).reshape(-1)

    def experts(self, packed: Packed, rows: slice, fwd: Forward) -> Experts:
        """Per MoE layer, the top-k experts each position of `rows` chose, and which of the
        positions are response tokens (`per_layer` keeps those)."""
        from gspo_trainer.moe import top_k_experts

        assert self.moe is not None
        return Experts(
            top_k_experts(fwd.router, self.moe.top_k), self.token_mask(packed, rows, fwd.L)
        )


@dataclass
class Experts:
    chosen: list[torch.Tensor]  # per MoE layer, (n*L, k): every position's top-k experts
    mask: torch.Tensor  # (n*L,) True at response tokens


def set_attention(model: Any, impl: str) -> None:
    """Run `model` (a transformers model) with attention kernel `impl` (model.attnImplementation;
    preflight has checked that a flash kernel is installed). transformers checks it can
    dispatch to it; if not, the error names the field."""
    if getattr(model.config, "_attn_implementation", None) == impl:
        return
    try:
        model.set_attn_implementation(impl)
    except (ImportError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"spec.model.attnImplementation: {impl} cannot run here ({first}); use sdpa"
        ) from exc


def as_forward_of(top: Any, fn: Any, **kw: Any) -> Any:
    """fn(**kw) run as `top`'s forward: whatever is hooked onto the top module runs around it.
    Under ZeRO-3 that is DeepSpeed's start-of-forward pre-hook (runtime/zero/parameter_offload.py,
    `_start_of_forward_hook`), which calls the parameter coordinator's `reset_step`: the first
    call starts recording the order the layers are gathered in, the second freezes it
    (partitioned_param_coordinator.py, ZeRoTraceMode.COMPLETE) and from then on each layer's
    gather is prefetched while the one before computes. The learner wants the base model's
    hidden states, not the top module's logits; calling the base model directly skips that
    hook, the trace stays INVALID for good and every gather waits for itself."""
    own = top.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) stays
    # Set on the instance as a plain attribute: a module assigned as an attribute would
    # become a submodule named "forward".
    object.__setattr__(top, "forward", lambda **kwargs: fn(**kwargs))
    try:
        return top(**kw)
    finally:
        if own is None:
            object.__delattr__(top, "forward")
        else:
            object.__setattr__(top, "forward", own)


def pack_rows(ids: torch.Tensor, lengths: list[int], width: int) -> tuple[torch.Tensor, ...]:
    """The sequences of `ids` (n, L; row i's first lengths[i] tokens) packed into rows of
    `width` tokens: (ids, position_ids, src, dst), ids and position_ids (k, width), position
    ids restarting at 0 for each sequence; src and dst (T,) the places of the T real tokens
    in the packed (k*width) and the padded (n*L) layout, flattened. A sequence goes into the
    first row it fits, longest first (in order, all in one row, when `width` holds them all);
    a row's unused tail is a filler sequence of its own (positions from 0 again), which
    attends to nothing real and is never read."""
    import torch

    n, L = ids.shape
    order = range(n) if width >= sum(lengths) else sorted(range(n), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        b = next((b for b, u in enumerate(used) if u + lengths[i] <= width), len(bins))
        if b == len(bins):
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += lengths[i]
    device = ids.device
    out = torch.zeros(len(bins), width, dtype=ids.dtype, device=device)
    pos = torch.zeros(len(bins), width, dtype=torch.long)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            m = lengths[i]
            out[b, at : at + m] = ids[i, :m]
            pos[b, at : at + m] = torch.arange(m)
            src.append(torch.arange(b * width + at, b * width + at + m))
            dst.append(torch.arange(i * L, i * L + m))
            at += m
        pos[b, at:] = torch.arange(width - at)
    return (out, *(_to_device(t, device) for t in (pos, torch.cat(src), torch.cat(dst))))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory without blocking, as a copy from
    pageable memory waits for the work queued before it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def per_layer(parts: list[Experts]) -> list[torch.Tensor]:
    """Per MoE layer, the experts each response token of several micro-batches chose, (n, k),
    joined. One wait for the device for them all (where the response tokens are), not one per
    micro-batch and layer."""
    import torch

    at = torch.cat([p.mask for p in parts]).nonzero().squeeze(1)
    return [
        torch.cat(layer).index_select(0, at)
        for layer in zip(*(p.chosen for p in parts), strict=True)
    ]
