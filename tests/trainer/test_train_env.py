"""The environment `gspo train` gives its servers and learner: Hub access as on a cluster, and
cores of their own on a machine without GPUs."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from gspo_api import ports
from gspo_api.validation import parse_spec
from gspo_operator.render import render_job
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.train import (
    ENGINE_NICE,
    place_on_cpus,
    process_env,
    scratch_dir,
    server_cpus,
    server_env,
    spawn,
    torch_cache_dir,
)


def spec_with(name: str, offline: bool = False):  # type: ignore[no-untyped-def]
    manifest = tiny_manifest()
    manifest["spec"]["model"].update(name=name, offline=offline)
    return parse_spec(manifest["spec"])


@pytest.mark.parametrize(
    ("name", "offline", "expected"),
    [
        ("builtin:small-qwen3-moe", False, "1"),  # built on the spot: nothing to download
        ("Qwen/Qwen3-0.6B", False, None),  # a Hub model downloads, as transformers would
        ("Qwen/Qwen3-0.6B", True, "1"),  # unless the job says offline
    ],
)
def test_hub_access_follows_the_model(name: str, offline: bool, expected: str | None) -> None:
    env = process_env(spec_with(name, offline), {"PATH": "/bin", "RANK": "3"}, Path("/c"), "t")
    assert env.get("HF_HUB_OFFLINE") == expected
    assert env["PATH"] == "/bin" and "RANK" not in env  # the caller's, less its own group


def test_the_same_rule_as_the_pods_on_a_cluster() -> None:
    for name, offline in (
        ("builtin:tiny-qwen3", False),
        ("Qwen/Qwen3-0.6B", False),
        ("Qwen/Qwen3-0.6B", True),
    ):
        spec = spec_with(name, offline)
        local = process_env(spec, {}, Path("/c"), "t").get("HF_HUB_OFFLINE")
        job = {"metadata": {"name": "env", "namespace": "ml", "uid": "u"}}
        objects = render_job(job, spec, token="t")
        envs = [e for e in _env_vars(objects) if e.get("name") == "HF_HUB_OFFLINE"]
        assert (local == "1") == bool(envs), name


def _env_vars(node: object) -> list[dict]:
    """Every container env entry anywhere in the rendered objects."""
    found: list[dict] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                found += [e for e in value if isinstance(e, dict)]
            else:
                found += _env_vars(value)
    elif isinstance(node, list):
        for item in node:
            found += _env_vars(item)
    return found


@pytest.mark.parametrize(
    ("cpus", "servers", "ranks", "bind", "learner"),
    [
        ([0, 1], 1, 1, ["0"], [1]),  # this machine: vLLM's worker on 0, the learner on 1
        ([3, 0, 2, 1], 1, 1, ["0,1,2"], [3]),  # sorted: the learner takes the last
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, 2, ["0,1,2", "3,4,5"], [6, 7]),  # one core a rank
        ([0, 1, 2, 3, 4], 2, 1, ["0,1", "2,3"], [4]),  # a server's share is whole cores
    ],
)
def test_servers_and_learner_get_disjoint_cores(
    cpus: list[int], servers: int, ranks: int, bind: list[str], learner: list[int]
) -> None:
    placement = place_on_cpus(cpus, servers, ranks)
    assert placement is not None
    assert [",".join(map(str, share)) for share in placement.servers] == bind
    assert placement.learner == learner
    env = server_env({"A": "1"}, placement, servers - 1)
    assert env == {"A": "1", "VLLM_CPU_OMP_THREADS_BIND": bind[-1]}
    # Synchronous: only the worker is bound, the server's other processes float; overlapped,
    # all of them stay on the server's share, off the learner's cores.
    assert [server_cpus(placement, i) for i in range(servers)] == [None] * servers
    overlapped = place_on_cpus(cpus, servers, ranks, overlapped=True)
    assert overlapped is not None and overlapped.servers == placement.servers
    shares = [server_cpus(overlapped, i) for i in range(servers)]
    assert [",".join(map(str, share or [])) for share in shares] == bind
    # Confined to one core, the server's model worker needs no process of its own, and its
    # engine yields that core to its front end.
    one_core = len(overlapped.servers[-1]) == 1
    pinned = server_env({"A": "1"}, overlapped, servers - 1)
    assert pinned.get("VLLM_ENABLE_V1_MULTIPROCESSING") == ("0" if one_core else None)
    assert pinned.get(ports.ENV_ENGINE_NICE) == (str(ENGINE_NICE) if one_core else None)
    assert not set(overlapped.learner) & {c for share in shares for c in share or []}


def test_too_few_cores_leave_vllm_its_own_binding() -> None:
    assert place_on_cpus([0, 1], 1, 2) is None  # two learner ranks and a server
    assert place_on_cpus([0], 1, 1) is None
    assert server_env({"A": "1"}, None, 0) == {"A": "1"} and server_cpus(None, 0) is None


def test_a_spawned_process_runs_on_the_cores_it_was_given(tmp_path: Path) -> None:
    import os

    mine = sorted(os.sched_getaffinity(0))
    log = tmp_path / "out.log"
    # `gspo --version` prints and exits; until it is reaped its affinity can still be read.
    proc = spawn("probe", ["--version"], dict(os.environ), log, cpus=mine[-1:])
    assert os.sched_getaffinity(proc.popen.pid) == set(mine[-1:])
    assert proc.popen.wait(timeout=60) == 0
    unpinned = spawn("probe", ["--version"], dict(os.environ), log)
    assert os.sched_getaffinity(unpinned.popen.pid) == set(mine)
    assert unpinned.popen.wait(timeout=60) == 0


# --- a machine with GPUs (their count faked: no GPU here) ------------------------------------


def gpu_spec(learner_gpus: int = 2, servers: int = 2, tp: int = 2):  # type: ignore[no-untyped-def]
    manifest = tiny_manifest()
    manifest["spec"]["learner"].update(replicas=1, gpusPerReplica=learner_gpus)
    manifest["spec"]["rollout"].update(replicas=servers, gpusPerReplica=tp, tensorParallelSize=tp)
    return manifest


def test_the_learner_and_each_server_get_gpus_of_their_own() -> None:
    from gspo_trainer.train import place_on_gpus

    placed = place_on_gpus(parse_spec(gpu_spec()["spec"]), 8, 2)
    assert placed.learner == "0,1" and placed.servers == ["2,3", "4,5"]
    cpu_learner = place_on_gpus(parse_spec(gpu_spec(learner_gpus=0)["spec"]), 4, 2)
    assert cpu_learner.learner == "" and cpu_learner.servers == ["0,1", "2,3"]


def test_gspo_train_places_its_processes_on_the_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`gspo train` on a faked 8-GPU machine: every process it starts sees only its own
    GPUs, and each server runs tensor-parallel over them."""
    import yaml

    from gspo_trainer import train

    started = record_spawns(monkeypatch, gpus=8)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(gpu_spec()))
    assert train.main([str(job), "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 0
    seen = {name: env.get("CUDA_VISIBLE_DEVICES") for name, _, env in started}
    assert seen == {"rollout-0": "2,3", "rollout-1": "4,5", "learner": "0,1"}
    server_args = started[0][1]
    assert server_args[server_args.index("--tensor-parallel-size") + 1] == "2"


def test_gspo_train_given_some_gpus_places_its_processes_on_those(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Started with CUDA_VISIBLE_DEVICES=4,5,6,7 (4 GPUs seen), its processes see GPUs of
    those four, not GPUs 0-3 of the machine: a child's CUDA_VISIBLE_DEVICES replaces it."""
    import yaml

    from gspo_trainer import train

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    started = record_spawns(monkeypatch, gpus=4)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(gpu_spec(learner_gpus=2, servers=1, tp=2)))
    assert train.main([str(job), "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 0
    seen = {name: env.get("CUDA_VISIBLE_DEVICES") for name, _, env in started}
    assert seen == {"rollout-0": "6,7", "learner": "4,5"}


def test_gspo_train_refuses_a_job_that_needs_more_gpus_naming_the_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from gspo_trainer import train

    started = record_spawns(monkeypatch, gpus=4)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(gpu_spec(learner_gpus=2, servers=2, tp=2)))  # needs 6
    assert train.main([str(job), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "needs 6 GPUs and this machine has 4" in err and "tensorParallelSize" in err
    assert started == []  # nothing started


def record_spawns(monkeypatch: pytest.MonkeyPatch, gpus: int) -> list:  # type: ignore[type-arg]
    """`gspo train`'s processes recorded, not started, on a machine with `gpus` GPUs."""
    from types import SimpleNamespace

    from gspo_trainer import train

    started: list = []  # type: ignore[type-arg]

    def fake_spawn(name, args, env, log, cpus=None, keep_fds=()):  # type: ignore[no-untyped-def]
        started.append((name, args, env))
        popen = SimpleNamespace(poll=lambda: 0, returncode=0, pid=0)
        return SimpleNamespace(
            name=name, popen=popen, log=log, stop=lambda timeout_s=60: 0, tail=lambda: ""
        )

    monkeypatch.setattr(train, "_has_cuda", lambda: True)
    monkeypatch.setattr(train, "_gpu_count", lambda: gpus)
    monkeypatch.setattr(train, "spawn", fake_spawn)
    monkeypatch.setattr(train, "wait_healthy", lambda servers, timeout_s, learner=None: None)
    monkeypatch.setattr("gspo_trainer.tiny.materialize", lambda name, cache, seed=0: cache / "m")
    return started


def test_the_run_starts_on_the_first_server_up_and_a_server_lost_before_any_ends_it(
    tmp_path: Path,
) -> None:
    """`gspo train` waits for one server, as the learner does (the others join as they load);
    a server that exits before any answers ends the wait with its log's tail."""
    import http.server
    import subprocess
    import sys
    import threading

    from gspo_trainer.train import Proc, wait_healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    up = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    loading = http.server.HTTPServer(("127.0.0.1", 0), Health)  # bound, never answering
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [Proc(f"rollout-{i}", subprocess.Popen(sleeper), tmp_path / f"{i}.log") for i in (0, 1)]
    try:
        servers = [
            (procs[0], f"http://127.0.0.1:{loading.server_port}"),
            (procs[1], f"http://127.0.0.1:{up.server_port}"),
        ]
        wait_healthy(servers, timeout_s=10)  # returns on the second alone
        (tmp_path / "0.log").write_text("ValueError: bad block_size\n")
        procs[0].popen.kill()
        procs[0].popen.wait()
        with pytest.raises(RuntimeError, match="rollout-0 exited while starting"):
            wait_healthy(servers[:1], timeout_s=10)
    finally:
        up.shutdown()
        loading.server_close()
        for proc in procs:
            proc.popen.kill()
            proc.popen.wait()


def test_free_ports_come_from_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not from the range the kernel hands every outgoing connection: a port from there that
    a server binds 30 s later (vLLM's start) can be another process's connection by then."""
    import socket

    from gspo_api import ports

    span = tmp_path / "ip_local_port_range"
    span.write_text("40000\t60999\n")
    drawn = [ports.free_port(span) for _ in range(50)]
    top = ports.NODE_PORTS  # below Kubernetes' NodePorts too (30000-32767)
    assert all(top - ports.PORT_WINDOW <= p < top for p in drawn) and len(set(drawn)) == 50
    span.write_text("20000 60999\n")  # a lower range: the window ends where it starts
    assert all(20000 - ports.PORT_WINDOW <= ports.free_port(span) < 20000 for _ in range(5))
    with socket.socket() as held:  # a taken port is passed over; none left: the kernel's
        held.bind(("", ports.free_port(span)))
        taken = held.getsockname()[1]
        span.write_text(f"{taken + 1} 60999\n")
        monkeypatch.setattr(ports, "PORT_WINDOW", 1)  # the window is the taken port alone
        assert ports.free_port(span) not in (taken, 0)
    assert ports.free_port(tmp_path / "missing") >= 1024  # not Linux: the kernel's choice


def test_a_spawned_process_is_stopped_when_gspo_train_dies_outright(tmp_path: Path) -> None:
    """gspo train killed outright (SIGKILL) cannot stop its learner and servers: they get
    SIGTERM from the kernel (PR_SET_PDEATHSIG) instead of running on in their own sessions."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from checkout import checkout_env

    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    fake = tmp_path / "python"  # the child: a shell that says it got SIGTERM, then exits
    fake.write_text(
        "#!/bin/sh\ntrap 'echo got TERM; exit 0' TERM\necho up\nwhile :; do sleep 0.1; done\n"
    )
    fake.chmod(0o755)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; from pathlib import Path; from gspo_trainer import train; "
            f"sys.executable = {str(fake)!r}; "
            f"p = train.spawn('child', [], dict(os.environ), Path({str(tmp_path / 'c.log')!r})); "
            "print(p.popen.pid, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=checkout_env(),
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    log = tmp_path / "c.log"
    deadline = time.monotonic() + 30
    while "up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    while "got TERM" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "got TERM" in log.read_text()
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)  # should it still run: not left behind by the test


def test_the_servers_directory_links_torchs_own_and_removes_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch keeps its compiled headers under the temporary directory's torchinductor_<user>
    whatever TORCHINDUCTOR_CACHE_DIR says: the servers' directory links it, so they are built
    once, and removing the directory removes the link, not what it points to."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    short = Path(tempfile.mkdtemp(dir="/tmp"))
    monkeypatch.setattr("tempfile.tempdir", str(short))
    try:
        assert torch_cache_dir() == default_cache_dir()  # torch's own rule, for this TMPDIR
        made = scratch_dir()
        link = made / Path(default_cache_dir()).name
        assert made.parent == short and link.resolve() == Path(default_cache_dir()).resolve()
        (link / "kept").write_text("x")
        shutil.rmtree(made)
        assert (Path(default_cache_dir()) / "kept").read_text() == "x"
    finally:
        shutil.rmtree(short)


def test_the_servers_directory_leaves_room_for_vllms_socket_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Unix socket path holds 107 bytes: under a deep TMPDIR the directory goes to /tmp."""
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    made = scratch_dir()
    try:
        assert made.parent == Path("/tmp") and len(str(made / ("u" * 36))) <= 107
        assert [p.name for p in deep.iterdir()] == [Path(torch_cache_dir()).name]  # torch's
    finally:
        shutil.rmtree(made)
    short = Path(tempfile.mkdtemp(dir="/tmp"))
    monkeypatch.setattr("tempfile.tempdir", str(short))
    try:
        assert scratch_dir().parent == short  # room enough: where TMPDIR says
    finally:
        shutil.rmtree(short)


def test_the_users_choice_of_vllms_worker_process_and_engine_priority_wins() -> None:
    overlapped = place_on_cpus([0, 1], 1, 1, overlapped=True)
    env = server_env(
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", ports.ENV_ENGINE_NICE: "0"}, overlapped, 0
    )
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env[ports.ENV_ENGINE_NICE] == "0"
    # A worker process of its own would be the engine's child, left above its scheduler.
    env = server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, overlapped, 0)
    assert ports.ENV_ENGINE_NICE not in env
