"""The memory plan: shapes counted as transformers builds the models, DeepSpeed's own estimator
for the ZeRO model states, the shipped example's verdicts, and fixes that really fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from gspo_api.memory_plan import (
    GiB,
    LearnerSetup,
    gpu_capacity,
    learner_rows,
    plan_spec,
    refusals,
)
from gspo_api.model_shape import (
    TINY_KINDS,
    TINY_VOCAB,
    ModelConfigError,
    ModelShape,
    find_model_config,
)
from gspo_api.validation import parse_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def shipped(name: str) -> ModelShape:
    found = find_model_config(name)
    assert found is not None, name
    return ModelShape.from_config(found[0])


def example(**changes: dict) -> dict:
    spec = copy.deepcopy(EXAMPLE["spec"])
    for section, fields in changes.items():
        spec[section] = {**spec.get(section, {}), **fields}
    return spec


# --- shapes ---------------------------------------------------------------------------------
def test_shipped_configs_count_the_published_sizes() -> None:
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B activated; Qwen3-0.6B: 0.6 B, 0.44 B without
    the (tied) embeddings (the model cards' figures)."""
    moe = shipped("Qwen/Qwen3-30B-A3B-Base")
    assert moe.params / 1e9 == pytest.approx(30.5, abs=0.05)
    active = moe.params - moe.sparse_layers * moe.experts * 3 * moe.hidden * moe.expert_intermediate
    active += moe.sparse_layers * moe.experts_per_token * 3 * moe.hidden * moe.expert_intermediate
    assert active / 1e9 == pytest.approx(3.3, abs=0.06)
    dense = shipped("Qwen/Qwen3-0.6B")
    assert dense.params / 1e9 == pytest.approx(0.6, abs=0.01)
    assert (dense.params - dense.embedding_params) / 1e9 == pytest.approx(0.44, abs=0.01)
    assert shipped("Qwen/Qwen3-30B-A3B") == moe


CONFIGS = {
    "qwen2_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        decoder_sparse_step=2,
        mlp_only_layers=[0],
    ),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    ),
    "llama": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_parameter_counts_match_transformers(kind: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **CONFIGS[kind])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.params == model.num_parameters()
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert shape.largest_layer_params == max(*layers, shape.embedding_params)


@pytest.mark.parametrize("name", sorted(TINY_KINDS))
def test_builtin_models_are_counted_without_building_them(name: str) -> None:
    from gspo_trainer.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(name)
    assert len(tokenizer) == TINY_VOCAB
    assert shipped(name).params == model.num_parameters()


def test_config_found_locally_then_in_the_hub_cache(tmp_path: Path, monkeypatch) -> None:
    fields = {
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "vocab_size": 10,
    }
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(fields))
    assert find_model_config(str(local)) == (fields, str(local / "config.json"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(fields))
    assert find_model_config("org/m") == (fields, str(repo / "snapshots/abc123/config.json"))
    assert find_model_config("org/m", "v2") is None  # a revision not cached
    assert find_model_config("org/other") is None
    (repo / "snapshots" / "abc123" / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"not a readable config\.json"):
        find_model_config("org/m")
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelShape.from_config({"num_hidden_layers": 2})


# --- the learner against DeepSpeed's estimator ----------------------------------------------
def _states(rows: tuple) -> int:
    """The model states of a learner plan: weights, gathered layers, master, Adam, grads."""
    other = ("activations", "CUDA", "weight-sync", "gradient reduce bucket", "output head's")
    return sum(r.bytes for r in rows if not r.name.startswith(other))


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-30B-A3B-Base"])
@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_zero_model_states_agree_with_deepspeeds_estimator(model: str, nodes: int) -> None:
    """deepspeed.runtime.zero's estimate_zero3/zero2_model_states_mem_needs, per GPU: ZeRO-3
    (18 bytes a parameter over the GPUs plus 4 per parameter of the largest layer) with and
    without optimizer offload equal ours; ZeRO-2 counts the bf16 gradients as a 1/N partition
    where we count the reduce bucket (within 12%)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = shipped(model)
    P, gpus = shape.params, 8 * nodes
    setup = LearnerSetup(gpus, 3, "bfloat16", False, True, 1024, False, 0, 80 * 2**30)
    for offload in (False, True):
        ours = _states(learner_rows(shape, LearnerSetup(**{**setup.__dict__, "offload": offload})))
        _, theirs, _ = estimate_zero3_model_states_mem_needs(
            P, shape.largest_layer_params, 8, nodes, cpu_offload=offload, cpu_offload_params=False
        )
        assert ours == pytest.approx(theirs, rel=0.01), (offload, ours / theirs)
    ours = _states(learner_rows(shape, LearnerSetup(**{**setup.__dict__, "zero_stage": 2})))
    _, theirs = estimate_zero2_model_states_mem_needs(P, 8, nodes, cpu_offload=False)
    assert ours == pytest.approx(theirs, rel=0.12)


def test_zero1_counts_the_whole_fp32_gradients_of_bf16_optimizer() -> None:
    """Under ZeRO-1 with bf16 weights and fp32 accumulation DeepSpeed runs BF16_Optimizer,
    which keeps fp32 gradients for the whole model (fp32_groups_gradients_flat) besides the
    bf16 .grad of a backward: 6 bytes a parameter on every GPU, which DeepSpeed's stage-1/2
    estimator (2 + 18/N) leaves out; ours is that much larger."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = shipped("Qwen/Qwen3-0.6B")
    rows = learner_rows(
        shape, LearnerSetup(16, 1, "bfloat16", False, True, 1024, False, 0, 80 * 2**30)
    )
    by_name = {r.name: r.bytes for r in rows}
    assert by_name["gradients, fp32 (whole)"] == 4 * shape.params
    assert by_name["bfloat16 gradients of a backward"] == 2 * shape.params
    _, theirs = estimate_zero2_model_states_mem_needs(shape.params, 8, 2, cpu_offload=False)
    assert _states(rows) - theirs == 6 * shape.params - 6 * shape.params // 16


def test_the_reduce_bucket_is_deepspeeds_whole_size_for_a_small_model() -> None:
    """ZeRO-2 and -3 allocate their reduce bucket at reduce_bucket_size elements (torch.empty
    in stage_1_and_2.py and stage3.py), not at the model's size: 5e8 bf16 elements, ~0.93 GiB,
    on every GPU even for a 0.6B-parameter model (more than the bucket) or a tiny one."""
    tiny = ModelShape.from_config(
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 512,
        }
    )
    for stage in (2, 3):
        rows = learner_rows(
            tiny, LearnerSetup(8, stage, "bfloat16", False, True, 1024, False, 0, 80 * 2**30)
        )
        by_name = {r.name: r.bytes for r in rows}
        assert by_name["gradient reduce bucket"] == 500_000_000 * 2


def test_the_output_heads_fp32_gradient_is_counted() -> None:
    """The fused loss holds the head's gradient for the whole (vocabulary, hidden) weight in
    fp32 from its forward through the backward, plus autograd's cast to bf16: for
    Qwen3-30B-A3B (151,936 x 2,048) 1.74 GiB on every GPU, at any ZeRO stage."""
    shape = shipped("Qwen/Qwen3-30B-A3B-Base")
    for stage in (1, 3):
        rows = learner_rows(
            shape, LearnerSetup(16, stage, "bfloat16", False, True, 1024, False, 0, 80 * 2**30)
        )
        by_name = {r.name: r.bytes for r in rows}
        assert by_name["output head's gradient (fp32, whole; the fused loss)"] == (
            151_936 * 2_048 * (4 + 2)
        )


# --- verdicts -------------------------------------------------------------------------------
def test_the_example_fits_as_shipped() -> None:
    plan, skipped = plan_spec(parse_spec(example()))
    assert plan is not None, skipped
    assert [r.role for r in plan.roles] == ["learner", "rollout"]
    assert refusals(plan) == []
    learner = plan.roles[0]
    assert 30 * GiB < learner.total < 70 * GiB and learner.capacity == 80 * GiB


def test_the_example_on_one_learner_gpu_is_refused_with_fixes_that_fit() -> None:
    spec = parse_spec(example(learner={"replicas": 1, "gpusPerReplica": 1}))
    plan, _ = plan_spec(spec)
    assert plan is not None
    [(path, message)] = refusals(plan)
    assert path == "spec.learner"
    assert "the learner needs 5" in message and "the GPU has 80.0 GiB" in message
    assert "learner.replicas: 16 (16 GPUs)" in message
    assert "learner.offloadOptimizer: true" in message
    # Each fix named makes it fit; one replica fewer does not.
    fits = [{"replicas": 16}, {"offloadOptimizer": True}]
    for fix in fits:
        learner = {"replicas": 1, "gpusPerReplica": 1, **fix}
        fixed, _ = plan_spec(parse_spec(example(learner=learner)))
        assert fixed is not None and refusals(fixed) == [], fix
    short, _ = plan_spec(parse_spec(example(learner={"replicas": 4, "gpusPerReplica": 1})))
    assert short is not None and refusals(short)


def test_activations_name_micro_batch_tokens_and_checkpointing_as_fixes() -> None:
    spec = example(model={"gradientCheckpointing": False}, learner={"microBatchTokens": 49152})
    plan, _ = plan_spec(parse_spec(spec))
    assert plan is not None
    [(_, message)] = refusals(plan)
    assert "model.gradientCheckpointing: true" in message
    tokens = int(message.split("learner.microBatchTokens: ")[1].split(";")[0].split(" ")[0])
    for budget, fit in ((tokens, True), (2 * tokens, False)):
        learner = {**spec["learner"], "microBatchTokens": budget}
        again, _ = plan_spec(parse_spec({**spec, "learner": learner}))
        assert again is not None and (refusals(again) == []) is fit, budget


def test_a_server_whose_kv_cache_cannot_hold_one_sequence_is_refused() -> None:
    """vLLM refuses to start when the KV cache left cannot hold one maxModelLen sequence:
    one Qwen3-30B-A3B server on one GPU (57 GiB of weights in 68 GiB) at 131072 tokens."""
    spec = example(
        rollout={"tensorParallelSize": 1, "gpusPerReplica": 1}, model={"maxModelLen": 131072}
    )
    plan, _ = plan_spec(parse_spec(spec))
    assert plan is not None
    [(path, message)] = refusals(plan)
    assert path == "spec.rollout" and "cannot hold one maxModelLen sequence" in message
    assert "rollout.tensorParallelSize and gpusPerReplica: 2" in message
    assert "rollout.gpuMemoryUtilization: 0.95" in message


def test_gpu_size_from_the_node_selector_labels() -> None:
    def capacity(selector: dict) -> int:
        spec = example(runPolicy={"scheduling": {"nodeSelector": selector}})
        return gpu_capacity(parse_spec(spec))[0]

    assert capacity({}) == 80 * GiB
    assert capacity({"nvidia.com/gpu.memory": "143771"}) == 143771 * 2**20
    assert capacity({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}) == 40 * GiB
    assert capacity({"nvidia.com/gpu.product": "NVIDIA-H200"}) == 141 * GiB
    # On 40 GiB GPUs the shipped example's learner no longer fits (its servers still do).
    small = example(runPolicy={"scheduling": {"nodeSelector": {"nvidia.com/gpu.memory": "40960"}}})
    plan, _ = plan_spec(parse_spec(small))
    assert plan is not None and [p for p, _ in refusals(plan)] == ["spec.learner"]


def test_a_hub_model_without_a_config_here_is_skipped(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    plan, why = plan_spec(parse_spec(example(model={"name": "org/unknown-model"})))
    assert plan is None
    assert why.startswith("memory plan skipped: no config.json for 'org/unknown-model'")
