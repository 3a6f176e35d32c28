"""Tiny random models and a tokenizer the project builds itself, for tests and `gspo train`.

Nothing is downloaded: the tokenizer is a character-level WordLevel vocabulary made with the
`tokenizers` library, the models come from transformers configs with random weights. Both
are saved as an ordinary HF directory, so the learner and vLLM load them with the same code
that loads a real model from a path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from gspo_api.model_shape import TINY_KINDS, tiny_config_fields
from gspo_trainer.deepspeed_import import import_deepspeed

# The built-in arithmetic task needs only these characters; a small vocabulary keeps the
# random policy's chance of a well-formed answer high enough for the reward to move.
ARITHMETIC_ALPHABET = "0123456789+="
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
# TINY_KINDS: name -> architecture, width, layers, experts. `tiny` (hidden 64, ~0.1M
# parameters) is what tests train: cheapest per step. `small` (hidden 128, ~0.5M) is the
# embedded default's: on the built-in addition task it reaches a given greedy accuracy in
# about a third of tiny's steps, at about 1.5x the cost of a step on CPU (BENCHMARKS.md).
# `tiny-qwen3-moe-16e` (hidden 64, 4 layers of 16 experts, 2 routed: ~0.84M) is the one whose
# routing drifts enough to measure. Their config fields live in gspo_api.model_shape, which the
# memory plan reads without transformers.


def build_tokenizer(alphabet: str = ARITHMETIC_ALPHABET) -> Any:
    """A character-level fast tokenizer: one token per character, plus pad/eos/unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, bos_token=None
    )


def tiny_config(
    kind: str,
    vocab_size: int,
    *,
    pad_id: int,
    eos_id: int,
    hidden: int = 64,
    layers: int = 2,
    experts: int = 4,
) -> Any:
    """A transformers config for a small Qwen3 (dense) or Qwen3-MoE model of width `hidden`
    (model_shape.tiny_config_fields says what it holds)."""
    from transformers import AutoConfig

    fields = tiny_config_fields(
        kind,
        vocab_size,
        pad_id=pad_id,
        eos_id=eos_id,
        hidden=hidden,
        layers=layers,
        experts=experts,
    )
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_tiny_model(name: str, *, seed: int = 0, alphabet: str = ARITHMETIC_ALPHABET) -> Any:
    """(model, tokenizer) with random weights, deterministic for a given seed."""
    import torch
    from transformers import AutoModelForCausalLM

    if name not in TINY_KINDS:
        raise ValueError(f"unknown built-in model {name!r}; use one of {sorted(TINY_KINDS)}")
    tokenizer = build_tokenizer(alphabet)
    tiny = TINY_KINDS[name]
    config = tiny_config(
        tiny.kind,
        len(tokenizer),
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        hidden=tiny.hidden,
        layers=tiny.layers,
        experts=tiny.experts,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, tokenizer


def materialize(
    name: str,
    root: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    alphabet: str = ARITHMETIC_ALPHABET,
) -> Path:
    """Save a built-in tiny model and tokenizer to a directory once; return its path.

    The directory is keyed by name, seed and alphabet, written aside and renamed, so
    concurrent callers (the learner and several rollout servers) never see half a model.
    """
    default = os.environ.get("GSPO_CACHE", Path.home() / ".cache" / "gspo")
    root_path = Path(root) if root else Path(default)
    key = hashlib.sha256(json.dumps([name, seed, alphabet]).encode()).hexdigest()[:12]
    target = root_path / f"{name.removeprefix('builtin:')}-{key}"
    if (target / "config.json").exists():
        return target
    tmp = root_path / f".{target.name}.{os.getpid()}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny_model(name, seed=seed, alphabet=alphabet)
    # save_pretrained imports DeepSpeed through accelerate's unwrapping where both are
    # installed (a rollout image has neither): first here, without mlflow.
    if importlib.util.find_spec("deepspeed") and importlib.util.find_spec("accelerate"):
        import_deepspeed()
    # transformers writes a model only on torch.distributed rank 0 once a group exists; every
    # learner pod builds its own copy on its own disk (a cluster's pods share no home), so
    # every rank must write one.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
