"""torch.distributed.run with its rendezvous store bound to this pod's address.

The learner group's launcher is torch.distributed.run with the static rendezvous (a fixed
master address and port): node rank 0 hosts a TCPStore that every rank joins through. torch
creates that store listening on every interface (torch 2.13,
torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py), so on a laptop anyone on the
network could join the group. This module registers the same rendezvous under the backend name
`ports.RENDEZVOUS_BACKEND`, its store hosted by `bound_store.serve_store` on
`bind_address(master_addr)`, and runs torch.distributed.run in this process:

    python -m gspo_trainer.rendezvous --rdzv-backend=gspo-static \
        --rdzv-endpoint=MASTER_ADDR:MASTER_PORT --rdzv-conf=rank=NODE_RANK ... -m module ...

Everything else (the ranks' environment, the agent store the ranks join as clients, restarts,
signals) is torch.distributed.run's own.
"""

from __future__ import annotations

import sys
from typing import Any, cast

from torch.distributed import run
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
    static_tcp_rendezvous,
)

from gspo_api import ports
from gspo_trainer.bound_store import bind_address, serve_store


class BoundStaticRendezvous(static_tcp_rendezvous.StaticTCPRendezvous):
    """torch's static rendezvous; node rank 0 hosts its store bound (`serve_store`)."""

    def get_backend(self) -> str:
        return ports.RENDEZVOUS_BACKEND

    def next_rendezvous(self) -> Any:
        # torch's next_rendezvous creates the store only while it has none (`_store`).
        if self._store is None and self.rank == 0:
            self._store = serve_store(
                bind_address(self.master_addr),
                self.master_port,
                world_size=self.world_size,
                timeout=self.timeout,
                wait_for_workers=True,
                multi_tenant=True,
            )
        return super().next_rendezvous()


def create_handler(params: RendezvousParameters) -> BoundStaticRendezvous:
    """The rendezvous `ports.RENDEZVOUS_BACKEND` names: torch's static one, store bound."""
    # --rdzv-conf values arrive as strings; the static backend compares its rank with 0.
    params.config["rank"] = int(params.config["rank"])
    # It builds a StaticTCPRendezvous; its annotation names the base class.
    torchs = cast(
        static_tcp_rendezvous.StaticTCPRendezvous,
        static_tcp_rendezvous.create_rdzv_handler(params),
    )
    return BoundStaticRendezvous(
        torchs.master_addr,
        torchs.master_port,
        torchs.rank,
        torchs.world_size,
        torchs.run_id,
        int(torchs.timeout.total_seconds()),
    )


def register() -> None:
    """Make `ports.RENDEZVOUS_BACKEND` a torch.distributed.run backend in this process."""
    rendezvous_handler_registry.register(ports.RENDEZVOUS_BACKEND, create_handler)


def main(argv: list[str]) -> None:
    register()
    run.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
