"""`gspo`: the one entry point for people and pods alike (a click group; docs/cli.md).

`validate`, `render` and `crd` are defined here and import their modules only when run, so
`gspo validate` never pays for torch and `gspo --help` or shell completion imports no more
than click. The commands run in pods (`operator`, `rollout-server`, `learner`,
`sandbox-server`, `train`) keep their own argparse parsers in their own modules: gspo hands
them their arguments unchanged, so `gspo train --help` is train's own help and the images'
argv work as they always did.

Exit codes: 0 ok; 1 invalid input (a manifest that fails validation; a file that is missing,
unreadable, empty or not YAML; an output directory that does not exist); 2 usage (an
unknown command or flag, a missing argument, a bad flag value). A user's error never prints
a traceback.
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import click

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
DISTRIBUTION = "gspo-operator"  # pyproject.toml's [project] name
STDIN = "-"  # as manifest.STDIN; repeated so that `gspo --help` imports no pydantic

EPILOG = """\b
Exit codes:
  0  ok (validate: every manifest is valid)
  1  invalid input: a manifest that fails validation; a file that is missing,
     unreadable, empty or not YAML; an output directory that does not exist
  2  usage: an unknown command or flag, a missing argument, a bad flag value

\b
Shell completion (bash; zsh and fish in docs/cli.md):
  eval "$(_GSPO_COMPLETE=bash_source gspo)"
"""

# Commands run in pods: module:function(argv) -> exit code, with one line of help.
POD_COMMANDS: dict[str, tuple[str, str]] = {
    "operator": ("gspo_operator.run:main", "Run the operator (kopf)."),
    "rollout-server": (
        "gspo_trainer.rollout.launch:main",
        "Serve rollouts: vLLM's server with the gspo plugin.",
    ),
    "learner": ("gspo_trainer.learner_cli:main", "Run the GSPO learner."),
    "sandbox-server": (
        "gspo_trainer.code.service:main",
        "Serve the code reward's sandbox over HTTP (reward.sandbox.mode service).",
    ),
    "train": ("gspo_trainer.train:main", "Train locally: rollout servers and learner."),
}

OUTPUT = click.option(
    "-o",
    "--output",
    type=click.Choice(["yaml", "json"]),
    default=None,
    help="Print machine-readable YAML or JSON instead of the default output.",
)


class PassThrough(click.Command):
    """A command with its own argparse parser: every argument reaches it unparsed ("--" and
    "--help" included)."""

    def __init__(self, name: str, target: str, help_: str) -> None:
        super().__init__(
            name,
            help=f"{help_}\n\nIts flags are its own: gspo {name} --help.",
            short_help=help_,
            add_help_option=False,
        )
        self.target = target

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.args = list(args)
        return ctx.args

    def invoke(self, ctx: click.Context) -> int:
        module, func = self.target.split(":")
        return int(getattr(importlib.import_module(module), func)(ctx.args) or 0)


class Gspo(click.Group):
    """The top-level group: commands in the order written, and an unknown command named."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if args and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, list(self.commands), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise click.UsageError(
                f"unknown command {name!r}{hint} (commands: {', '.join(self.commands)})", ctx
            )
        return super().resolve_command(ctx, args)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(DISTRIBUTION)
    except PackageNotFoundError:
        found = f"unknown ({DISTRIBUTION} is not installed; pip install -e .)"
    click.echo(f"gspo, version {found}")
    ctx.exit(EXIT_OK)


@click.group(
    cls=Gspo,
    epilog=EPILOG,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the installed version and exit.",
)
def gspo() -> None:
    """GSPO reinforcement learning of LLMs: a Kubernetes operator and a local trainer."""


def _dump(data: Any, output: str) -> str:
    if output == "json":
        return json.dumps(data, indent=2) + "\n"
    import yaml

    return yaml.safe_dump(data, sort_keys=False, width=100)


def _fail(message: str) -> int:
    click.echo(message, err=True)
    return EXIT_INVALID


# click.Path only for shell completion of file names: missing files are ours to report (exit 1).
MANIFEST = click.Path(allow_dash=True)


@gspo.command(short_help="Check GSPOJob manifests offline.")
@click.argument("files", nargs=-1, required=True, type=MANIFEST, metavar="FILE...")
@click.option("--allow-host-path", is_flag=True, help="As on a cluster that allows hostPath.")
@click.option(
    "--jobset-restart-job-gate",
    is_flag=True,
    help="As on a cluster whose JobSet has the RestartJob feature gate on.",
)
@click.option(
    "--allowed-image",
    "allowed_images",
    multiple=True,
    metavar="PATTERN",
    help="As on a cluster whose policy.allowedImages lists PATTERN (an image prefix or glob, "
    "e.g. 'ghcr.io/gspo-dev/*'; repeatable).  [default: any image]",
)
@click.option(
    "--allowed-priority-class",
    "allowed_priority_classes",
    multiple=True,
    metavar="NAME",
    help="As on a cluster whose policy.allowedPriorityClasses lists NAME (repeatable).  "
    "[default: any class]",
)
@click.option(
    "--allow-overcommit",
    is_flag=True,
    help="Warn, instead of refusing, when the memory plan says a spec cannot fit its GPUs "
    '(as the annotation gspo.dev/allow-overcommit: "true" does on a cluster).',
)
@click.option(
    "--gpu-memory",
    "gpu_memory_gib",
    type=click.FloatRange(min=1),
    default=None,
    metavar="GIB",
    help="Plan for GPUs of GIB GiB.  [default: the nodeSelector's nvidia.com/gpu.memory or "
    "gpu.product label, else an 80 GiB H100]",
)
@OUTPUT
def validate(
    files: tuple[str, ...],
    allow_host_path: bool,
    jobset_restart_job_gate: bool,
    allowed_images: tuple[str, ...],
    allowed_priority_classes: tuple[str, ...],
    allow_overcommit: bool,
    gpu_memory_gib: float | None,
    output: str | None,
) -> int:
    """Check GSPOJob manifests offline with the operator's own checks: every problem of
    every file, one `FILE: field.path: message` line each (FILE[i] in a file of several
    documents), or with -o a result per file: {file, valid, problems: [{field, message}]}.
    FILE may be - for stdin. Other kinds beside a GSPOJob (a PVC, a Secret) are skipped.

    Each job's memory plan (per-GPU memory of the learner and of a rollout server, from the
    model's config.json) prints on stderr; a spec that cannot fit its GPUs is a problem
    naming the numbers and the fixes, unless --allow-overcommit."""
    from gspo_operator.manifest import ClusterPolicy, validate_source

    policy = ClusterPolicy(
        allow_host_path,
        jobset_restart_job_gate,
        allowed_images=allowed_images,
        allowed_priority_classes=allowed_priority_classes,
    )
    results = [
        validate_source(
            source, policy, allow_overcommit=allow_overcommit, gpu_memory_gib=gpu_memory_gib
        )
        for source in files
    ]
    if output:
        click.echo(_dump([r.as_dict() for r in results], output), nl=False)
    else:
        for result in results:
            for note in result.notes:
                click.echo(note, err=True)
            for line in result.lines():
                click.echo(line)
        if all(r.valid for r in results):
            click.echo(f"{len(results)} file(s) valid", err=True)
    return EXIT_OK if all(r.valid for r in results) else EXIT_INVALID


@gspo.command(short_help="Print the objects a GSPOJob becomes.")
@click.argument("file", type=MANIFEST, metavar="FILE")
@click.option(
    "-n",
    "--namespace",
    default=None,
    help="Namespace if the manifest has none.  [default: default]",
)
@click.option(
    "--show-secrets",
    is_flag=True,
    help="Print Secret values (the job's generated token) instead of <redacted>.",
)
@OUTPUT
def render(file: str, namespace: str | None, show_secrets: bool, output: str | None) -> int:
    """Print what the operator would create for the GSPOJob(s) in FILE (- for stdin), like
    helm template: a multi-document YAML stream, or with -o json a v1 List of the same
    objects. Secret values print as <redacted> unless asked for (--show-secrets)."""
    from gspo_operator.manifest import ManifestError
    from gspo_operator.render_cli import dump_yaml, render_source

    try:
        objects = render_source(file, namespace, show_secrets)
    except ManifestError as exc:
        return _fail(str(exc))
    if output == "json":
        click.echo(_dump({"apiVersion": "v1", "kind": "List", "items": objects}, "json"), nl=False)
    else:
        click.echo(dump_yaml(objects), nl=False)
    return EXIT_OK


@gspo.command(short_help="Print the GSPOJob CustomResourceDefinition.")
@click.option(
    "--write",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=STDIN,
    metavar="FILE",
    help="Write to FILE (e.g. charts/gspo-operator/files/gspo.dev_gspojobs.yaml; - for stdout); "
    "its directory must exist.",
)
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml", help="Format.")
def crd(write: str, output: str) -> int:
    """Print the GSPOJob CustomResourceDefinition, generated from the pydantic models."""
    from gspo_operator.crd import render_crd, render_crd_yaml

    text = render_crd_yaml() if output == "yaml" else _dump(render_crd(), "json")
    if write == STDIN:
        click.echo(text, nl=False)
        return EXIT_OK
    path = Path(write)
    if not path.parent.is_dir():
        return _fail(
            f"{write}: no such directory {str(path.parent)!r}; create it first "
            f"(mkdir -p {path.parent})"
        )
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        return _fail(f"{write}: cannot write: {exc.strerror or exc}")
    return EXIT_OK


for _name, (_target, _help) in POD_COMMANDS.items():
    gspo.add_command(PassThrough(_name, _target, _help))


# Every command with its one line of help (the images' ENTRYPOINTs name one; tests check).
SUBCOMMANDS: dict[str, str] = {name: cmd.short_help or "" for name, cmd in gspo.commands.items()}


def main(argv: list[str] | None = None) -> int:
    """The console script: run `gspo ARGV...` and return its exit code (never raise for a
    user's error). Shell completion (_GSPO_COMPLETE set) prints and exits."""
    try:
        result = gspo.main(args=argv, prog_name="gspo", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        return EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        return EXIT_INVALID
    return result if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
