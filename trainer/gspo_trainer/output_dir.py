"""The output directory of `gspo train`: one run in it at a time, logs kept across attempts.

Two runs on one directory would overwrite each other's gspojob.yaml (the first learner would
read the second's config), interleave their logs and leave a dead server's job-token, so
a run holds an exclusive lock (flock) on `.gspo-train.lock` for as long as it lives, with its
pid written inside; a second run is refused naming that pid. The processes the run starts
hold it too (train.spawn): killed outright, `gspo train` leaves its learner and servers
running, still writing here. The kernel drops the lock when the last holder exits, however
it exits, so a crashed run never leaves the directory locked.

A resumed run appends to each log after a header naming the attempt, so the reason the
previous attempt crashed is still there to read.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import BinaryIO

LOCK_FILE = ".gspo-train.lock"


class OutputDirError(RuntimeError):
    """The output directory cannot be used (one line, saying why and what to do)."""


def prepare(out: Path) -> None:
    """Create `out` and out/logs, or OutputDirError naming the path and the fix."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"--output-dir {out} is a file, not a directory; name a directory")
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        probe = out / ".gspo-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(
            f"--output-dir {out} is not writable ({exc.strerror or exc}); choose another "
            "directory or fix its permissions"
        ) from exc


def lock(out: Path) -> BinaryIO:
    """Hold the run lock of `out` (keep the returned file open while the run lives), or
    OutputDirError naming the pid of the run that holds it."""
    path = out / LOCK_FILE
    try:  # not through a symbolic link: the pid is written over what the file held
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise OutputDirError(
            f"--output-dir {out}: cannot use {LOCK_FILE} ({exc.strerror or exc}; a regular file "
            "is needed); remove it"
        ) from exc
    f = os.fdopen(fd, "r+b")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().decode(errors="replace").strip() or "unknown"
        f.close()
        raise OutputDirError(
            f"--output-dir {out} is in use by another run (pid {holder}); wait for it (and "
            "the learner and servers it started) to finish, stop it, or choose another "
            "--output-dir"
        ) from None
    f.truncate(0)
    f.seek(0)
    f.write(f"{os.getpid()}\n".encode())
    f.flush()
    return f


def open_log(path: Path, name: str) -> tuple[BinaryIO, int]:
    """`path` opened for appending after a header for this attempt, and the offset where the
    attempt's own output begins (earlier attempts' lines stay above it)."""
    f = open(path, "ab")  # noqa: SIM115 - handed to the child process, closed by the caller
    start = f.tell()
    newline = b""
    if start:
        with open(path, "rb") as r:
            r.seek(start - 1)
            newline = b"" if r.read(1) == b"\n" else b"\n"  # a crash may cut a line
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    f.write(newline + f"===== gspo train: {name} started {stamp} =====\n".encode())
    f.flush()
    return f, f.tell()
