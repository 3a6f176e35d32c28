"""Hostile programs in the code reward's sandbox: each scores 0 with its outcome named, the
learner (this process) is unaffected, and nothing leaks.

Where a program could gain by escaping, the test's expected output is what the escape would
print (the secret, the file's text, "connected"): a leak would score 1 and fail the test.
Network checks stay on loopback: a listener this test opens receives nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from gspo_api.ports import ENV_JOB_TOKEN, ENV_JOB_TOKEN_EARLIER
from gspo_api.spec import CodeConfig, SandboxConfig
from gspo_trainer.code import sandbox_init
from gspo_trainer.code.runner import CaseResult, CodeRunner
from gspo_trainer.code.sandbox import LocalSandbox
from gspo_trainer.code.service import RemoteSandbox, serve_sandbox
from gspo_trainer.code.tasks import Case, CodeTask

LIMITS = SandboxConfig(timeout_seconds=1, memory_mib=256, processes=16, output_bytes=1 << 16)
SECRET = "s3cret-job-token-0123456789"


# What a program that must finish gets: its 1 s would be a race on a loaded machine (a
# Python start alone can take longer there), lost as a "timeout" in place of the outcome the
# test asserts. The tests of the time limit itself run under LIMITS (TIGHT).
ROOMY = LIMITS.model_copy(update={"timeout_seconds": 10})


@pytest.fixture(autouse=True, params=["local", "service"])
def mode(request):
    """Every hostile program runs in both modes: in this process's sandbox, and sent to the
    same sandbox behind HTTP (reward.sandbox.mode service)."""
    global SANDBOX, TIGHT
    if request.param == "local":
        SANDBOX, TIGHT = LocalSandbox(ROOMY), LocalSandbox(LIMITS)
        yield request.param
        return
    servers = [serve_sandbox(LocalSandbox(c), "token", "127.0.0.1", 0) for c in (ROOMY, LIMITS)]
    for server in servers:
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    SANDBOX, TIGHT = (
        RemoteSandbox(f"http://127.0.0.1:{server.server_address[1]}", "token", 30)
        for server in servers
    )
    yield request.param
    for server in servers:
        server.shutdown()
        server.server_close()


SANDBOX: LocalSandbox | RemoteSandbox = LocalSandbox(ROOMY)  # set by `mode` for each test
TIGHT: LocalSandbox | RemoteSandbox = LocalSandbox(LIMITS)  # the same, with the 1 s limit


def run(
    program: str, expected: str, stdin: str = "", tight: bool = False
) -> tuple[CaseResult, float]:
    runner = CodeRunner(TIGHT if tight else SANDBOX, CodeConfig())
    case = Case(stdin, expected)
    t0 = time.monotonic()
    result = runner.run_case(program, CodeTask(cases=(case,)), case)
    return result, time.monotonic() - t0


def sandboxed_processes() -> set[int]:
    """Processes of the sandbox's user on the host (nobody when the learner is root), less
    those another pytest-xdist worker started: run as a user, the sandbox's user is the
    tester's own, whose servers and learners on the other workers come and go meanwhile."""
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid or int(pid) == os.getpid():
                continue
            if worker is not None and _other_workers(int(pid), worker):
                continue
            out.add(int(pid))
        except FileNotFoundError:  # the process ended meanwhile
            pass
    return out


def _other_workers(pid: int, worker: str) -> bool:
    """Whether `pid` carries another xdist worker's name in its environment (a process
    whose environment cannot be read is not another worker's)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    ours = f"PYTEST_XDIST_WORKER={worker}".encode()
    return any(e.startswith(b"PYTEST_XDIST_WORKER=") and e != ours for e in env)


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every program's processes are gone once its run returns."""
    before = sandboxed_processes()
    yield
    assert sandboxed_processes() - before == set()


def test_the_job_token_file_and_environment_secrets_stay_out(tmp_path, monkeypatch) -> None:
    token = tmp_path / "job-token"
    token.write_text(SECRET)
    token.chmod(0o644)  # even a world-readable file is out of sight
    for name in (ENV_JOB_TOKEN, ENV_JOB_TOKEN_EARLIER, "HF_TOKEN"):  # the pods set all three
        monkeypatch.setenv(name, SECRET)
    program = (
        "import os\n"
        f"print(os.environ.get({ENV_JOB_TOKEN!r}) or os.environ.get({ENV_JOB_TOKEN_EARLIER!r})"
        f" or os.environ.get('HF_TOKEN') or open({str(token)!r}).read())\n"
    )
    result, _ = run(program, SECRET)
    assert result.outcome == "runtime_error"  # the file is not there
    assert SECRET not in result.detail and "No such file" in result.detail
    leak, _ = run("import os\nprint(sorted(os.environ))", "[]")
    assert leak.outcome == "wrong_answer"


def test_files_outside_its_directory_and_the_checkpoints_are_out_of_sight(tmp_path) -> None:
    outside = tmp_path / "notes.txt"
    outside.write_text("private")
    outside.chmod(0o644)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(mode=0o777)
    reads = [str(outside), "/etc/passwd", "/var/run/secrets/kubernetes.io/serviceaccount/token",
             f"/proc/{os.getpid()}/environ"]  # fmt: skip
    program = (
        "found = []\n"
        f"for path in {reads!r}:\n"
        "    try:\n"
        "        found.append(open(path).read())\n"
        "    except OSError:\n"
        "        pass\n"
        f"open({str(checkpoints / 'step-999')!r}, 'w').write('x')\n"
        "print(found[0])\n"
    )
    result, _ = run(program, "private")
    assert result.outcome == "runtime_error"
    assert list(checkpoints.iterdir()) == []
    writes, _ = run("open('own.txt', 'w').write('mine')\nprint(open('own.txt').read())", "mine")
    assert writes.outcome == "passed"  # its own directory is writable


def test_no_network_a_loopback_listener_receives_nothing() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
            "s.sendall(b'stolen')\n"
            "print('connected')\n"
        )
        result, _ = run(program, "connected")
        assert result.outcome == "runtime_error"
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_a_fork_bomb_hits_the_process_limit() -> None:
    program = "import os\nwhile True:\n    os.fork()\n"
    result, seconds = run(program, "", tight=True)
    assert result.outcome in ("runtime_error", "timeout")
    assert seconds < 3


def test_ten_times_the_memory_limit_is_a_memory_outcome() -> None:
    result, _ = run(f"x = bytearray({10 * LIMITS.memory_mib} << 20)\nprint(len(x))", "")
    assert result.outcome == "memory"


def test_an_infinite_loop_times_out_on_time() -> None:
    result, seconds = run("while True:\n    pass\n", "", tight=True)
    assert result.outcome == "timeout"
    assert seconds < LIMITS.timeout_seconds + 1.5


def test_a_large_input_never_read_times_out_instead_of_blocking_the_learner() -> None:
    result, seconds = run("import time\ntime.sleep(60)", "", stdin="x" * (4 << 20), tight=True)
    assert result.outcome == "timeout"
    assert seconds < LIMITS.timeout_seconds + 1.5
    echoed, _ = run("import sys\nprint(len(sys.stdin.read()))", str(4 << 20), "x" * (4 << 20))
    assert echoed.outcome == "passed"


def test_a_gigabyte_of_output_is_cut_off_early() -> None:
    program = "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * (1 << 16))\n"
    result, seconds = run(program, "x")
    assert result.outcome == "runtime_error"
    assert seconds < 3


def test_killing_its_parent_and_everyone_else_touches_nothing_outside() -> None:
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        program = (
            "import os, signal\n"
            "for pid in (os.getppid(), 1, -1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
            f"os.kill({bystander.pid}, signal.SIGKILL)\n"
        )
        result, _ = run(program, "")
        assert result.outcome in ("runtime_error", "wrong_answer")
        assert bystander.poll() is None
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_children_sleeping_past_the_timeout_are_killed_with_it() -> None:
    program = (
        "import os, signal, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "time.sleep(60)\n"
    )
    result, seconds = run(program, "", tight=True)
    assert result.outcome == "timeout"
    assert seconds < LIMITS.timeout_seconds + 1.5  # and no_leftovers checks they are gone


def test_a_program_that_exits_early_keeping_children_is_not_waited_for() -> None:
    program = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('5')\n"
    )
    result, seconds = run(program, "5")
    assert result.outcome == "passed"  # its answer counts; its child dies with it
    assert seconds < 1.0


def test_filling_its_directory_and_tmp_takes_none_of_the_learners_disk(
    tmp_path, monkeypatch, mode
) -> None:
    """Its directory and /tmp are small tmpfs of its own: many files each under fileBytes, or
    many empty ones, stop at their caps instead of filling the learner's disk."""
    if mode == "service":
        pytest.skip("the same LocalSandbox: one mode is enough")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the sandbox's dirs go
    program = (
        "import os\n"
        "chunk = b'x' * (4 << 20)\n"
        "for where, files in (('.', 10000), ('/tmp', 0)):\n"
        "    try:\n"
        "        for i in range(40):\n"
        "            with open(f'{where}/big{i}', 'wb') as f:\n"
        "                f.write(chunk)\n"
        "        print('room for 160 MiB')\n"
        "    except OSError:\n"
        "        print('full')\n"
        "try:\n"
        "    for i in range(10000):\n"
        "        os.close(os.open(str(i), os.O_CREAT | os.O_WRONLY))\n"
        "    print('room for 10000 files')\n"
        "except OSError:\n"
        "    print('full')\n"
    )
    roomy = LocalSandbox(ROOMY)
    result = CodeRunner(roomy, CodeConfig()).run_case(
        program, CodeTask(cases=(Case("", "full\nfull\nfull"),)), Case("", "full\nfull\nfull")
    )
    assert result.outcome == "passed", result
    assert list(tmp_path.iterdir()) == []


def test_a_tree_too_deep_or_unreadable_neither_crashes_the_learner_nor_stays(
    tmp_path, monkeypatch, mode
) -> None:
    """What a program leaves in its directory goes with its run, whatever its shape: a tree
    deeper than shutil.rmtree's recursion, a directory it made unreadable to its owner."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    program = (
        "import os\n"
        "os.mkdir('closed')\n"
        "open('closed/kept', 'wb').write(b'x' * (1 << 20))\n"
        "os.chmod('closed', 0)\n"
        "for _ in range(1200):\n"
        "    os.mkdir('d')\n"
        "    os.chdir('d')\n"
        "print('left')\n"
    )
    result, _ = run(program, "left")
    assert result.outcome == "passed", result
    assert list(tmp_path.iterdir()) == []
    if mode == "local":  # isolation none: the program wrote in the learner's own directory
        bare = LocalSandbox(LIMITS.model_copy(update={"isolation": "none"}))
        done = bare.run({"p.py": program}, ["{python}", "-I", "-S", "p.py"])
        assert done.stdout == b"left\n", done
        assert list(tmp_path.iterdir()) == []


def test_a_program_is_the_first_the_out_of_memory_killer_takes() -> None:
    """No cgroup caps a program's processes together (each has memoryMiB of address space,
    and memfds or pipes hold memory outside it): when the pod runs out, the kernel must kill
    the program, not the learner. It runs at oom_score_adj 1000 (whether it can lower it
    depends on the learner's CAP_SYS_RESOURCE: docs/rewards.md)."""
    result, _ = run("print(open('/proc/self/oom_score_adj').read())", "1000")
    assert result.outcome == "passed", result


SQUARE_TESTS = CodeTask(
    test="def check(f):\n    assert f(2) == 4\n    assert abs(f(3) - 9) < 1e-9\n",
    entry_point="square",
)
FORGERIES = {
    "the token from the harness's frame": (
        "import os, sys\nprint(sys._getframe(1).f_locals['done'])\nsys.stdout.flush()\n"
        "os._exit(0)\n"
    ),
    "builtins the tests use, patched": (
        "import builtins\ndef square(x):\n    return 0\n"
        "_compile = compile\n"
        "builtins.compile = lambda *a, **k: _compile('pass', 'test.py', 'exec')\n"
    ),
    "the expected values, read from the test file": (
        "import re\nsource = open('test.py').read()\n"
        "answers = {int(a): int(b) for a, b in re.findall(r'f\\((\\d+)\\) - (\\d+)', source)}\n"
        "answers[2] = 4\n"
        "def square(x):\n    return answers[x]\n"
    ),
    "a built-in the tests call, shadowed": (
        "def abs(x):\n    return 0\ndef square(x):\n    return 4 if x == 2 else 0\n"
    ),
    "an object equal to anything": (
        "class Any:\n    def __eq__(self, other):\n        return True\n"
        "def square(x):\n    return Any()\n"
    ),
    "an exit before the asserts": "import os\nos._exit(0)\ndef square(x):\n    return x * x\n",
}


def test_assert_style_tests_are_judged_out_of_the_programs_reach() -> None:
    """The tests run in the harness, the program in a process of its own that gets data in
    and out: it cannot read the tests or the token, nor patch what the tests run on."""
    runner = CodeRunner(SANDBOX, CodeConfig())
    honest = runner.run_case("def square(x):\n    return x * x\n", SQUARE_TESTS, None)
    assert honest.outcome == "passed", honest
    for how, program in FORGERIES.items():
        result = runner.run_case(program, SQUARE_TESTS, None)
        assert result.outcome != "passed", how


def test_without_namespaces_the_code_reward_refuses_unless_isolation_none(
    monkeypatch, caplog
) -> None:
    """Where the machine forbids namespaces (a pod under the runtime's default seccomp
    profile), the probe's failure stops the run at start, naming the setting."""
    from gspo_trainer.code import runner

    monkeypatch.setattr(LocalSandbox, "probe", lambda self: "unshare: Operation not permitted")
    with pytest.raises(ValueError, match=r"reward\.sandbox\.isolation namespaces.*isolation: none"):
        runner.build_code_scorer(CodeConfig(), SandboxConfig())
    monkeypatch.undo()
    scorer = runner.build_code_scorer(CodeConfig(), SandboxConfig(isolation="none"))
    assert "isolation is none" in caplog.text
    assert scorer.runner.sandbox.cfg.isolation == "none"


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists() or not shutil.which("setpriv"),
    reason="needs root to act out a non-root learner, setpriv and a system Python",
)
def test_a_non_root_learner_without_privileges_gets_the_same_isolation() -> None:
    """The operator's learner: not root, no capabilities, no_new_privs. Its own files (the
    token, the checkpoints: owned by its uid) must stay out of the program's sight too."""
    tmp_path = Path(tempfile.mkdtemp(prefix="gspo-non-root-"))  # pytest's is root's alone
    try:
        _non_root_run(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _non_root_run(tmp_path: Path) -> None:
    learner_uid = 65534
    box = tmp_path / "box"
    (box / "work").mkdir(parents=True)
    (box / "root").mkdir()
    token = tmp_path / "job-token"
    token.write_text(SECRET)
    token.chmod(0o600)
    os.chown(token, learner_uid, learner_uid)
    program = (
        f"import os\nprint(os.getuid(), os.listdir('/'))\nprint(open({str(token)!r}).read())\n"
    )
    (box / "work" / "p.py").write_text(program)
    for path in (tmp_path, box, box / "work", box / "root", box / "work" / "p.py"):
        os.chown(path, learner_uid, learner_uid)
    status_r, status_w = os.pipe()
    plan = {
        "isolation": "namespaces", "workdir": str(box / "work"), "root": str(box / "root"),
        "read_only": ["/usr", "/lib", "/lib64", "/bin"], "tmp_bytes": 1 << 20,
        "work_bytes": 1 << 20, "inodes": 64,
        "status_fd": status_w, "argv": [SYSTEM_PYTHON, "-I", "-S", "p.py"],
        "env": {"PATH": "/usr/bin"},
        "cpu_seconds": 2, "memory_bytes": 256 << 20, "processes": 16, "file_bytes": 1 << 20,
        "open_files": 64,
    }  # fmt: skip
    (box / "plan.json").write_text(json.dumps(plan))
    init = Path(sandbox_init.__file__)
    shutil.copy(init, box / "init.py")
    done = subprocess.run(
        ["setpriv", f"--reuid={learner_uid}", f"--regid={learner_uid}", "--clear-groups",
         "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
         SYSTEM_PYTHON, "-I", "-S", str(box / "init.py"), str(box / "plan.json")],
        capture_output=True, timeout=10, pass_fds=(status_w,), env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    os.close(status_w)
    status = os.read(status_r, 4096)
    os.close(status_r)
    assert status == b"ok", done.stderr
    first = done.stdout.decode().splitlines()[0]
    assert first.startswith("0 ") and "'work'" in first and "'tmp'" in first
    assert SECRET.encode() not in done.stdout and b"No such file" in done.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists() or not shutil.which("setpriv"),
    reason="needs root to act out a non-root learner, setpriv and a system Python",
)
def test_isolation_none_under_a_busy_non_root_learner_still_runs_assert_style_tests() -> None:
    """Without namespaces the process limit counts every process and thread of the
    learner's uid (the learner's own dozens included): the harness's fork, and any program's,
    must still fit under it."""
    tmp_path = Path(tempfile.mkdtemp(prefix="gspo-none-"))
    learner = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]  # fmt: skip
    busy = subprocess.Popen(
        [*learner, SYSTEM_PYTHON, "-I", "-S", "-c",
         "import sys, threading\nfor _ in range(40):\n"
         "    threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
         "print('up', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert busy.stdout and busy.stdout.readline() == b"up\n"
        work = tmp_path / "work"
        work.mkdir(parents=True)
        files = {"harness.py": CodeRunner(SANDBOX, CodeConfig()).harness,
                 "program.py": "def square(x):\n    return x * x\n",
                 "test.py": SQUARE_TESTS.test or "", "done": "token"}  # fmt: skip
        for name, text in files.items():
            (work / name).write_text(text)
        status_r, status_w = os.pipe()
        plan = {
            "isolation": "none", "workdir": str(work), "status_fd": status_w,
            "argv": [SYSTEM_PYTHON, "-I", "-S", "harness.py", "program.py", "test.py", "square",
                     "done"], "same_python": True, "env": {"PATH": "/usr/bin"},
            "cpu_seconds": 2, "memory_bytes": 256 << 20, "processes": 16, "file_bytes": 1 << 20,
            "open_files": 64,
        }  # fmt: skip
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        shutil.copy(Path(sandbox_init.__file__), tmp_path / "init.py")
        for path in (tmp_path, work, *work.iterdir(), tmp_path / "plan.json"):
            os.chown(path, 65534, 65534)
        done = subprocess.run(
            [*learner, SYSTEM_PYTHON, "-I", "-S", str(tmp_path / "init.py"),
             str(tmp_path / "plan.json")],
            capture_output=True, timeout=10, pass_fds=(status_w,), env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        os.close(status_w)
        os.close(status_r)
        assert done.stdout.rstrip().endswith(b"token"), done.stderr
    finally:
        busy.kill()
        busy.wait()
        shutil.rmtree(tmp_path)


def _userns_allowed() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _userns_allowed(), reason="needs unshare and user namespaces")
def test_a_rootless_containers_root_is_isolated_and_a_refusal_names_unshare(tmp_path, mode) -> None:
    """Root in a user namespace that maps only itself (a rootless container, a pod with
    hostUsers: false): nobody is not there to become, yet the program is isolated. Where
    the kernel refuses user namespaces (max_user_namespaces 0 in it), the probe says so."""
    if mode == "service":
        pytest.skip("the learner's own sandbox: one mode is enough")
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    program = f"import os\nprint(sorted(os.listdir('/')))\nprint(open({str(secret)!r}).read())"
    script = (
        "from gspo_trainer.code.sandbox import LocalSandbox\n"
        "from gspo_api.spec import SandboxConfig\n"
        "sandbox = LocalSandbox(SandboxConfig())\n"
        "print(sandbox.probe())\n"
        f"result = sandbox.run({{'p.py': {program!r}}}, ['{{python}}', '-I', '-S', 'p.py'])\n"
        "print(result.stdout.decode(), result.stderr.decode()[-200:])\n"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    rootless = ["unshare", "-U", "-r", "--fork"]
    done = subprocess.run(
        [*rootless, sys.executable, "-c", script], capture_output=True, env=env, timeout=30
    )
    lines = done.stdout.decode().splitlines() or [""]
    assert lines[0] == "None", done.stdout + done.stderr  # the probe ran a program
    assert "'work'" in lines[1] and SECRET not in done.stdout.decode()
    refused = subprocess.run(
        [*rootless, "sh", "-c", 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
         "-", sys.executable, "-c", script],
        capture_output=True, env=env, timeout=30,
    )  # fmt: skip
    assert refused.stdout.decode().startswith("[Errno 28] unshare:"), refused


@pytest.mark.skipif(not _userns_allowed(), reason="needs unshare and user namespaces")
def test_a_volume_mounted_under_usr_stays_out_of_sight(mode) -> None:
    """/usr and the Python install are bound into the program's root read-only: a volume the
    pod mounts under them (spec.learner.volumes may put one anywhere) must not come along.
    Acted out in a mount namespace of the test's own, as root and as a rootless root."""
    if mode == "service":
        pytest.skip("the learner's own sandbox: one mode is enough")
    under = next(p for p in ("/usr/local/src", "/usr/local/games", "/usr/src") if os.path.isdir(p))
    program = f"print(open({under + '/secret'!r}).read())"
    script = (
        "import subprocess\n"
        f"subprocess.run(['mount', '-t', 'tmpfs', 'volume', {under!r}], check=True)\n"
        f"open({under + '/secret'!r}, 'w').write({SECRET!r})\n"
        "from gspo_trainer.code.sandbox import LocalSandbox\n"
        "from gspo_api.spec import SandboxConfig\n"
        f"result = LocalSandbox(SandboxConfig()).run({{'p.py': {program!r}}}, "
        "['{python}', '-I', '-S', 'p.py'])\n"
        "print(result.stdout.decode(), result.stderr.decode(), result.failure)\n"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    as_root = [["unshare", "-m", "--propagation", "private"]] if os.geteuid() == 0 else []
    for unshare in [*as_root, ["unshare", "-U", "-r", "-m", "--propagation", "private"]]:
        done = subprocess.run(
            [*unshare, sys.executable, "-c", script], capture_output=True, env=env, timeout=30
        )
        assert b"No such file" in done.stdout, (unshare, done.stdout, done.stderr)
        assert SECRET.encode() not in done.stdout


def test_with_isolation_none_what_a_program_leaves_dies_with_it(mode) -> None:
    """No PID namespace there: grandchildren that setsid (a new session, out of the group the
    sandbox kills) and ignore SIGTERM must still end when the program ends or times out,
    not live on under the pod's init, holding the output pipe the learner waits on."""
    if mode == "service":
        pytest.skip("the learner's own sandbox: one mode is enough")
    program = (
        "import os, signal, sys, time\n"
        "r, w = os.pipe()\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "            print(os.getpid(), flush=True)\n"
        "            os.write(w, b'x')\n"
        "            time.sleep(60)\n"
        "        os._exit(0)\n"
        # every grandchild has printed (a fixed pause lost that race on a busy machine)
        "got = 0\n"
        "while got < 3:\n"
        "    got += len(os.read(r, 3 - got))\n"
        "print('done', flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
    )
    bare = LocalSandbox(LIMITS.model_copy(update={"isolation": "none"}))
    for sleep, timed_out in (("0", False), ("60", True)):
        result = bare.run({"p.py": program}, ["{python}", "-I", "-S", "p.py", sleep])
        *pids, last = result.stdout.split()
        try:
            assert (last, len(pids), result.timed_out) == (b"done", 3, timed_out), result
            assert result.seconds < LIMITS.timeout_seconds + 1.5
            assert not [p for p in pids if os.path.exists(f"/proc/{int(p)}")]
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
