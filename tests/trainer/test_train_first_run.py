"""The first run a user makes: `gspo train` (real vLLM server, real learner), then `make lint`.

- The same --seed gives the same history through the real rollout server (per-sample seeds,
  so vLLM's batching does not decide who draws what); another seed gives another.
- `gspo train` with its default output directory, run from a checkout, leaves the tree
  lint-clean: gspo-run/ (checkpoints, DeepSpeed's scripts, the HF export) is ignored by git
  and by ruff. The run happens in a copy of the checkout so the real one is not touched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import REPO, checkout_env

from gspo_trainer.plot import read_history

pytestmark = pytest.mark.e2e
VOLATILE_SUFFIX = "_seconds"
VOLATILE = {"seconds", "time", "tokens_per_second"}
STEPS = 6  # a curve: six steps of rewards, losses and clip fractions to compare


def curve(out: Path) -> list[dict[str, float]]:
    return [
        {k: v for k, v in r.items() if k not in VOLATILE and not k.endswith(VOLATILE_SUFFIX)}
        for r in read_history(out / "checkpoints" / "history.jsonl")
    ]


def test_same_seed_same_curve_through_the_real_server(
    default_output_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """Run "a" is the default-output run below (seed 3, its own copy of the checkout): one
    start of the servers and learner fewer. "b" (seed 3) and "c" (seed 4) run side by side,
    so "b" also meets other timings than "a" and must still draw the same."""
    tree, done = default_output_run
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {"a": curve(tree / "gspo-run")}
    procs = {}
    for name, seed in (("b", 3), ("c", 4)):
        # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
        procs[name] = subprocess.Popen([sys.executable, "-m", "gspo_operator.cli", "train",
                                        "--output-dir", str(tmp_path / name), "--max-steps",
                                        str(STEPS), "--seed", str(seed), "--no-progress"],
                                       env=checkout_env(), cwd=REPO, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        for name, proc in procs.items():
            _, stderr = proc.communicate(timeout=420)
            assert proc.returncode == 0, stderr[-3000:]
            runs[name] = curve(tmp_path / name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert len(runs["a"]) == STEPS
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def copy_checkout(dest: Path) -> Path:
    """The files git would commit (tracked and untracked, not ignored), nothing else."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def default_output_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`gspo train` with its default output directory (gspo-run/) in a copy of the checkout,
    seed 3: the lint test reads its tree, the same-seed test its curve."""
    tree = copy_checkout(tmp_path_factory.mktemp("checkout"))
    env = checkout_env()
    env["PYTHONPATH"] = f"{tree / 'operator'}:{tree / 'trainer'}"
    # fmt: skip: each flag beside its value, as on a command line (ruff splits the pairs).
    done = subprocess.run([sys.executable, "-m", "gspo_operator.cli", "train", "--max-steps",
                           str(STEPS), "--seed", "3", "--no-progress"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=420)  # fmt: skip
    return tree, done


def test_train_with_the_default_output_then_lint_passes(
    default_output_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    tree, done = default_output_run
    # gspo-run/ is ignored by git: what `gspo train` writes never shows up to be committed.
    ignored = subprocess.run(["git", "check-ignore", "-q", "gspo-run/x.py"], cwd=REPO)
    assert ignored.returncode == 0
    assert done.returncode == 0, done.stderr[-3000:]
    out = tree / "gspo-run"
    assert (out / "checkpoints" / "history.jsonl").exists()
    # The output holds Python files (DeepSpeed copies zero_to_fp32.py into checkpoints):
    # without the exclusion ruff would lint them, and a user's `make lint` would fail.
    assert list(out.rglob("*.py")), "expected Python files under gspo-run/"
    ruff = Path(sys.executable).with_name("ruff")
    lint = subprocess.run([str(ruff), "check", "."], cwd=tree, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-2000:]
    # And ruff really looked at the tree: a file with a lint error outside gspo-run/ fails.
    (tree / "trainer" / "bad_probe.py").write_text("import os\n")
    probe = subprocess.run([str(ruff), "check", "."], cwd=tree, capture_output=True, text=True)
    assert probe.returncode != 0 and "bad_probe.py" in probe.stdout
