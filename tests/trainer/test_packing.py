"""learner.packSequences: a micro-batch's rows run as one row without padding (position ids
restarting per sequence, no attention mask), scattered back into the padded layout. The
packed forward equals the padded one at the real tokens, gradients included; a row never
sees the rows packed with it; micro-batches count real tokens; a learner step is the same
either way, and reports the padding it ran."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_helpers import make_learner, params, tiny_spec

from gspo_trainer.moe import moe_shape
from gspo_trainer.step import policy as policy_module
from gspo_trainer.step.batch import Packed, pack, token_micro_count, token_micro_slices
from gspo_trainer.step.plan import plan_step
from gspo_trainer.step.policy import Policy, can_pack, pack_rows
from gspo_trainer.tiny import build_tiny_model

VOCAB = 15  # the built-in tiny models' (character tokenizer); the others are built to match


def family(name: str) -> Any:
    """A small random model of a family the learner trains, float32, in eval mode (no
    dropout), with its config's use_cache left on (the packed path must turn the cache off:
    with one, transformers does not look for packed sequences)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    if name.startswith("builtin:"):
        return build_tiny_model(name)[0].eval()
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    config = {
        "llama": lambda: LlamaConfig(**common),
        "mixtral": lambda: MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common),
        "qwen2_moe": lambda: Qwen2MoeConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            **common,
        ),
    }[name]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


FAMILIES = ["builtin:tiny-qwen3", "builtin:tiny-qwen3-moe", "llama", "mixtral", "qwen2_moe"]


class _Engine:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.optimizer = None


def policy(model: Any, *, packing: bool) -> Policy:
    return Policy(_Engine(model), moe_shape(model.config), None, packing)


def batch(seed: int = 0, response_lengths: tuple[int, ...] = (3, 9, 1, 6, 12, 2)) -> Packed:
    """Rows of different lengths: prompts of 4 and 7 tokens, half the responses each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (4, 7)]
    responses = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in response_lengths]
    logps = [[0.0] * len(r) for r in responses]
    group = len(responses) // 2
    return pack(prompts, responses, logps, [0.0] * len(responses), group, pad_id=0)


def real(packed: Packed, rows: slice, L: int) -> torch.Tensor:
    """(n, L-1) True where hidden row t is a real token's (not padding)."""
    return packed.attn[rows, : L - 1].bool()


@pytest.fixture(params=["rows", "one-row"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the packed sequences are laid out: in rows of the longest one's length (sdpa and
    eager, these models' attention on CPU), or all in one row (flash and flex attention,
    forced here onto sdpa and eager: the same masks, from the same position ids)."""
    if request.param == "one-row":
        monkeypatch.setattr(policy_module, "ONE_ROW_ATTENTION", frozenset({"sdpa", "eager"}))
    return str(request.param)


def check_positions(fwd: Any, packed: Packed, rows: slice, layout: str) -> None:
    """What the packed forward ran: every real token once, and padding only at the end of
    rows of the longest sequence's length (none at all in one row)."""
    tokens = int(packed.attn[rows].sum())
    assert fwd.tokens == tokens
    if layout == "one-row":
        assert fwd.positions == tokens
    else:
        assert fwd.positions % fwd.L == 0 and tokens <= fwd.positions < fwd.L * (
            rows.stop - rows.start
        )


@pytest.mark.parametrize("name", FAMILIES)
def test_the_model_keeps_packed_sequences_apart(name: str) -> None:
    assert can_pack(family(name))


def test_rows_hold_the_sequences_that_fit_them_first_fit_longest_first() -> None:
    ids = torch.arange(1, 6 * 19 + 1).reshape(6, 19)
    lengths = [7, 13, 5, 13, 19, 9]
    out, pos, src, dst = pack_rows(ids, lengths, 19)
    assert out.shape == pos.shape == (4, 19)  # 19 | 13 + 5 | 13 | 9 + 7 (and 3 of filler)
    assert pos[1].tolist() == [*range(13), *range(5), 0]
    assert pos[3].tolist() == [*range(9), *range(7), 0, 1, 2]
    assert out.reshape(-1)[src].tolist() == ids.reshape(-1)[dst].tolist()
    assert sorted(dst.tolist()) == [i * 19 + j for i, m in enumerate(lengths) for j in range(m)]
    out, pos, src, dst = pack_rows(ids, lengths, sum(lengths))  # one row, in order
    assert out.shape == (1, 66) and dst.tolist() == sorted(dst.tolist())
    assert out[0].tolist() == [t for i, m in enumerate(lengths) for t in ids[i, :m].tolist()]


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_forward_equals_padded_with_its_gradients(name: str, layout: str) -> None:
    model = family(name)
    packed, rows = batch(), slice(0, 6)
    runs = {}
    for packing in (False, True):
        model.zero_grad()
        p = policy(model, packing=packing)
        fwd = p.forward(packed, rows, router=True)
        w = torch.randn(fwd.hidden.shape, generator=torch.Generator().manual_seed(1))
        keep = real(packed, rows, fwd.L)
        loss = (fwd.hidden * w)[keep].sum()
        router = None
        if p.moe is not None:  # the aux loss reads the router logits: they carry gradients too
            token_mask = p.token_mask(packed, rows, fwd.L)
            router = [r[token_mask] for r in fwd.router]
            loss = loss + sum((r * r).sum() for r in router)
        loss.backward()
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        runs[packing] = (fwd, keep, router, grads)
    (padded, keep, router_padded, grads_padded), (packs, _, router_packed, grads_packed) = (
        runs[False],
        runs[True],
    )
    assert packs.L == padded.L and packs.hidden.shape == padded.hidden.shape
    torch.testing.assert_close(packs.hidden[keep], padded.hidden[keep], rtol=0, atol=1e-5)
    assert not packs.hidden[~keep].any()  # zeros where the padding was
    check_positions(packs, packed, rows, layout)
    assert padded.positions == 6 * padded.L > padded.tokens == packs.tokens
    if router_padded is not None:
        assert len(packs.router) == len(padded.router)
        assert packs.router[0].shape == padded.router[0].shape  # (n*L, E), what moe.py reads
        for a, b in zip(router_packed, router_padded, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert grads_packed.keys() == grads_padded.keys() and grads_packed
    for n, g in grads_padded.items():  # float-order noise only: within 1e-5 of the largest
        scale = float(g.abs().max())
        assert scale > 0, n
        torch.testing.assert_close(grads_packed[n] / scale, g / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_packed_row_does_not_see_the_rows_packed_with_it(
    name: str, attention: str, layout: str
) -> None:
    model = family(name)
    model.config._attn_implementation = attention
    p = policy(model, packing=True)
    rows = slice(0, 6)
    base = batch(seed=0)
    other = batch(seed=0)
    # Rows 0-2 share prompt 0; change every token of rows 3-5 (their prompt and responses).
    other.ids[3:] = torch.where(other.attn[3:].bool(), (other.ids[3:] + 5) % VOCAB, other.ids[3:])
    with torch.no_grad():
        a = p.forward(base, rows, router=True)
        b = p.forward(other, rows, router=True)
        alone = p.forward(base, slice(1, 2), router=True)  # row 1 on its own
    check_positions(a, base, rows, layout)
    keep = real(base, rows, a.L)
    assert (a.hidden[3:][keep[3:]] - b.hidden[3:][keep[3:]]).abs().max() > 1e-3  # it changed
    torch.testing.assert_close(a.hidden[:3][keep[:3]], b.hidden[:3][keep[:3]], rtol=0, atol=1e-6)
    n1 = int(base.attn[1].sum())
    torch.testing.assert_close(a.hidden[1, : n1 - 1], alone.hidden[0, : n1 - 1], rtol=0, atol=1e-5)


def test_a_model_that_cannot_keep_packed_rows_apart_runs_padded() -> None:
    from types import SimpleNamespace

    model = family("llama")
    assert can_pack(model)
    model.config._attn_implementation = "some_kernel_of_its_own"  # not one that isolates
    assert not can_pack(model)

    class Base(torch.nn.Module):  # a base model whose forward takes no position ids
        config = SimpleNamespace(_attn_implementation="sdpa")

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 8)

        def forward(self, input_ids: Any, attention_mask: Any = None) -> Any:
            return SimpleNamespace(last_hidden_state=self.embed(input_ids))

    class Old(torch.nn.Module):
        base_model_prefix = "model"
        config = SimpleNamespace()

        def __init__(self) -> None:
            super().__init__()
            self.model = Base()

    old = Old()
    assert not can_pack(old)
    p = Policy(_Engine(old), None, None, True)
    assert not p.packs()
    fwd = p.forward(batch(), slice(0, 6), router=False)
    assert fwd.positions == 6 * fwd.L > fwd.tokens  # padded, whatever packSequences says


class OneRank:
    rank, world = 0, 1

    def __init__(self, at_least: int = 0) -> None:
        self.at_least = at_least  # another rank's need, as max_int would bring it back

    def max_int(self, value: int) -> int:
        return max(value, self.at_least)


def test_packed_micro_batches_count_real_tokens() -> None:
    assert token_micro_count([5, 5, 5, 5], 10) == 2
    assert token_micro_count([5, 5, 5, 5], 9) == 4
    assert token_micro_count([20, 1, 1], 10) == 2  # a row over the budget goes alone
    parts = token_micro_slices(slice(10, 16), [1, 1, 1, 1, 1, 10], 2)
    assert parts == [slice(10, 15), slice(15, 16)]  # balanced by tokens, not by rows
    parts = token_micro_slices(slice(0, 4), [5, 5, 5, 5], 4)  # more than the budget needs
    assert parts == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    assert token_micro_slices(slice(0, 2), [3, 3], 5) == [slice(0, 1), slice(1, 2)]

    # One long response among short ones: padded, every row costs the longest's length.
    packed = batch(response_lengths=(400, 10, 20, 30, 5, 15, 25, 35))
    lengths = packed.attn.sum(-1).tolist()
    budget = 450
    padded_plan = plan_step(packed, 1, budget, OneRank())
    packed_plan = plan_step(packed, 1, budget, OneRank(), pack=True)
    assert len(padded_plan[0].micro) == 8  # 411-token rows: one per micro-batch
    micro = packed_plan[0].micro
    assert len(micro) == 2 == token_micro_count(lengths, budget)
    assert [m.start for m in micro] == sorted(m.start for m in micro)  # contiguous, in order
    assert micro[0].start == 0 and micro[-1].stop == 8
    assert all(a.stop == b.start for a, b in itertools.pairwise(micro))
    assert all(sum(lengths[m]) <= budget for m in micro)
    # Every rank runs as many micro-batches as the rank that needs the most.
    plan = plan_step(packed, 2, budget, OneRank(at_least=3), pack=True)
    assert [len(mb.micro) for mb in plan] == [3, 3]
    for mb in plan:
        assert all(m.stop > m.start for m in mb.micro)
        assert mb.micro[0].start == mb.rows.start and mb.micro[-1].stop == mb.rows.stop


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("one_row", [False, True])
def test_a_packed_learner_step_equals_the_padded_one(
    cache: Path, monkeypatch: pytest.MonkeyPatch, one_row: bool
) -> None:
    if one_row:  # what flash attention runs (see `layout`)
        monkeypatch.setattr(policy_module, "ONE_ROW_ATTENTION", frozenset({"sdpa"}))
    runs = {}
    for packing in (False, True):
        manifest = tiny_spec(learningRate=1e-3)
        manifest["spec"]["learner"]["packSequences"] = packing
        learner = make_learner(cache, None, manifest)
        assert learner.policy.packs() is packing
        asyncio.run(learner.sync(0))
        stats = asyncio.run(learner.train_step(1))
        gauge = learner.metrics.registry.get_sample_value("gspo_padded_token_fraction")
        runs[packing] = (stats, params(learner), gauge)
    (padded, padded_params, padded_gauge), (packs, packed_params, packed_gauge) = (
        runs[False],
        runs[True],
    )
    assert padded["reward_mean"] == packs["reward_mean"]  # the same rollouts
    assert 0.0 < padded["padded_token_fraction"] == padded_gauge < 1.0
    assert packs["padded_token_fraction"] == packed_gauge
    if one_row:
        assert packs["padded_token_fraction"] == 0.0
    else:  # rows of the longest sequence's length: what is left at their ends (here, where
        # every row is within a few tokens of the longest, as much as padded)
        assert 0.0 <= packs["padded_token_fraction"] <= padded["padded_token_fraction"]
    for key in ("loss", "log_ratio_abs", "clip_fraction", "kl", "router_aux_loss"):
        assert packs[key] == pytest.approx(padded[key], abs=1e-6), key
    for key in ("entropy", "grad_norm"):
        assert packs[key] == pytest.approx(padded[key], rel=1e-4), key
    assert packs["logprob_mismatch"] < 1e-4 and padded["logprob_mismatch"] < 1e-4
    # Adam turns float-order noise in near-zero gradients into moves of up to ~2e-5 (see
    # test_learner_step); one step is 1e-3.
    assert any(not torch.equal(padded_params[n], packed_params[n]) for n in padded_params)
    for n, p in packed_params.items():
        torch.testing.assert_close(p, padded_params[n], rtol=1e-4, atol=1e-4, msg=n)
