"""model.attnImplementation: the learner's attention kernel. sdpa and eager run packed
micro-batches in rows with a block-diagonal mask and agree; flash attention runs them as one
row of real tokens through its varlen kernel (cu_seqlens from the position ids) and no mask is
ever built. flash-attn cannot run on this CPU: a stand-in registered under transformers'
"flash_attention_2" name takes its place, computing what flash-attn's varlen kernel computes
(causal attention within each packed sequence, bounds from transformers' own
`prepare_fa_kwargs_from_position_ids`) without its kernels; it does not model flash-attn's
numerics (bf16 tiles, softmax rescaling)."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gspo_api.validation import SpecError, parse_spec
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.preflight import check_attention
from gspo_trainer.step.batch import pack
from gspo_trainer.step.policy import Policy


def tiny_model() -> Any:
    from transformers import AutoModelForCausalLM

    from gspo_trainer.tiny import build_tokenizer, tiny_config

    tok = build_tokenizer()
    config = tiny_config("qwen3_moe", len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def batch(vocab: int) -> Any:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (4 + i,), generator=g).tolist() for i in range(2)]
    responses = [torch.randint(3, vocab, (2 + 3 * i,), generator=g).tolist() for i in range(4)]
    return pack(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * 4, 2, 0)


def policy(model: Any, pack_rows: bool, attention: str | None = None) -> Policy:
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), optimizer=None)
    return Policy(engine, None, None, pack=pack_rows, attention=attention)


def hidden(p: Policy, packed: Any) -> torch.Tensor:
    with torch.no_grad():
        fwd = p.forward(packed, slice(0, 4), router=False)
    return torch.where(fwd.mask(packed, slice(0, 4))[..., None], fwd.hidden, 0)


def test_eager_and_sdpa_agree_packed_and_padded() -> None:
    model = tiny_model()
    packed = batch(model.config.vocab_size)
    padded = hidden(policy(model, False, "sdpa"), packed)
    sdpa = hidden(policy(model, True, "sdpa"), packed)
    eager = hidden(policy(model, True, "eager"), packed)
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(sdpa, padded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(eager, padded, rtol=1e-4, atol=1e-5)


def varlen_stand_in(seen: list[dict[str, Any]]) -> Any:
    """Causal attention within each sequence of one packed row, as flash-attn's varlen kernel
    computes it, the sequences' bounds from the position ids as transformers gives them to it."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    def attention(
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        **kw: Any,
    ) -> Any:
        seen.append({"mask": attention_mask, "rows": q.shape[0]})
        (cu, _), _ = prepare_fa_kwargs_from_position_ids(kw["position_ids"])
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for a, b in itertools.pairwise(bounds):
            out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scaling
            )
        return out.transpose(1, 2).contiguous(), None

    return attention


def test_flash_attention_runs_one_row_varlen_without_a_mask(monkeypatch) -> None:
    from transformers.modeling_utils import AttentionInterface

    seen: list[dict[str, Any]] = []
    monkeypatch.setitem(
        AttentionInterface._global_mapping, "flash_attention_2", varlen_stand_in(seen)
    )
    model = tiny_model()
    packed = batch(model.config.vocab_size)
    padded = hidden(policy(model, False), packed)
    # as set_attn_implementation would, past its check that flash-attn is installed
    model.config._attn_implementation_internal = "flash_attention_2"
    flash = hidden(policy(model, True), packed)
    assert seen and all(s["mask"] is None and s["rows"] == 1 for s in seen), seen
    torch.testing.assert_close(flash, padded, rtol=1e-4, atol=1e-5)


def spec_with(impl: str) -> Any:
    manifest = copy.deepcopy(tiny_manifest())
    manifest["spec"]["model"]["attnImplementation"] = impl
    return parse_spec(manifest["spec"])


def test_a_flash_kernel_that_is_not_installed_is_refused_naming_the_field(monkeypatch) -> None:
    problems = check_attention(spec_with("flash_attention_2"))
    assert [p.path for p in problems] == ["spec.model.attnImplementation"]
    assert "flash_attn" in problems[0].message and "sdpa" in problems[0].message
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    (problem,) = check_attention(spec_with("flash_attention_3"), cuda=False)
    assert "CUDA" in problem.message
    assert check_attention(spec_with("flash_attention_3"), cuda=True) == []
    assert check_attention(spec_with("sdpa")) == []


def test_an_unknown_kernel_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"spec\.model\.attnImplementation"):
        spec_with("flash")
