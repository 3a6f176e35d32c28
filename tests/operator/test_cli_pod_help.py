"""The pod commands' own flags: every one has help, and the defaults are shown."""

from __future__ import annotations

import re

import pytest
from checkout import run_gspo

POD_COMMANDS = ["operator", "rollout-server", "learner", "sandbox-server", "train"]


def flags_without_help(text: str) -> list[str]:
    """Option lines of argparse's help with nothing after the flag (and no help on the next
    line): argparse puts a flag's help on its line or the one below it."""
    lines = text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-{1,2}[\w-]+)(?:,? [^ ]+)*", line)
        if not m or m.group(1) in ("-h", "--help"):
            continue
        after = line[len(m.group(0)) :]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not after.strip() and not nxt.startswith(" " * 8):
            bare.append(m.group(1))
    return bare


def test_the_detector_finds_a_flag_without_help() -> None:
    text = "options:\n  -h, --help  show\n  --port PORT\n  --host HOST  where it listens\n"
    assert flags_without_help(text) == ["--port"]
    wrapped = "  --engine-arg KEY=VALUE\n                        extra argument\n"
    assert flags_without_help(wrapped) == []


@pytest.mark.parametrize("command", POD_COMMANDS)
def test_every_flag_has_help_and_defaults_show(command: str) -> None:
    done = run_gspo(command, "--help", timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: gspo {command}")
    assert flags_without_help(done.stdout) == [], done.stdout
    if command != "train":  # train's flags override the spec: their default is the spec's
        assert "(default:" in done.stdout, done.stdout
