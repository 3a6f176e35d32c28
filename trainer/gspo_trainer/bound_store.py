"""A TCPStore server that listens on one address, not on every interface.

torch's TCPStore server ignores the host it is given and listens on `*:port` (its libuv
backend binds the IPv6 wildcard, dual-stack; torch 2.13, torch/csrc/distributed/c10d/
TCPStoreLibUvBackend.cpp). A store holds no credential: whoever reaches the port can join the
rendezvous or the weight-sync group. The store takes an already-bound listening socket
(`master_listen_fd`), so it is bound here to the address it is meant for: loopback on one
machine, the pod's IP on a cluster.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from gspo_api import ports

LISTEN_BACKLOG = 4096  # what the store's own server asks for


def bind_address(master_addr: str) -> str:
    """Where the store on this host listens: this pod's IP where the environment gives it
    ($GSPO_POD_IP, the downward API on a cluster; 127.0.0.1 under `gspo train`), else the
    address `master_addr` names (the host that runs the store is the one it resolves to)."""
    return os.environ.get(ports.ENV_POD_IP) or master_addr


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` only (port 0: one the OS picks)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(
    host: str,
    port: int,
    *,
    world_size: int | None,
    timeout: timedelta,
    wait_for_workers: bool = False,
    multi_tenant: bool = False,
) -> Any:
    """The server side of a TCPStore, listening on `host` only.

    The store serves on the socket's descriptor itself (not a copy): the Python object is
    detached so that it cannot close the descriptor under the store.
    """
    import torch.distributed as dist

    sock = listening_socket(host, port)
    try:
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store
