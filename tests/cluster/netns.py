"""A pod network for the local cluster: one Linux bridge, one network namespace per pod.

Why: the operator and its pods talk over real sockets (the operator reads
http://<podIP>:<port>/progress, learner ranks find each other by DNS name), so every pod needs
its own IP that the root namespace (where the test, the operator and the API server stand-in
run) can reach, and its own /etc/hosts that can be rewritten while the pod runs.

Layout (all names carry `prefix`, "gspo" by default):
- a bridge `<prefix>-br0` in the root namespace holding the gateway address (the /24's .1); the
  root namespace reaches every pod IP over the bridge's connected route, and that address is
  what pods see as their node's IP (status.hostIP);
- per pod a namespace `<prefix>-pod-<n>` and a veth pair: `<prefix>-v<n>` on the bridge, `eth0`
  inside with the pod IP (`n` is the address' last octet, so names never collide), loopback
  up and a default route via the gateway. Traffic leaves the /24 nowhere: this machine does not
  forward (net.ipv4.ip_forward=0 was checked when this was written; nothing here enables it);
- `/etc/netns/<ns>/` with `hosts`, `host.conf` ("multi on": glibc returns every address of a
  name listed on several lines), `nsswitch.conf` (hosts: files; names never go to a DNS
  server) and `resolv.conf` (loopback only). `ip netns exec` bind-mounts each over its /etc
  file, so `hosts` is rewritten in place (same inode: a rename would leave running pods
  reading the old file).

One network exists at a time on a machine: `setup()` takes an flock on
/run/lock/<prefix>-podnet.lock (kept, empty: unlinking a lock file races with its waiters),
then removes whatever a crashed earlier run left behind under the prefix (namespaces, veths,
the bridge, /etc/netns dirs), which is safe because a live owner would hold the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
RUN_NETNS = Path("/run/netns")
HOST_CONF = "multi on\n"
RESOLV_CONF = "# pod network: names come from /etc/hosts only\nnameserver 127.0.0.1\n"


@dataclass(frozen=True)
class Endpoint:
    """One pod's place on the network."""

    netns: str
    ip: str
    host_veth: str

    @property
    def etc_dir(self) -> Path:
        return NETNS_ETC / self.netns


@functools.cache
def unavailable_reason() -> str | None:
    """Why a pod network cannot be built here (None when it can): for pytest skips.

    The probe namespace is named for this process: pytest-xdist's workers collect the same
    modules at once, and a shared name made one worker's `ip netns add` fail ("File exists")
    and skip every cluster test it later ran."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"gspo-probe-{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if add.returncode != 0:
        return f"`ip netns add` fails: {add.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _nsswitch() -> str:
    """The host's nsswitch.conf with hosts resolved from files only (no DNS leaves a pod)."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    out = [ln for ln in lines if not ln.strip().startswith("hosts:")]
    out.append("hosts:          files")
    return "\n".join(out) + "\n"


def write_in_place(path: Path, text: str) -> None:
    """Replace a file's content keeping its inode (it is bind-mounted into running pods).

    The new bytes are written over the old ones before the file is cut to length, so a
    reader never sees an empty file (a missing name would fail a lookup); at worst it sees
    the new content followed by a stale tail of the old one for an instant.
    """
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class PodNetwork:
    """The bridge, per-pod namespaces and their /etc files (see the module docstring)."""

    def __init__(
        self,
        subnet: str = "10.244.77.0/24",
        prefix: str = "gspo",
        lock_timeout_s: float = 120.0,
    ) -> None:
        net = ipaddress.IPv4Network(subnet)
        if net.prefixlen != 24:
            raise ValueError("the pod network is a /24 (names carry the last octet)")
        self.subnet = net
        self.prefix = prefix
        self.bridge = f"{prefix}-br0"
        self.gateway = str(net.network_address + 1)
        self.lock_path = Path("/run/lock" if Path("/run/lock").is_dir() else "/tmp") / (
            f"{prefix}-podnet.lock"
        )
        self.lock_timeout_s = lock_timeout_s
        self._lock_fd: int | None = None
        self._used: dict[int, Endpoint] = {}
        self._next = 2

    # --- names ---------------------------------------------------------------------------

    def _ns_name(self, octet: int) -> str:
        return f"{self.prefix}-pod-{octet}"

    def _veth_name(self, octet: int) -> str:
        return f"{self.prefix}-v{octet}"

    # --- lifecycle -----------------------------------------------------------------------

    async def setup(self) -> None:
        """Take the machine-wide lock, clear leftovers, create the bridge."""
        await self._lock()
        self.cleanup_leftovers()
        await _ip("link", "add", self.bridge, "type", "bridge")
        await _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        await _ip("link", "set", self.bridge, "up")

    async def add(self, hosts: str = "") -> Endpoint:
        """A new namespace with its own address; `hosts` is its first /etc/hosts."""
        octet = self._allocate()
        ip = str(self.subnet.network_address + octet)
        ep = Endpoint(self._ns_name(octet), ip, self._veth_name(octet))
        self._used[octet] = ep
        try:
            # /etc/netns first: `ip netns exec` binds whatever is there when a pod starts.
            ep.etc_dir.mkdir(parents=True, exist_ok=True)
            write_in_place(ep.etc_dir / "hosts", hosts)
            write_in_place(ep.etc_dir / "host.conf", HOST_CONF)
            write_in_place(ep.etc_dir / "nsswitch.conf", _nsswitch())
            write_in_place(ep.etc_dir / "resolv.conf", RESOLV_CONF)
            await _ip_batch(
                None,
                [
                    f"netns add {ep.netns}",
                    f"link add {ep.host_veth} type veth peer name eth0 netns {ep.netns}",
                    f"link set dev {ep.host_veth} master {self.bridge} up",
                ],
            )
            await _ip_batch(
                ep.netns,
                [
                    "link set lo up",
                    f"addr add {ep.ip}/{self.subnet.prefixlen} dev eth0",
                    "link set eth0 up",
                    f"route add default via {self.gateway}",
                ],
            )
        except BaseException:
            await self.remove(ep)
            raise
        return ep

    def write_hosts(self, ep: Endpoint, hosts: str) -> None:
        """Rewrite a namespace's /etc/hosts in place (running pods see it at once)."""
        if ep.etc_dir.is_dir():
            write_in_place(ep.etc_dir / "hosts", hosts)

    async def remove(self, ep: Endpoint) -> None:
        """Delete a pod's veth (synchronously; a namespace dies lazily) and namespace."""
        await _ip("link", "del", ep.host_veth, check=False)
        await _ip("netns", "del", ep.netns, check=False)
        shutil.rmtree(ep.etc_dir, ignore_errors=True)
        octet = int(ep.ip.rsplit(".", 1)[1])
        if self._used.get(octet) == ep:
            del self._used[octet]

    async def teardown(self) -> None:
        """Remove every namespace, veth, the bridge and /etc/netns dirs; release the lock."""
        for ep in list(self._used.values()):
            await self.remove(ep)
        if self._lock_fd is not None:
            self.cleanup_leftovers()
            with contextlib.suppress(OSError):  # only when empty: nothing else used it
                NETNS_ETC.rmdir()
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def cleanup_leftovers(self) -> None:
        """Delete everything under this prefix (a crashed run's namespaces, veths, bridge)."""
        pod_prefix = f"{self.prefix}-pod-"
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        for line in links.stdout.splitlines():
            name = line.split(":", 2)[1].strip().split("@", 1)[0]
            if name == self.bridge or name.startswith(f"{self.prefix}-v"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        names = {p.name for p in RUN_NETNS.glob(f"{pod_prefix}*")}
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        names |= {ln.split()[0] for ln in listed.stdout.splitlines() if ln.strip()}
        for name in sorted(names):
            if name.startswith(pod_prefix):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for etc in NETNS_ETC.glob(f"{pod_prefix}*"):
            shutil.rmtree(etc, ignore_errors=True)

    # --- internals -----------------------------------------------------------------------

    def _allocate(self) -> int:
        """The next free octet after the last one handed out (round robin).

        Round robin, not lowest-free: a just-freed address is reused last, so other pods'
        ARP entries for the old MAC have long expired by then.
        """
        for step in range(253):
            octet = 2 + (self._next - 2 + step) % 253
            if octet not in self._used:
                self._next = octet + 1
                return octet
        raise RuntimeError(f"pod network {self.subnet} is full")

    async def _lock(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if loop.time() > deadline:
                    os.close(fd)
                    raise RuntimeError(
                        f"another pod network holds {self.lock_path} (a concurrent test run?)"
                    ) from None
                await asyncio.sleep(0.2)
        self._lock_fd = fd


async def _ip(*args: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        "ip", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await proc.communicate()
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {err.decode().strip()}")
    return out.decode()


async def _ip_batch(netns: str | None, commands: list[str]) -> None:
    """Several `ip` commands in one process (inside `netns` when given); stops at an error."""
    args = ["ip", *(["-n", netns] if netns else []), "-batch", "-"]
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, err = await proc.communicate(("\n".join(commands) + "\n").encode())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} <<< {commands}: {err.decode().strip()}")
