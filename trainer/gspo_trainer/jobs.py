"""The embedded default job: what `gspo train` runs with no arguments (examples/tiny.yaml).

One place for these settings: examples/tiny.yaml is this manifest written out, and a test
keeps the two equal. Measured on a 2-core CPU (see FACTS.md and BENCHMARKS.md): lr 3e-4 with
one update per batch learns; lr >= 1e-3 collapses onto one answer.
"""

from __future__ import annotations

from typing import Any

from gspo_trainer.config import API_GROUP, API_VERSION, KIND

TINY_JOB_NAME = "tiny-addition"


def tiny_manifest() -> dict[str, Any]:
    """The GSPOJob manifest of the embedded default: tiny MoE, built-in addition task."""
    spec: dict[str, Any] = {
        "model": {
            "name": "builtin:tiny-qwen3-moe",
            "dtype": "float32",
            "maxModelLen": 64,
            "gradientCheckpointing": False,
            "moe": {"routerAuxLossCoef": 0.001},
        },
        "data": {"source": "builtin:addition", "chatTemplate": False, "maxPromptTokens": 8},
        "reward": {"kind": "arithmetic", "timeoutSeconds": 5},
        "algorithm": {
            "lossLevel": "gspo",
            "groupSize": 8,
            "promptsPerStep": 16,
            "miniBatches": 1,
            "learningRate": 3.0e-4,
            "maxResponseTokens": 4,
            "temperature": 1.0,
            "maxSteps": 400,
            "seed": 0,
        },
        "learner": {"replicas": 1, "gpusPerReplica": 0, "zeroStage": 1},
        "rollout": {
            "replicas": 1,
            "gpusPerReplica": 0,
            "tensorParallelSize": 1,
            "maxNumSeqs": 128,
        },
        "weightSync": {"bucketSizeMb": 16},
        "checkpoint": {"everySteps": 50, "keep": 2},
        "metrics": {"port": 9090},
    }
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": TINY_JOB_NAME},
        "spec": spec,
    }
