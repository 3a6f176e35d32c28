"""The local sandbox: one model-written program, run isolated and limited, in a thread.

Each run gets a private temporary directory (removed after), a fresh session and process
group, a scrubbed environment (PATH, LANG and HOME only: no secret of the job),
and sandbox_init.py as its first process, which applies the isolation and the resource limits
(reward.sandbox) before the program starts. The wall-clock limit is enforced here: past it,
or past the output cap, the whole group is killed (and with namespaces, the program's PID
namespace dies with it, children included). What cannot be set up is a `sandbox_failure`,
never blamed on the program.

`probe()` runs a trivial program once at start: reward.sandbox.isolation namespaces refuses
to train where the machine forbids namespaces, naming the setting that would allow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_api.spec import SandboxConfig

INIT = Path(__file__).with_name("sandbox_init.py")
OPEN_FILES = 64
SETUP_SECONDS = 30  # for the sandbox to start the program; its own limit starts then
TMP_BYTES = 64 << 20  # its /tmp and its own directory (tmpfs: the pod's memory, not disk)
INODES = 4096  # files and directories in each of them


@dataclass(frozen=True)
class RunResult:
    """How one program run ended. `exit_code` is shell-style (128 + signal when killed)."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float
    timed_out: bool = False  # past the wall-clock limit
    output_capped: bool = False  # stdout or stderr past the cap: killed
    failure: str | None = None  # the sandbox itself could not run it


def python_prefix() -> str:
    """The install the sandboxed interpreter needs (read-only in its root): the real
    interpreter's prefix, not the virtual environment's (the program runs without site)."""
    return str(Path(os.path.realpath(sys.executable)).parent.parent)


class LocalSandbox:
    """Runs programs on this machine under reward.sandbox's isolation and limits."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.python = os.path.realpath(sys.executable)
        self.read_only = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", python_prefix()]

    def run(
        self,
        files: dict[str, str],
        argv: list[str],
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
    ) -> RunResult:
        """Write `files` into a fresh directory and run `argv` there ("{python}" is the
        interpreter; paths are relative to the directory)."""
        box = Path(tempfile.mkdtemp(prefix="gspo-sandbox-"))
        try:
            return self._run(box, files, argv, stdin, env or {})
        except OSError as exc:
            return RunResult(None, b"", b"", 0.0, failure=f"{type(exc).__name__}: {exc}")
        finally:
            _remove(box)

    def _run(
        self, box: Path, files: dict[str, str], argv: list[str], stdin: bytes, env: dict[str, str]
    ) -> RunResult:
        cfg = self.cfg
        work = box / "work"
        work.mkdir()
        (box / "root").mkdir()
        for name, text in files.items():
            (work / name).write_text(text, encoding="utf-8")
        status_r, status_w = os.pipe()
        plan = {
            "isolation": cfg.isolation,
            "workdir": str(work),
            "root": str(box / "root"),
            "read_only": self.read_only,
            "tmp_bytes": TMP_BYTES,
            "work_bytes": max(TMP_BYTES, cfg.file_bytes),
            "inodes": INODES,
            "status_fd": status_w,
            "argv": [self.python if a == "{python}" else a for a in argv],
            "same_python": True,
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", **env},
            "cpu_seconds": max(1, round(cfg.timeout_seconds)),
            "memory_bytes": cfg.memory_mib << 20,
            "processes": cfg.processes,
            "file_bytes": cfg.file_bytes,
            "open_files": OPEN_FILES,
        }
        plan_path = box / "plan.json"
        plan_path.write_text(json.dumps(plan), encoding="utf-8")
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", str(INIT), str(plan_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"},
                cwd=box,
                start_new_session=True,
                pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
        try:
            out, err, status, timed_out, capped = self._communicate(proc, stdin, status_r)
        finally:
            os.close(status_r)
            if proc.returncode is None:
                _kill_group(proc)
        seconds = time.monotonic() - t0
        if status != b"ok":  # "ok fail: <why>" when exec failed; "fail: <why>" before
            why = status.decode(errors="replace").partition("fail: ")[2] or "did not start"
            return RunResult(None, out, err, seconds, failure=why)
        return RunResult(
            proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
            out,
            err,
            seconds,
            timed_out,
            capped,
        )

    def _communicate(
        self, proc: subprocess.Popen, stdin: bytes, status_fd: int
    ) -> tuple[bytes, bytes, bytes, bool, bool]:
        """Feed stdin, read stdout/stderr up to the cap and the sandbox's status, until the
        program ends or its wall-clock limit, which starts when the sandbox reports it ready
        (a loaded machine's slow set-up is not the program's time). Nothing here blocks: a
        program that never reads a large stdin still times out."""
        cfg, cap = self.cfg, self.cfg.output_bytes
        limit = time.monotonic() + SETUP_SECONDS
        started = timed_out = capped = False
        assert proc.stdin and proc.stdout and proc.stderr
        stdin_fd, pending = proc.stdin.fileno(), memoryview(stdin)
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        status = bytearray()
        with selectors.DefaultSelector() as sel:
            for fd in (*bufs, status_fd):
                sel.register(fd, selectors.EVENT_READ)
            if pending:
                os.set_blocking(stdin_fd, False)
                sel.register(stdin_fd, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            open_outputs = len(bufs)
            while open_outputs and not capped:
                left = limit - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == stdin_fd:
                        try:
                            pending = pending[os.write(fd, pending[:65536]) :]
                        except BlockingIOError:
                            continue
                        except OSError:  # the program closed its stdin
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        sel.unregister(fd)
                        open_outputs -= fd != status_fd
                    elif fd == status_fd:
                        status += chunk
                        if not started and status.startswith(b"ok"):
                            started, limit = True, time.monotonic() + cfg.timeout_seconds
                    else:
                        buf = bufs[fd]
                        buf += chunk[: cap + 1 - len(buf)]
                        capped = capped or len(buf) > cap
        self._stop(proc)
        if not proc.stdin.closed:
            proc.stdin.close()
        status += _read_all(status_fd)
        proc.stdout.close()
        proc.stderr.close()
        out, err = (bytes(b[:cap]) for b in bufs.values())
        if timed_out and not started:
            status += f" fail: the sandbox did not start within {SETUP_SECONDS} s".encode()
        return out, err, bytes(status), timed_out, capped

    def _stop(self, proc: subprocess.Popen) -> None:
        """End the run and everything it started. The first process, on SIGTERM, kills the
        PID namespace (with namespaces) or every process below it (isolation none, as their
        subreaper) and returns once they are gone; the group is killed after anyway."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
        _kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def probe(self) -> str | None:
        """None when a program runs under this isolation here, else why not."""
        return probe(self)

    def probe_run(self) -> tuple[str | None, bool]:
        """probe(), and whether its failure may pass (module probe_run)."""
        return probe_run(self)


def probe(sandbox: Any) -> str | None:
    """None when `sandbox` (local or remote) runs a trivial program, else why not."""
    return probe_run(sandbox)[0]


def probe_run(sandbox: Any) -> tuple[str | None, bool]:
    """probe(), and whether a failure may pass: the program did not finish in time (a cold
    or loaded node), rather than the isolation being refused."""
    result = sandbox.run({"probe.py": "print('ok')"}, ["{python}", "-I", "-S", "probe.py"])
    if result.failure:
        return result.failure, result.timed_out
    if result.stdout.strip() != b"ok":
        why = f"a trivial program failed (exit {result.exit_code}): {result.stderr[-300:]!r}"
        return why, result.timed_out
    return None, False


STOP_SECONDS = 7  # _stop: 2 s for the first process to end the run, 5 s after the kill


def run_bound_seconds(cfg: SandboxConfig) -> float:
    """The longest one run can take: the sandbox's start, the program's limit, its stop."""
    return SETUP_SECONDS + cfg.timeout_seconds + STOP_SECONDS


def _remove(box: Path) -> None:
    """Remove a run's directory, whatever the program left in it. With namespaces it holds
    only what the sandbox wrote (the program's directory is a tmpfs of its own); with
    isolation none the program wrote here itself: a tree too deep for shutil.rmtree's
    recursion, or a directory it made unreadable to its owner, is left to chmod and rm, which
    walk any depth, rather than crashing the scorer or staying on the learner's disk."""
    try:
        shutil.rmtree(box)
    except (OSError, RecursionError):
        for argv in (["chmod", "-R", "u+rwx"], ["rm", "-rf", "--one-file-system"]):
            with contextlib.suppress(OSError):
                subprocess.run([*argv, str(box)], capture_output=True, check=False)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    return out
