"""The TCPStores the learner hosts listen only where they are meant to be reached.

Neither the learner group's rendezvous store nor the weight-sync store carries a credential:
whoever reaches its port can join. Each is read here from the kernel's table of listening
sockets (/proc/net/tcp and tcp6, this network namespace), as `ss -ltn` shows them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gspo_api import ports
from gspo_api.ports import free_port
from gspo_trainer.learner_cli import group_command
from gspo_trainer.rollout import client as client_mod
from gspo_trainer.rollout import weight_sync as ws
from gspo_trainer.rollout.client import RolloutClient, Server, SyncOptions

REPO = Path(__file__).resolve().parents[2]
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address: the IPv4 or IPv6 bytes, each 32-bit word in host order."""
    raw = bytes.fromhex(hex_addr)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return str(ipaddress.ip_address(b"".join(words)))


def listening(port: int) -> set[str]:
    """The local addresses a socket listens on at `port` (`::` or 0.0.0.0: every one)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, port_hex = local.partition(":")
            if state == LISTEN and int(port_hex, 16) == port:
                found.add(_address(addr))
    return found


def test_the_proc_table_reads_what_a_socket_listens_on() -> None:
    with socket.socket(socket.AF_INET6) as wildcard, socket.socket() as loopback:
        wildcard.bind(("::", 0))
        wildcard.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        assert listening(wildcard.getsockname()[1]) == {"::"}
        assert listening(loopback.getsockname()[1]) == {"127.0.0.1"}


def test_the_weight_sync_store_listens_on_the_learners_address_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client hosts the store on the address it gives the servers (loopback under `gspo
    train`, the pod's IP on a cluster), not on every interface."""
    port = free_port()

    class Group:
        rank = 0

        def close(self, *, abort: bool) -> None:
            pass

    async def post(self: Any, url: str, path: str, body: Any, timeout_s: float) -> Any:
        return {"joined": True}

    monkeypatch.setattr(ws, "open_group", lambda *a, **k: Group())
    monkeypatch.setattr(client_mod.RolloutClient, "_post", post)

    async def scenario() -> set[str]:
        client = RolloutClient(["http://a"], sync=SyncOptions("127.0.0.1", port, timeout_s=5))
        await client._ensure_group([Server("http://a")], [])
        seen = listening(port)
        await client.close()
        return seen

    assert asyncio.run(scenario()) == {"127.0.0.1"}


def test_the_rendezvous_store_listens_on_the_master_address_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner group's launcher, as `gspo learner` builds it, with a rank that reports
    where the rendezvous port listens while the group runs."""
    port = free_port()
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_listening_sockets import listening
        print("LISTENING", json.dumps(sorted(listening(int(os.environ["MASTER_PORT"])))))
        """)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv(ports.ENV_POD_IP, raising=False)
    for key in (ports.ENV_NNODES, ports.ENV_NODE_RANK, ports.ENV_NPROC_PER_NODE):
        monkeypatch.delenv(key, raising=False)
    argv = group_command([])
    launcher = argv[: argv.index("gspo_operator.cli") - 1]  # up to the rank's module
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}"}
    out = subprocess.run(
        [*launcher, str(probe)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("LISTENING")]
    assert json.loads(line.split(" ", 1)[1]) == ["127.0.0.1"]


def test_a_lone_learner_process_listens_on_no_rendezvous_port() -> None:
    """One learner process (`gspo train` on one GPU or the CPU) starts no launcher; its
    process group has no peer to meet, so it hosts no store on the network at all (through
    env://, DeepSpeed's TorchBackend would host one on `::`, whatever MASTER_ADDR says).

    The learner's own group set-up, with the real DeepSpeed, in a fresh interpreter: a test
    run before it in this process may have left torch.distributed initialized."""
    from checkout import checkout_env  # here: probes of other tests import this module

    port = free_port()
    env = checkout_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    probe = (
        "import sys\n"
        "import torch.distributed as dist\n"
        "from gspo_trainer import engine\n"
        "engine.init_distributed()\n"
        "print('initialized', dist.is_initialized(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    proc = subprocess.Popen([sys.executable, "-c", probe], env=env, text=True, **pipes)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        said = []
        while (line := proc.stdout.readline()) and not line.startswith("initialized"):
            said.append(line)
        assert line.strip() == "initialized True", "".join(said[-30:])
        assert listening(port) == set()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
