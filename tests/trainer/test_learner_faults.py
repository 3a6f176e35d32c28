"""Learner faults: tampered checkpoints are skipped, a full disk stops the run, SIGKILL resumes."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest
from learner_helpers import make_learner, run, tiny_spec
from learner_proc import reference_params, sigkill_trial

from gspo_trainer import checkpoint as ckpt


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def manifest_for(steps: int, every: int = 1, keep: int = 3) -> dict:
    manifest = tiny_spec(maxSteps=steps)
    manifest["spec"]["checkpoint"] = {"everySteps": every, "keep": keep}
    return manifest


@pytest.fixture(scope="module")
def two_steps(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 1 and 2 of the tiny job (copied by each test before changing)."""
    root = tmp_path_factory.mktemp("two-steps")
    assert run(make_learner(cache, root, manifest_for(2))) == 0
    assert [s for s, _ in ckpt.list_complete(root)] == [1, 2]
    return root


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("tamper", ["flip a byte", "truncate", "delete"])
def test_a_tampered_checkpoint_is_skipped_for_the_previous_one_with_a_log_line(
    tamper: str, cache: Path, two_steps: Path, tmp_path: Path, caplog
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(two_steps, root)
    victim = root / "step-000002" / "engine" / "mp_rank_00_model_states.pt"
    if tamper == "flip a byte":
        flip_byte(victim, victim.stat().st_size // 2)  # same size: only the checksum tells
    elif tamper == "truncate":
        truncate(victim)
    else:
        victim.unlink()
    learner = make_learner(cache, root, manifest_for(3))
    with caplog.at_level(logging.WARNING):
        assert learner.resume() == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "step-000002 failed verification" in warned[0]
    assert "engine/mp_rank_00_model_states.pt" in warned[0]
    assert learner.state.last_checkpoint == "step-000001"


@pytest.mark.e2e
def test_sigkill_inside_a_checkpoint_write_resumes_to_the_straight_runs_parameters(
    cache: Path, tmp_path: Path
) -> None:
    steps, every = 3, 1
    reference = reference_params(cache, tmp_path / "straight", steps, every)
    work = tmp_path / "killed"
    work.mkdir()
    # Killed the moment the aside directory appears: inside the write (~30 ms here).
    ok, note, lost, in_write = sigkill_trial(
        cache, work, steps, every, reference, random.Random(3), mid_write=True, max_delay_s=0.0
    )
    assert ok, note
    assert in_write, note
    assert lost <= every
