"""`gspo` as a person runs it: help, unknown commands, and `gspo crd`."""

from __future__ import annotations

import yaml

from gspo_operator.cli import SUBCOMMANDS
from gspo_operator.crd import render_crd


def test_help_lists_every_subcommand(gspo) -> None:
    out = gspo("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_unknown_command_fails_with_usage(gspo) -> None:
    out = gspo("trian")
    assert out.returncode == 2
    assert "unknown command 'trian'" in out.stderr
    assert "train" in out.stderr


def test_crd_prints_the_generated_definition(gspo) -> None:
    out = gspo("crd")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == render_crd()
