"""Under learner.zeroStage 3 the learner's model is loaded sharded: transformers builds it
under deepspeed.zero.Init and each rank fills only its own partition; the KL reference is
loaded the same way, from the model's path, into an engine of its own (ZeRO-3, no
optimizer). Under stages 0-2 both stay whole. Run as a script under torchrun, this file is
the two-rank worker of the memory test (`worker`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gspo_trainer import engine as eng

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as the torchrun worker
    sys.path.insert(0, str(HERE))

from learner_helpers import make_learner, tiny_spec  # noqa: E402

from gspo_api.validation import parse_spec  # noqa: E402
from gspo_trainer import learner as learner_module  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def manifest(stage: int, **algorithm: Any) -> dict[str, Any]:
    m = tiny_spec(**algorithm)
    m["spec"]["learner"]["zeroStage"] = stage
    return m


def spec_for(stage: int, **algorithm: Any) -> Any:
    return parse_spec(manifest(stage, **algorithm)["spec"])


def tied_model(root: Path) -> Path:
    """A tiny dense Qwen3 whose lm_head is its embedding (tie_word_embeddings), saved."""
    from transformers import AutoModelForCausalLM

    from gspo_trainer.tiny import build_tokenizer, tiny_config

    path = root / "tied-qwen3"
    if not (path / "config.json").exists():
        tok = build_tokenizer()
        config = tiny_config("qwen3", len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
        config.tie_word_embeddings = True
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's parameters as the safetensors file holds them, in the model's layout:
    per-expert weights stacked into transformers 5's fused experts (gate and up joined),
    lm_head from the embedding when the file has none (tied)."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(path) / "model.safetensors"))
    out = dict(raw)
    layers = {k.split(".mlp.experts.")[0] for k in raw if ".mlp.experts." in k}
    for layer in layers:
        at = f"{layer}.mlp.experts."
        n = len({k[len(at) :].split(".")[0] for k in raw if k.startswith(at)})
        out[at + "gate_up_proj"] = torch.stack(
            [
                torch.cat([raw[f"{at}{e}.gate_proj.weight"], raw[f"{at}{e}.up_proj.weight"]])
                for e in range(n)
            ]
        )
        out[at + "down_proj"] = torch.stack([raw[f"{at}{e}.down_proj.weight"] for e in range(n)])
    out.setdefault("lm_head.weight", raw["model.embed_tokens.weight"])
    return out


def gathered(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 model, gathered whole (one at a time)."""
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def assert_partitioned(model: Any) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for name, p in model.named_parameters():
        assert hasattr(p, "ds_id"), f"{name} is not a ZeRO-3 parameter"
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
        assert p.numel() == 0 and p.ds_tensor.numel() > 0, name  # no whole tensor on the rank


@pytest.mark.parametrize("model", ["moe", "tied"])
def test_zero3_loads_each_partition_with_the_checkpoint_weights(cache: Path, model: str) -> None:
    spec = spec_for(3, klCoef=0.05)
    path = eng.resolve_model_path(spec, str(cache)) if model == "moe" else tied_model(cache)
    policy, _ = eng.load_model(spec, str(path), shard=True)
    # Built under zero.Init: partitioned from the start, before any engine exists.
    assert_partitioned(policy)
    if model == "tied":
        assert policy.lm_head.weight is policy.model.embed_tokens.weight
    engine = eng.build_engine(spec, policy)
    reference, ref_engine = eng.build_reference(spec, str(path), engine.device)
    assert ref_engine is not None and reference is ref_engine.module
    assert not reference.training and engine.module.training
    assert not any(p.requires_grad for p in reference.parameters())
    expected = checkpoint_tensors(path)
    for which in (engine.module, reference):
        assert all(hasattr(p, "ds_id") for p in which.parameters())
        whole = gathered(which)
        assert set(whole) == {n for n, _ in which.named_parameters()}
        for name, value in whole.items():
            # exact: the file's weights, not a random init
            assert torch.equal(value, expected[name]), name
    # The partitioned policy trains (gradient checkpointing, the head scorer, leaf blocks).
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    out = engine.module(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    after = gathered(engine.module)
    assert any(not torch.equal(after[n], expected[n]) for n in after)
    assert all(torch.equal(v, expected[n]) for n, v in gathered(reference).items())


def test_stages_0_to_2_load_whole_and_zero3_does_not_leak(cache: Path, monkeypatch) -> None:
    from transformers.integrations import deepspeed as hf_ds

    spec3, spec1 = spec_for(3), spec_for(1, klCoef=0.05)
    path = eng.resolve_model_path(spec3, str(cache))
    # Someone else's registration is put back after a sharded load.
    theirs = hf_ds.HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}
    )
    try:
        model, _ = eng.load_model(spec3, path, shard=True)
        assert hasattr(next(model.parameters()), "ds_id")
        assert hf_ds.deepspeed_config() is theirs.config
    finally:
        hf_ds.unset_hf_deepspeed_config()
    assert not hf_ds.is_deepspeed_zero3_enabled()
    # Later loads in the process are whole: a stage-1 policy and its reference.
    model, _ = eng.load_model(spec1, path, shard=True)
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
    reference, ref_engine = eng.build_reference(spec1, path, torch.device("cpu"))
    assert ref_engine is None and not reference.training
    assert not any(hasattr(p, "ds_id") or p.requires_grad for p in reference.parameters())
    expected = checkpoint_tensors(path)
    assert all(torch.equal(p, expected[n]) for n, p in reference.named_parameters())


def test_the_zero3_reference_scores_as_zero0s_and_stays_the_starting_policy(
    cache: Path, tmp_path: Path, monkeypatch
) -> None:
    """The reference's log-probs of one batch are the same under ZeRO-3 (sharded, its own
    engine) as under ZeRO-0 (whole), and stay those of the starting weights after an update
    and after a resume from a checkpoint."""
    calls: list[tuple[tuple, Any]] = []
    real = learner_module.old_policy

    def spy(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        calls.append((args, out))
        return out

    monkeypatch.setattr(learner_module, "old_policy", spy)
    refs, batch = {}, None
    for stage in (0, 3):
        m = manifest(stage, klCoef=0.05, learningRate=1e-3, miniBatches=1)
        m["spec"]["model"]["gradientCheckpointing"] = True
        m["spec"]["checkpoint"]["exportHf"] = False
        learner = make_learner(cache, tmp_path / f"z{stage}", m)
        assert (learner.reference_engine is not None) == (stage == 3)
        asyncio.run(learner.sync(0))
        asyncio.run(learner.train_step(1))
        (_, packed, plan, alg, *_), first = calls[-1]
        if batch is None:
            batch = packed
        # The same rollouts (seeded sampling from the same starting weights).
        assert torch.equal(packed.ids, batch.ids)
        # πold is the reference before any update.
        for old, ref in zip(first.logp, first.ref, strict=True):
            torch.testing.assert_close(ref, old, rtol=0, atol=1e-6)
        # Recomputed on every mini-batch (a diagnostics step's πold: none from an update).
        again = real(learner.policy, packed, plan, alg, diagnose=True)
        assert any(not torch.equal(a, b) for a, b in zip(first.logp, again.logp, strict=True))
        for a, b in zip(first.ref, again.ref, strict=True):
            assert torch.equal(a, b)  # the update left the reference alone
        refs[stage] = first.ref
        learner.checkpointer.checkpoint()
        resumed = make_learner(cache, tmp_path / f"z{stage}", m)
        assert resumed.resume() == 1
        back = real(resumed.policy, packed, plan, alg, diagnose=True)
        for a, b in zip(again.logp, back.logp, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)  # the policy resumed...
        for a, b in zip(first.ref, back.ref, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)  # ...its reference did not
    for z0, z3 in zip(refs[0], refs[3], strict=True):
        torch.testing.assert_close(z3, z0, rtol=1e-5, atol=1e-6)


def test_two_ranks_each_load_half_of_the_model(tmp_path: Path) -> None:
    from checkout import checkout_env

    out = tmp_path / "ranks.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        str(out),
        str(tmp_path / "models"),
    ]
    env = checkout_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] += f":{HERE}"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        for which in ("policy", "reference"):
            local, total, count = r[which]
            # Each parameter split in two (the odd element padded): half of the model each.
            assert total / 2 <= local <= total / 2 + count, (r["rank"], which)
        assert r["reference_logp_error"] < 1e-5  # the gathered layers score as the whole model


def worker(out: str, cache: str) -> None:
    """Under torchrun, 2 ranks, ZeRO-3: each rank's storage right after the policy's and the
    reference's loads (every parameter a partition, about half of the model), then each rank
    scores its own rows with the sharded reference against the whole model loaded plainly."""
    from transformers import AutoModelForCausalLM

    from gspo_trainer.logprobs import token_logprobs_from_hidden

    spec = spec_for(3, klCoef=0.05)
    path = eng.resolve_model_path(spec, cache)
    rank = int(os.environ["RANK"])
    eng.init_distributed()

    def storage(model: Any) -> list[int]:
        assert_partitioned(model)
        params = list(model.parameters())
        return [
            sum(p.ds_tensor.numel() for p in params),
            sum(p.ds_numel for p in params),
            len(params),
        ]

    policy, _ = eng.load_model(spec, path, shard=True)
    report: dict[str, Any] = {"rank": rank, "policy": storage(policy)}
    # build_reference's load, measured before its engine persists the tiny model's small
    # parameters (stage3_param_persistence_threshold: whole layers of a real model are far
    # above it)
    report["reference"] = storage(eng._from_pretrained(spec, path, shard=True))
    engine = eng.build_engine(spec, policy)
    reference, _ = eng.build_reference(spec, path, engine.device)
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(rank)  # different rows on each rank
    ids = torch.randint(3, 15, (2, 7))
    with torch.no_grad():
        fn = token_logprobs_from_hidden
        h = reference.model(input_ids=ids).last_hidden_state[:, :-1]
        got = eng.score_with_head(reference, lambda h, w, t: fn(h, w, t).logp, h, ids[:, 1:])
        want = fn(
            whole.model(input_ids=ids).last_hidden_state[:, :-1], whole.lm_head.weight, ids[:, 1:]
        ).logp
    report["reference_logp_error"] = float((got - want).abs().max())
    with open(out, "a") as f:  # two short appends: lines do not interleave
        f.write(json.dumps(report) + "\n")
    import torch.distributed as dist

    dist.barrier()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
    eng.exit_rank(0)
