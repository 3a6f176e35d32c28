"""`gspo`: the one entry point for people and pods alike.

Each subcommand lives in its own module and is imported only when run, so `gspo validate`
never pays for torch and the operator image never needs vLLM.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module:function taking argv and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "crd": ("gspo_operator.crd:main", "print the GSPOJob CustomResourceDefinition"),
    "validate": ("gspo_operator.manifest:main", "check GSPOJob manifests offline"),
    "render": ("gspo_operator.render_cli:main", "print the objects a GSPOJob becomes"),
    "operator": ("gspo_operator.run:main", "run the operator (kopf)"),
    "rollout-server": ("gspo_trainer.rollout.server:main", "serve rollouts with vLLM"),
    "learner": ("gspo_trainer.learner_cli:main", "run the GSPO learner"),
    "train": ("gspo_trainer.train:main", "train locally: rollout servers and learner"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items())
    return f"usage: gspo <command> [args]\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"gspo: unknown command {name!r}\n\n{usage()}")
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
