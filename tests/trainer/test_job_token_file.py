"""`gspo train` leaves the rollout servers' token where only its owner can read it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gspo_trainer.train import write_token_file


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_token_file_is_private(tmp_path: Path) -> None:
    write_token_file(tmp_path / "job-token", "s3cret")
    assert (tmp_path / "job-token").read_text() == "s3cret\n"
    assert mode(tmp_path / "job-token") == 0o600


def test_a_file_left_readable_by_others_is_made_private(tmp_path: Path) -> None:
    token = tmp_path / "job-token"
    token.write_text("an older, longer token\n")
    token.chmod(0o644)
    write_token_file(token, "new")
    assert token.read_text() == "new\n" and mode(token) == 0o600


def test_a_symbolic_link_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "bashrc"
    target.write_text("export PATH\n")
    target.chmod(0o644)
    (tmp_path / "job-token").symlink_to(target)
    with pytest.raises(RuntimeError, match="job-token is a symbolic link; remove it"):
        write_token_file(tmp_path / "job-token", "s3cret")
    assert target.read_text() == "export PATH\n" and mode(target) == 0o644
