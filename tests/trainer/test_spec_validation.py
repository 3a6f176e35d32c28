"""The spec models and their cross-field rules: every rejection names the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from checkout import checkout_env

from gspo_api.validation import SpecError, parse_spec


def minimal(**sections: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen3-30B-A3B-Base"},
        "data": {"source": "/data/train.jsonl"},
    }
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    return spec


def problems(spec: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return {p.path: p.message for p in info.value.problems}


def test_minimal_spec_takes_cluster_defaults() -> None:
    spec = parse_spec(minimal())
    assert (spec.algorithm.clip_low, spec.algorithm.clip_high) == (3e-4, 4e-4)
    assert spec.algorithm.loss_level == "gspo"
    assert spec.learner.zero_stage == 3
    assert spec.rollout.tensor_parallel_size == 2


def test_grpo_gets_its_own_clip_defaults_but_explicit_values_win() -> None:
    assert parse_spec(minimal(algorithm={"lossLevel": "grpo"})).algorithm.clip_low == 0.2
    assert parse_spec(minimal(algorithm={"lossLevel": "grpo"})).algorithm.clip_high == 0.27
    spec = parse_spec(minimal(algorithm={"lossLevel": "grpo", "clipHigh": 0.28}))
    assert spec.algorithm.clip_high == 0.28


def test_manifest_round_trip_is_lossless() -> None:
    spec = parse_spec(minimal(algorithm={"groupSize": 8, "klCoef": 0.01}))
    again = parse_spec(spec.to_manifest_dict())
    assert again == spec
    assert "groupSize" in spec.to_manifest_dict()["algorithm"]


def test_unknown_field_is_named_with_the_allowed_ones() -> None:
    found = problems(minimal(algorithm={"groupsize": 8}))
    assert "spec.algorithm.groupsize" in found
    assert "groupSize" in found["spec.algorithm.groupsize"]


def test_missing_required_fields_are_named() -> None:
    found = problems({"model": {}})
    assert set(found) == {"spec.model.name", "spec.data"}


def test_field_level_type_errors_carry_the_value() -> None:
    found = problems(minimal(learner={"replicas": 0}, algorithm={"lossLevel": "ppo"}))
    assert "0" in found["spec.learner.replicas"]
    assert "'ppo'" in found["spec.algorithm.lossLevel"]


def test_list_items_are_indexed_in_paths() -> None:
    spec = minimal(runPolicy={"scheduling": {"tolerations": [{"key": "a"}, {"effect": "Bad"}]}})
    assert "spec.runPolicy.scheduling.tolerations[1].effect" in problems(spec)


# (spec sections over `minimal()`, the path refused, words of the message). The CRD's CEL rules
# refuse the same specs (tests/contract/test_crd_cel.py).
FORMAT = {"name": "format", "kind": "format"}
CROSS_FIELD_CASES = [
    (
        {"reward": {"kind": "code", "sandbox": {"mode": "service"}}},
        "spec.reward.sandbox.runtimeClassName",
        "seccomp",
    ),
    (
        {"reward": {"kind": "code", "sandbox": {"replicas": 2}}},
        "spec.reward.sandbox.replicas",
        "only read when reward.sandbox.mode is service",
    ),
    (
        {"reward": {"kind": "code", "sandbox": {"serviceUrl": "http://s:1"}}},
        "spec.reward.sandbox.serviceUrl",
        "only read when",
    ),
    (
        {
            "reward": {
                "kind": "code",
                "sandbox": {"mode": "service", "serviceUrl": "http://s:1", "resources": {}},
            }
        },
        "spec.reward.sandbox.resources",
        "your own sandbox service",
    ),
    ({"algorithm": {"groupSize": 1}}, "spec.algorithm.groupSize", "2 or more"),
    ({"algorithm": {"clipLow": 0}}, "spec.algorithm.clipLow", "(0, 1)"),
    ({"algorithm": {"clipHigh": -0.1}}, "spec.algorithm.clipHigh", "> 0"),
    (
        {"algorithm": {"lossLevel": "gspo", "tokenBaseline": "position"}},
        "spec.algorithm.tokenBaseline",
        "set lossLevel to gspo-token or tokenBaseline to group",
    ),
    ({"algorithm": {"promptsPerStep": 3, "groupSize": 3}}, "spec.algorithm.miniBatches", "9"),
    (
        {"algorithm": {"promptsPerStep": 4, "groupSize": 2, "miniBatches": 1}},
        "spec.algorithm.promptsPerStep",
        "16 learner processes",
    ),
    ({"rollout": {"tensorParallelSize": 3}}, "spec.rollout.tensorParallelSize", "divide"),
    (
        {"rollout": {"gpusPerReplica": 0, "tensorParallelSize": 2}},
        "spec.rollout.tensorParallelSize",
        "CPU",
    ),
    (
        {"model": {"moe": {"expertParallelSize": 2}}},
        "spec.model.moe.expertParallelSize",
        "ZeRO-3",
    ),
    ({"model": {"name": "builtin:gpt5"}}, "spec.model.name", "tiny-qwen3-moe"),
    ({"model": {"maxModelLen": 4096}}, "spec.model.maxModelLen", "10240"),
    ({"learner": {"zeroStage": 0}}, "spec.learner.zeroStage", "learner.zeroStage to 1 or more"),
    ({"reward": {"kind": "python"}}, "spec.reward.function", "module:function"),
    ({"reward": {"function": "a:b"}}, "spec.reward.function", "only read"),
    ({"reward": {"kind": "math", "functions": [FORMAT]}}, "spec.reward.kind", "remove reward.kind"),
    ({"reward": {"function": "a:b", "functions": [FORMAT]}}, "spec.reward.function", "replaces"),
    ({"reward": {"functions": [FORMAT, FORMAT]}}, "spec.reward.functions", "used twice"),
    ({"reward": {"kind": "math", "convention": "trl"}}, "spec.reward.convention", "only read"),
    ({"reward": {"functions": [FORMAT], "convention": "verl"}}, "spec.reward.convention", "entry"),
    (
        {"reward": {"functions": [{**FORMAT, "convention": "trl"}]}},
        "spec.reward.functions[0].convention",
        "only read when kind is python",
    ),
    (
        {"reward": {"functions": [{"name": "f", "kind": "python"}]}},
        "spec.reward.functions[0].function",
        "module:function",
    ),
    (
        {"reward": {"functions": [{**FORMAT, "targetTokens": 3}]}},
        "spec.reward.functions[0].targetTokens",
        "only read when kind is length",
    ),
    (
        {"reward": {"functions": [{"name": "n", "kind": "length", "targetTokens": 8192}]}},
        "spec.reward.functions",
        "below algorithm.maxResponseTokens",
    ),
    (
        {"checkpoint": {"claimName": "c", "storageClassName": "fast"}},
        "spec.checkpoint.storageClassName",
        "remove one",
    ),
    ({"metrics": {"port": 8000}}, "spec.metrics.port", "rollout"),
    (
        {"reward": {"kind": "math", "sandbox": {"mode": "service"}}},
        "spec.reward.sandbox.mode",
        "only read when a code reward is scored",
    ),
    (
        {"reward": {"functions": [{"name": "a", "kind": "code"}, {"name": "b", "kind": "code"}]}},
        "spec.reward.functions",
        "reward.code and reward.sandbox serve one",
    ),
]


@pytest.mark.parametrize(("sections", "path", "words"), CROSS_FIELD_CASES)
def test_cross_field_rules(sections: dict[str, Any], path: str, words: str) -> None:
    found = problems(minimal(**sections))
    assert path in found, found
    assert words in found[path]


def test_all_problems_are_reported_at_once() -> None:
    found = problems(minimal(algorithm={"groupSize": 1, "clipLow": 2.0}, metrics={"port": 8000}))
    assert {"spec.algorithm.groupSize", "spec.algorithm.clipLow", "spec.metrics.port"} <= set(found)


def test_a_sandbox_pod_setting_in_mode_local_is_refused_once_with_a_fix_that_works() -> None:
    """In mode local no sandbox pods run with or without serviceUrl: the setting is refused
    as read in mode service only, not again with 'remove serviceUrl to have them run'."""
    sandbox = {"mode": "local", "serviceUrl": "http://s:1", "replicas": 2}
    found = problems(minimal(reward={"kind": "code", "sandbox": sandbox}))
    assert sorted(found) == ["spec.reward.sandbox.replicas", "spec.reward.sandbox.serviceUrl"]
    assert found["spec.reward.sandbox.replicas"].endswith("remove it or set mode: service")


def test_a_sandbox_without_a_code_reward_is_refused_once() -> None:
    """With no code reward no sandbox pods run: mode service is refused ('remove it'), and
    not also for a runtimeClassName the pods that never run would need."""
    found = problems(minimal(reward={"kind": "math", "sandbox": {"mode": "service"}}))
    assert list(found) == ["spec.reward.sandbox.mode"]
    assert found["spec.reward.sandbox.mode"].endswith("; remove it")


def test_a_rule_on_the_whole_list_names_every_entry_that_breaks_it_once() -> None:
    """reward.functions' names and length targets are judged on the list, as the CRD's rules
    judge them: one problem each, naming every entry at fault."""
    length = {"kind": "length", "targetTokens": 9000}
    entries = [{"name": n, **length} for n in ("a", "a", "b", "b", "c")]
    with pytest.raises(SpecError) as info:
        parse_spec(minimal(reward={"functions": entries}))
    said = [p.message for p in info.value.problems if p.path == "spec.reward.functions"]
    assert said[0].startswith("'a', 'b' are used twice: ")
    assert said[1].startswith("a: targetTokens 9000, a: targetTokens 9000, b: targetTokens")
    assert "c: targetTokens 9000 are not below algorithm.maxResponseTokens (8192)" in said[1]
    assert len(said) == 2
    code = [{"name": n, "kind": "code"} for n in ("a", "b", "c")]
    found = problems(minimal(reward={"functions": [{"name": "f", "kind": "format"}, *code]}))
    assert found == {
        "spec.reward.functions": "'a', 'b', 'c' are of kind code, and reward.code and "
        "reward.sandbox serve one; keep one of them"
    }


def test_spec_that_is_not_a_mapping() -> None:
    assert problems([1, 2]) == {"spec": "must be a mapping, got list"}  # type: ignore[arg-type]


def test_config_modules_import_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import gspo_api.spec, gspo_api.validation, gspo_api.progress; "
        "import gspo_operator.crd; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=checkout_env()
    )
    assert out.stdout.strip() == "False"


def test_engine_args_vllm_would_refuse_are_named_before_any_pod_starts() -> None:
    """rollout.engineArgs pass to vLLM's command line: a key it lacks, a value its parser
    refuses, or a setting gspo makes itself is refused here, naming the key and the fix."""
    got = problems(
        minimal(
            rollout={
                "engineArgs": {
                    "enable_prefix_cachng": True,  # misspelt
                    "kv_cache_dtype": "fp9",  # not one of its choices
                    "block_size": "sixteen",  # an int option
                    "enforce_eager": "yes",  # a switch
                    "disable_log_stats": False,  # a switch with no --no- form
                    "max_model_len": 4096,  # gspo sets it from model.maxModelLen
                    "api_key": "k",  # the job's token is the key
                    "seed": True,  # takes a value
                }
            }
        )
    )
    at = "spec.rollout.engineArgs."
    assert "did you mean 'enable_prefix_caching'?" in got[at + "enable_prefix_cachng"]
    assert "vLLM 0.32.0 has no engine argument" in got[at + "enable_prefix_cachng"]
    assert "'fp9' is not one of vLLM's choices: auto, bfloat16" in got[at + "kv_cache_dtype"]
    assert "whole number" in got[at + "block_size"]
    assert "write true or false" in got[at + "enforce_eager"]
    assert "can only be switched on" in got[at + "disable_log_stats"]
    assert got[at + "max_model_len"] == "is set by gspo: set model.maxModelLen instead"
    assert "the job's token" in got[at + "api_key"]
    assert "takes a value, not true" in got[at + "seed"]
    assert len(got) == 8


def test_engine_args_vllm_takes_pass() -> None:
    spec = parse_spec(
        minimal(
            rollout={
                "engineArgs": {
                    "enable_prefix_caching": False,
                    "kv_cache_dtype": "fp8",
                    "block_size": 32,
                    "seed": "7",
                    "disable_log_stats": True,
                    "compilation_config": {"mode": 0},
                    "cpu_offload_gb": 2.5,
                    "quantization": None,
                }
            }
        )
    )
    assert spec.rollout.engine_args["kv_cache_dtype"] == "fp8"


def test_what_splits_a_prompt_on_cpu_rollout_servers_is_refused_and_on_gpus_taken() -> None:
    """vLLM's CPU build dies on a seeded prompt split over two steps, so gspo turns chunked
    prefill off there (serve_command.py): asking for it, a long-prefill threshold (which
    splits prompts anyway) or a step budget below maxModelLen (a server without chunked
    prefill refuses to start) is refused on CPU servers."""
    cpu = {"gpusPerReplica": 0, "tensorParallelSize": 1}
    splitting = {
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 64,
        "max_num_batched_tokens": 1024,
    }
    model = {"name": "Qwen/Qwen3-30B-A3B-Base", "maxModelLen": 16384}
    got = problems(minimal(model=model, rollout={**cpu, "engineArgs": splitting}))
    at = "spec.rollout.engineArgs."
    assert "CPU build" in got[at + "enable_chunked_prefill"]
    assert "remove it" in got[at + "enable_chunked_prefill"]
    assert "remove it" in got[at + "long_prefill_token_threshold"]
    assert "1024 is below model.maxModelLen (16384)" in got[at + "max_num_batched_tokens"]
    assert len(got) == 3
    on_gpus = parse_spec(minimal(model=model, rollout={"engineArgs": splitting}))
    assert on_gpus.rollout.engine_args == splitting
    fine = {"enable_chunked_prefill": False, "long_prefill_token_threshold": 0}
    fine["max_num_batched_tokens"] = 16384
    parse_spec(minimal(model=model, rollout={**cpu, "engineArgs": fine}))
