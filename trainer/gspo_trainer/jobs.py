"""The embedded default job: what `gspo train` runs with no arguments (examples/tiny.yaml).

One place for these settings: examples/tiny.yaml is this manifest written out, and a test
keeps the two equal. Tuned on a 2-core CPU (BENCHMARKS.md, "Training the embedded
default": every configuration tried, with its seeds, and the shipped default's five seeds):
the model of width 128 (builtin:small-qwen3-moe, ~0.5M parameters) at lr 1.5e-4, two
mini-batches per step, groups of 16, with the paper's 3e-4/4e-4 clip. The width-64 model
needed 700 steps and still turned deterministic on wrong answers in one seed of five
(accuracy 0.76, entropy 0.1); at lr 3e-4 the wider one learned three times faster but did
the same (0.85); at 1.5e-4 every seed passed a greedy accuracy of 0.9 by step 250 and ended
at 0.97-1.0. An evaluation every 50 steps covers all 100 problems of the task, greedily,
and the last one closes the run. Every 50 steps too, four sample completions go to the
learner's log and history.jsonl (metrics.samplesEverySteps). Collection runs one step ahead
of the update (algorithm.maxStaleness 1): on two cores the next step's rollouts are generated
while this one updates, 0.67x the synchronous step's time, and seeds 0-4 still passed 0.9 by
steps 150-250 (median 200, as synchronous) and ended at 0.99-1.00 (BENCHMARKS.md, "Against
TRL on the embedded default").
"""

from __future__ import annotations

from typing import Any

from gspo_api.spec import API_GROUP, API_VERSION, KIND

TINY_JOB_NAME = "tiny-addition"


def tiny_manifest() -> dict[str, Any]:
    """The GSPOJob manifest of the embedded default: tiny MoE, built-in addition task."""
    spec: dict[str, Any] = {
        "model": {
            "name": "builtin:small-qwen3-moe",
            "dtype": "float32",
            "maxModelLen": 64,
            "gradientCheckpointing": False,
            # transformers' formula, top-k = 2: the weight the default was tuned with
            "moe": {"routerAuxLossCoef": 0.0005},
        },
        "data": {"source": "builtin:addition", "chatTemplate": False, "maxPromptTokens": 8},
        "reward": {"kind": "arithmetic", "timeoutSeconds": 5},
        "algorithm": {
            "lossLevel": "gspo",
            "groupSize": 16,
            "promptsPerStep": 16,
            "miniBatches": 2,
            "learningRate": 1.5e-4,
            "maxResponseTokens": 4,
            "temperature": 1.0,
            "maxSteps": 350,
            "maxStaleness": 1,
            "evalEverySteps": 50,
            "seed": 0,
        },
        "learner": {"replicas": 1, "gpusPerReplica": 0, "zeroStage": 1},
        "rollout": {
            "replicas": 1,
            "gpusPerReplica": 0,
            "tensorParallelSize": 1,
            "maxNumSeqs": 256,
        },
        "weightSync": {"bucketSizeMb": 16},
        "checkpoint": {"everySteps": 50, "keep": 2},
        "metrics": {"port": 9090, "samplesEverySteps": 50},
    }
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": TINY_JOB_NAME},
        "spec": spec,
    }
