"""Which rollout servers exist: fixed URLs, or "dns+http://HOST:PORT" re-resolved every step.

A headless Service's name resolves to one address per ready pod, so a server that starts
(or restarts with a new IP) appears on the next resolution; the learner then re-forms the
weight-sync group with the current membership and pushes its current weights to it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gspo_api import ports

log = logging.getLogger("gspo.rollout.discovery")

Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})  # the address (a str; typeshed: str | int)


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def resolve_urls(value: str, resolver: Resolver = system_resolver) -> list[str]:
    """Comma-separated entries; each "dns+http://HOST:PORT" becomes one URL per address."""
    urls: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        if entry.startswith(ports.ROLLOUT_DNS_SCHEME + "://"):
            parts = urlsplit(entry)
            if not parts.hostname:
                raise ValueError(f"${ports.ENV_ROLLOUT_URLS}: {entry!r} names no host")
            port = parts.port or ports.ROLLOUT_HTTP_PORT
            urls.extend(_url(a, port) for a in resolver(parts.hostname, port))
        else:
            urls.append(entry.rstrip("/"))
    return list(dict.fromkeys(urls))


class FleetDiscovery:
    """A RolloutClient whose server set follows `value` (see module doc); delegates the rest."""

    def __init__(self, client: Any, value: str, resolver: Resolver = system_resolver) -> None:
        self.client = client
        self.value = value
        self.resolver = resolver
        self.dynamic = ports.ROLLOUT_DNS_SCHEME + "://" in value

    async def discover(self) -> list[str]:
        """Re-resolve; add new servers and drop vanished ones. Returns the added URLs."""
        from gspo_trainer.rollout.client import Server

        if not self.dynamic:
            return []
        try:
            urls = await asyncio.to_thread(resolve_urls, self.value, self.resolver)
        except OSError as exc:
            log.warning(
                "Resolving %s failed (%s); keeping %d servers",
                self.value,
                exc,
                len(self.client.servers),
            )
            return []
        if not urls:
            log.warning("%s resolved to no address; keeping the current servers", self.value)
            return []
        servers = self.client.servers
        added = [u for u in urls if u not in servers]
        for url in added:
            servers[url] = Server(url)
            log.info("Discovered rollout server %s", url)
        for url in [u for u in servers if u not in urls]:
            log.info("Rollout server %s is gone", url)
            del servers[url]
        if added:
            await self.client.refresh()
        return added

    async def generate(self, prompts: Any, params: Any) -> Any:
        return await self.client.generate(prompts, params)

    async def fleet_state(self) -> tuple[int, int]:
        return await self.client.fleet_state()

    def server_versions(self) -> dict[str, int | None]:
        return self.client.server_versions()

    async def sync_weights(self, named_tensors: Any, version: int) -> Any:
        return await self.client.sync_weights(named_tensors, version)

    async def close(self) -> None:
        await self.client.close()
