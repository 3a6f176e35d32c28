"""The table of vLLM's engine arguments that the spec's validation reads (engine_args.py,
without vLLM) against the installed vLLM's own parser: equal, and agreeing with it on what it
accepts and refuses. When a vLLM upgrade changes the flags, this fails with the command that
rewrites the table."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from gspo_api.engine_args import engine_arg_problems, shipped_table
from gspo_trainer.rollout.serve_command import ServeOptions, serve_argv
from gspo_trainer.rollout.vllm_flags import installed_table

REWRITE = "python -m gspo_trainer.rollout.vllm_flags --write"


def test_the_shipped_table_is_the_installed_vllms() -> None:
    installed, shipped = installed_table(), shipped_table()
    assert installed["vllm"] == shipped["vllm"], f"vLLM changed: run {REWRITE}"
    changed = {
        k
        for k in installed["options"].keys() | shipped["options"].keys()
        if installed["options"].get(k) != shipped["options"].get(k)
    }
    assert not changed, f"vLLM's flags differ from the table ({sorted(changed)[:10]}): {REWRITE}"


@cache
def server_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def vllm_refuses(engine_args: dict[str, Any]) -> bool:
    """Whether vLLM's own server parser refuses the command line serve_command builds."""
    argv = serve_argv(ServeOptions(model="m", served_name="m", engine_args=engine_args))
    try:
        server_parser().parse_args(argv[3:])
    except SystemExit:
        return True
    return False


def sample_values() -> list[tuple[str, Any, bool]]:
    """(key, value, valid) for every switch, every option with choices and every int or float
    option of the table: one value it takes and one it does not."""
    out: list[tuple[str, Any, bool]] = []
    for key, option in shipped_table()["options"].items():
        kind = option["kind"]
        if kind == "bool":
            out += [(key, True, True), (key, False, True)]
        elif kind == "flag":
            out += [(key, True, True), (key, False, False)]
        elif option["choices"]:
            out += [(key, option["choices"][0], True), (key, "no-such-choice", False)]
        elif option["type"] in ("int", "float"):
            out += [(key, 3, True), (key, "three", False)]
    return out


@pytest.mark.parametrize(("key", "value", "valid"), sample_values())
def test_validation_and_vllms_parser_agree(key: str, value: Any, valid: bool) -> None:
    ours = [m for k, m in engine_arg_problems({key: value}) if k == key]
    if ours and "is set by gspo" in ours[0]:
        return  # gspo sets it; whether vLLM would take it does not matter
    assert (not ours) == valid, ours
    assert vllm_refuses({key: value}) == (not valid)
