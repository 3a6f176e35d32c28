"""The spec's `rollout.engineArgs` checked against the engine arguments the pinned vLLM's
server takes, without importing vLLM (the operator's image has none): a misspelt key or a
value vLLM would refuse fails `kubectl apply` (the operator validates before any child
object exists), `gspo validate` and `gspo train`, naming the field, instead of a rollout
pod's start up to `rollout.backoffLimit` times over.

The table (`vllm_flags.json`, next to this file) is written from vLLM's own argument parser
by `python -m gspo_trainer.rollout.vllm_flags --write`; a contract test fails when the
installed vLLM's parser differs from it.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path
from typing import Any

from gspo_api.ports import ROLLOUT_HTTP_PORT

TABLE = Path(__file__).with_name("vllm_flags.json")

# What gspo sets itself (serve_command, render.rollout_args): an engine argument of the same
# name would fight it. Each says what to do instead.
SET_BY_GSPO = {
    "model": "set model.name instead",
    "served_model_name": "requests name the model model.name: remove it",
    "host": "a rollout server listens on every address of its pod: remove it",
    "port": f"rollout servers listen on port {ROLLOUT_HTTP_PORT}: remove it",
    "dtype": "set model.dtype instead",
    "max_model_len": "set model.maxModelLen instead",
    "max_num_seqs": "set rollout.maxNumSeqs instead",
    "gpu_memory_utilization": "set rollout.gpuMemoryUtilization instead",
    "tensor_parallel_size": "set rollout.tensorParallelSize instead",
    "revision": "set model.revision instead",
    "tokenizer": "set model.tokenizer instead",
    "trust_remote_code": "set model.trustRemoteCode instead",
    "worker_extension_cls": "the extension is gspo's weight receiver: remove it",
    "logprobs_mode": "the learner compares log-probs after temperature and top-p "
    "(processed_logprobs): remove it",
    "enable_scale_out": "the learner samples through the route it enables: remove it",
    "api_key": "the job's token (its Secret) is the key: remove it",
}


@cache
def shipped_table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def engine_arg_problems(engine_args: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for every engine argument the pinned vLLM would refuse or that gspo
    sets itself. Values that only vLLM's engine can judge (a block size its kernels lack) are
    left to it: a server that cannot start says why in its log."""
    table = shipped_table()
    options, version = table["options"], table["vllm"]
    out: list[tuple[str, str]] = []
    for key, value in engine_args.items():
        if key in SET_BY_GSPO:
            out.append((key, f"is set by gspo: {SET_BY_GSPO[key]}"))
            continue
        option = options.get(key)
        if option is None or f"--{key.replace('_', '-')}" not in option["flags"]:
            close = difflib.get_close_matches(key, options, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append((key, f"vLLM {version} has no engine argument {key!r}{hint}"))
            continue
        problem = _value_problem(option, value)
        if problem:
            out.append((key, problem))
    return out


def _value_problem(option: dict[str, Any], value: Any) -> str | None:
    kind = option["kind"]
    if value is None:
        return None  # engine_flag leaves it out: vLLM's default
    if kind in ("bool", "flag"):
        if not isinstance(value, bool):
            return f"is an on/off switch: write true or false, not {value!r}"
        if kind == "flag" and value is False:
            return "can only be switched on (vLLM has no --no- form): remove it to leave it off"
        return None
    if isinstance(value, bool):
        return f"takes a value, not {str(value).lower()}"
    choices = option["choices"]
    if choices is not None and not isinstance(value, dict | list) and str(value) not in choices:
        return f"{value!r} is not one of vLLM's choices: {', '.join(option['choices'])}"
    if option["type"] == "int" and not (isinstance(value, int) or _is_int(value)):
        return f"takes a whole number, not {value!r}"
    if option["type"] == "float" and not isinstance(value, int | float):
        try:
            float(value)
        except (TypeError, ValueError):
            return f"takes a number, not {value!r}"
    return None


def _is_int(value: Any) -> bool:
    try:
        return isinstance(value, str) and str(int(value)) == value.strip()
    except ValueError:
        return False
