"""A model's architecture from its config.json alone: parameter counts per layer, attention and
key/value shapes, experts. No weights, no torch, no transformers, so the operator can read it.

Where a config.json comes from (`find_model_config`), first found wins:
1. a built-in model (`builtin:tiny-qwen3`...): the fields `tiny.py` builds it from;
2. a local directory holding config.json;
3. the Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub):
   the snapshot the revision (default main) points at;
4. the config fields of the models the examples name, shipped in `model_configs/` (written
   from the models' published config.json; architecture fields only).
A Hub name found in none of them has no shape here: callers say so and go on.

Counted as transformers builds Qwen2/Qwen3 (dense and MoE), Llama and Mixtral: attention
q/k/v/o (biases where the config has them, Qwen3's per-head q/k norms), a SwiGLU MLP or a
sparse block of `num_experts` SwiGLU experts with its router (and Qwen2-MoE's shared expert),
two RMSNorms per layer, embeddings and an untied or tied head.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

PACKAGED = Path(__file__).with_name("model_configs")


class TinyKind(NamedTuple):
    """A built-in random model's architecture (tiny.py builds it)."""

    kind: str  # "qwen3" or "qwen3_moe"
    hidden: int
    layers: int = 2
    experts: int = 4  # routed experts per layer, 2 of them per token (MoE kinds only)


# name -> shape: the built-in random models. The 16-expert one has routing that can drift
# (with 4 experts of which 2 route, almost any choice overlaps the last one).
TINY_KINDS = {
    "builtin:tiny-qwen3-moe": TinyKind("qwen3_moe", 64),
    "builtin:tiny-qwen3": TinyKind("qwen3", 64),
    "builtin:small-qwen3-moe": TinyKind("qwen3_moe", 128),
    "builtin:small-qwen3": TinyKind("qwen3", 128),
    "builtin:tiny-qwen3-moe-16e": TinyKind("qwen3_moe", 64, layers=4, experts=16),
}
TINY_HEAD_DIM = 32
TINY_VOCAB = 15  # tiny.build_tokenizer(): pad, eos, unk and the 12 characters of "0123456789+="


def tiny_config_fields(
    kind: str,
    vocab_size: int,
    *,
    pad_id: int,
    eos_id: int,
    hidden: int = 64,
    layers: int = 2,
    experts: int = 4,
) -> dict[str, Any]:
    """The config.json fields of a small Qwen3 (dense) or Qwen3-MoE model of width `hidden`
    (a multiple of 64) and `layers` layers: heads of 32, one key/value head per two query
    heads, MLPs twice as wide as the model, `experts` experts of the model's width with 2
    routed per token in every layer."""
    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64, got {hidden}")
    if kind not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of ['qwen3', 'qwen3_moe']")
    fields: dict[str, Any] = dict(
        model_type=kind,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // TINY_HEAD_DIM,
        num_key_value_heads=hidden // (2 * TINY_HEAD_DIM),
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        torch_dtype="float32",
    )
    if kind == "qwen3_moe":
        fields.update(
            moe_intermediate_size=hidden,
            num_experts=experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    return fields


class ModelConfigError(ValueError):
    """A config.json this module cannot read a shape from; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of an architecture (counts of elements, not bytes)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense layer's MLP width
    experts: int = 0  # routed experts of a sparse layer (0: dense model)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0  # Qwen2-MoE's always-on expert
    sparse_layers: int = 0  # layers whose MLP is the sparse block
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape of a transformers config.json (a dict); ModelConfigError naming the
        missing field."""

        def need(*keys: str) -> int:
            for key in keys:
                if isinstance(config.get(key), int):
                    return int(config[key])
            raise ModelConfigError(f"config.json has no {' or '.join(keys)} (an integer)")

        hidden, layers, heads = (
            need("hidden_size"),
            need("num_hidden_layers"),
            need("num_attention_heads"),
        )
        model_type = str(config.get("model_type", ""))
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        sparse = 0
        if experts:
            step = int(config.get("decoder_sparse_step") or 1)
            dense_only = set(config.get("mlp_only_layers") or [])
            sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        intermediate = need("intermediate_size")
        return cls(
            vocab=need("vocab_size"),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate=intermediate,
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0),
            # Mixtral's experts are intermediate_size wide; Qwen's moe_intermediate_size.
            expert_intermediate=int(config.get("moe_intermediate_size") or intermediate),
            shared_expert_intermediate=int(config.get("shared_expert_intermediate_size") or 0),
            sparse_layers=sparse,
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
            qk_norm=model_type.startswith("qwen3"),
        )

    # --- parameters (elements) ---------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = self.hidden * (q + 2 * kv) + q * self.hidden
        out += (q + 2 * kv) if self.qkv_bias else 0
        out += 2 * self.head_dim if self.qk_norm else 0
        return out + 2 * self.hidden  # the layer's two RMSNorms

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def sparse_mlp_params(self) -> int:
        experts = self.experts * 3 * self.hidden * self.expert_intermediate
        shared = 3 * self.hidden * self.shared_expert_intermediate
        shared += self.hidden if self.shared_expert_intermediate else 0  # its gate
        return experts + shared + self.hidden * self.experts  # + the router

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        dense_layers = self.layers - self.sparse_layers
        body = self.layers * self.attention_params + dense_layers * self.dense_mlp_params
        body += self.sparse_layers * self.sparse_mlp_params
        heads = self.embedding_params * (1 if self.tied else 2)
        return body + heads + self.hidden  # the final norm

    @property
    def largest_layer_params(self) -> int:
        """The most parameters ZeRO-3 gathers at once: a decoder layer (its sparse block is one
        leaf module, gathered whole), or the embeddings / head."""
        mlp = self.sparse_mlp_params if self.sparse_layers else self.dense_mlp_params
        return max(self.attention_params + mlp, self.embedding_params)


def find_model_config(name: str, revision: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(config.json as a dict, where it was found) for model `name`, or None (see the module
    docstring for the order). A file that is there but not JSON raises ModelConfigError."""
    if name in TINY_KINDS:
        tiny = TINY_KINDS[name]
        fields = tiny_config_fields(
            tiny.kind,
            TINY_VOCAB,
            pad_id=0,
            eos_id=1,
            hidden=tiny.hidden,
            layers=tiny.layers,
            experts=tiny.experts,
        )
        return fields, "built in"
    for candidate in (
        Path(name) / "config.json",
        _cached_config(name, revision),
        PACKAGED / f"{name.replace('/', '--')}.json",
    ):
        if candidate is not None and candidate.is_file():
            try:
                return json.loads(candidate.read_text(encoding="utf-8")), str(candidate)
            except (OSError, ValueError) as exc:
                raise ModelConfigError(f"{candidate}: not a readable config.json ({exc})") from exc
    return None


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def _cached_config(name: str, revision: str | None) -> Path | None:
    """The cached config.json of Hub model `name` at `revision` (a ref such as main, or a
    commit), as huggingface_hub lays out its cache: models--org--name/refs/<ref> holds the
    commit, snapshots/<commit>/ the files."""
    if name.count("/") != 1 or name.startswith(("/", ".")):
        return None
    repo = hub_cache_dir() / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / (revision or "main")
    try:
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    except OSError:
        return None
    return repo / "snapshots" / commit / "config.json" if commit else None
