"""`gspo train` refuses bad input in one line naming the file, row or field, with exit 2,
before it starts anything (no server, no learner, no output directory written)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from gspo_trainer import train
from gspo_trainer.jobs import tiny_manifest


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`gspo train` on a machine without GPUs, whose processes are recorded, not started."""
    started: list[str] = []

    def fake_spawn(name, args, env, log, cpus=None, keep_fds=()):  # type: ignore[no-untyped-def]
        started.append(name)
        raise AssertionError(f"{name} started despite bad input")

    monkeypatch.setattr(train, "_has_cuda", lambda: False)
    monkeypatch.setattr(train, "spawn", fake_spawn)
    return started


def job_with(tmp: Path, **sections: dict) -> Path:
    manifest = tiny_manifest()
    for section, fields in sections.items():
        manifest["spec"][section] = {**manifest["spec"][section], **fields}
    path = tmp / f"job-{len(list(tmp.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def rows_file(tmp: Path, *rows: object) -> str:
    path = tmp / f"rows-{len(list(tmp.glob('rows-*.jsonl')))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def broken_rows(tmp: Path) -> str:
    path = tmp / "broken.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "ans\n')
    return str(path)


def bad_job_file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (gspo train arguments, what its one line must say)."""
    out = ["--output-dir", str(tmp / "out")]
    good = str(job_with(tmp))
    a_file = tmp / "a-file"
    a_file.write_text("x")
    no_config = tmp / "model-dir"
    no_config.mkdir()
    q = {"prompt": "1+1=", "answer": "2"}
    data = {"source": "", "format": "jsonl"}

    def data_job(*rows: object) -> str:
        return str(job_with(tmp, data={**data, "source": rows_file(tmp, q, *rows)}))

    return {
        "missing job file": ([str(tmp / "nope.yaml"), *out], ["nope.yaml", "No such file"]),
        "broken YAML": (
            [bad_job_file(tmp, "broken.yaml", "spec: [1,\n"), *out],
            ["broken.yaml", "line 2"],
        ),
        "a list": ([bad_job_file(tmp, "list.yaml", "- 1\n- 2\n"), *out], ["list.yaml", "a list"]),
        "spec: 5": (
            [bad_job_file(tmp, "five.yaml", "spec: 5\n"), *out],
            ["five.yaml", "spec must be"],
        ),
        "output dir is a file": ([good, "--output-dir", str(a_file)], ["a-file", "is a file"]),
        "output dir not writable": ([good, "--output-dir", "/sys/gspo-out"], ["/sys/gspo-out"]),
        "a scalar row": ([data_job(5), *out], ["jsonl' line 2 is a int, not a mapping"]),
        "a null prompt": (
            [data_job({"prompt": None, "answer": "1"}), *out],
            ["jsonl' line 2 field 'prompt' is null"],
        ),
        "a null answer": (
            [data_job({"prompt": "x", "answer": None}), *out],
            ["jsonl' line 2 field 'answer' is null"],
        ),
        "a line that is not JSON": (
            [str(job_with(tmp, data={**data, "source": broken_rows(tmp)})), *out],
            ["broken.jsonl' line 2: not JSON"],
        ),
        "model dir without config.json": (
            [str(job_with(tmp, model={"name": str(no_config)})), *out],
            ["spec.model.name", "no config.json"],
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "missing job file",
        "broken YAML",
        "a list",
        "spec: 5",
        "output dir is a file",
        "output dir not writable",
        "a scalar row",
        "a null prompt",
        "a null answer",
        "a line that is not JSON",
        "model dir without config.json",
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(
    name: str, tmp_path: Path, no_spawn: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, expected = cases(tmp_path)[name]
    assert train.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo train: "), err
    for text in expected:
        assert text in lines[0], err
    assert no_spawn == []
    if name not in ("output dir is a file", "output dir not writable"):
        assert not (tmp_path / "out").exists()  # nothing written before the checks


def test_a_second_run_on_one_output_directory_is_refused_with_the_holders_pid(
    tmp_path: Path, no_spawn: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from gspo_trainer import output_dir

    out = tmp_path / "out"
    output_dir.prepare(out)
    config = out / "gspojob.yaml"
    config.write_text("the first run's config\n")
    with output_dir.lock(out):  # the first run, still going
        argv = [str(job_with(tmp_path)), "--output-dir", str(out), "--no-progress"]
        assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"is in use by another run (pid {os.getpid()})" in err and "\n" not in err, err
    assert config.read_text() == "the first run's config\n"  # not overwritten
    assert no_spawn == []


def test_the_run_lock_goes_with_its_holder_however_it_ends(tmp_path: Path) -> None:
    """A run killed outright (SIGKILL) leaves no lock behind: the kernel drops a flock."""
    import subprocess
    import sys

    from checkout import checkout_env

    from gspo_trainer import output_dir

    out = tmp_path / "out"
    output_dir.prepare(out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from gspo_trainer import output_dir; from pathlib "
            f"import Path; f = output_dir.lock(Path({str(out)!r})); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=checkout_env(),
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(output_dir.OutputDirError, match=f"pid {holder.pid}"):
        output_dir.lock(out)
    holder.kill()
    holder.wait(timeout=30)
    output_dir.lock(out).close()  # free again


def test_the_run_lock_stays_held_while_a_process_the_run_started_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gspo train` killed outright (SIGKILL) leaves its learner and servers running in
    sessions of their own: they hold the lock too, so a second run cannot start on the
    directory they still write to."""
    import sys

    from gspo_trainer import output_dir

    out = tmp_path / "out"
    output_dir.prepare(out)
    fake = tmp_path / "python"  # stands for the interpreter: a child that runs until killed
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    held = output_dir.lock(out)
    child = train.spawn(
        "learner", [], dict(os.environ), out / "logs" / "learner.log", keep_fds=(held.fileno(),)
    )
    try:
        held.close()  # the run's own process is gone, its child is not
        with pytest.raises(output_dir.OutputDirError, match="in use by another run"):
            output_dir.lock(out).close()
    finally:
        child.popen.kill()
        child.popen.wait(timeout=30)
    output_dir.lock(out).close()  # free once the last holder is gone


def test_gspo_train_checks_a_hub_data_set_offline_when_the_job_is(tmp_path: Path) -> None:
    """model.offline: gspo train's own check of the data (before any server starts) runs
    with HF_HUB_OFFLINE=1 as its learner would, refusing an uncached data set at once; it
    contacted the Hub (five retries, ~30 s here) and asked for the network."""
    import subprocess
    import sys

    from checkout import checkout_env

    job = job_with(tmp_path, model={"offline": True}, data={"source": "someorg/notcached"})
    env = checkout_env(HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)  # the job asks for it, not the caller
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gspo_operator.cli",
            "train",
            str(job),
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "not in this node's dataset cache" in lines[-1], done.stderr
    assert not any("huggingface.co" in line for line in lines), done.stderr


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """The lock is truncated to hold the pid: through a symbolic link that would empty the
    file it points at (as the job's token file refuses one); a directory is a one-line error."""
    from gspo_trainer import output_dir

    out = tmp_path / "out"
    output_dir.prepare(out)
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me\n")
    if kind == "symlink":
        (out / output_dir.LOCK_FILE).symlink_to(victim)
    else:
        (out / output_dir.LOCK_FILE).mkdir()
    with pytest.raises(output_dir.OutputDirError, match=output_dir.LOCK_FILE):
        output_dir.lock(out).close()
    assert victim.read_text() == "keep me\n"


def test_a_manifest_without_a_spec_is_named_as_one(tmp_path: Path) -> None:
    """kind: GSPOJob with no spec was read as a bare spec: 'spec.kind: unknown field'."""
    job = tmp_path / "job.yaml"
    job.write_text("apiVersion: gspo.dev/v1alpha1\nkind: GSPOJob\nmetadata: {name: x}\n")
    with pytest.raises(train.JobFileError, match=r"job.yaml: the GSPOJob has no spec"):
        train.read_job_file(str(job))


@pytest.mark.parametrize("count", ["0", "-3"])
def test_rollout_servers_below_one_is_a_usage_error(
    count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 fell back to spec.rollout.replicas and -3 to one server, both silently."""
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--rollout-servers", count])
    assert exit_.value.code == 2
    assert "--rollout-servers: must be 1 or more" in capsys.readouterr().err
