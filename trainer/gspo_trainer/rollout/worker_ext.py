"""Code that runs inside each vLLM worker process (vLLM's `worker_extension_cls`).

vLLM mixes this class into its Worker, so `self` is the worker: it holds the model runner.
The server calls these methods with `collective_rpc`; tensors never cross that boundary
(they cannot be pickled through it), only the group's coordinates and small results.
Weights are loaded through the engine's `reload_weights` path, the one that works on the
CPU backend, which repacks parameters after loading.
"""

from __future__ import annotations

from typing import Any

from gspo_trainer.rollout import weight_sync


class WeightSyncExtension:
    _gspo_group: weight_sync.SyncGroup | None = None
    _gspo_store: Any = None

    def gspo_init_sync_group(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the learner's sync group as rank `rank_offset + this worker's rank`."""
        self.gspo_close_sync_group()
        rank = rank_offset + int(getattr(self, "rank", 0))
        store = weight_sync.connect_store(
            master_addr, master_port, is_master=False, timeout_s=timeout_s
        )
        self._gspo_store = store
        self._gspo_group = weight_sync.open_group(
            store, group_name, rank, world_size, backend=backend, timeout_s=timeout_s
        )
        return rank

    def gspo_receive_weights(self) -> dict[str, int]:
        """Receive one bucketed broadcast and load it in place; returns its version and size."""
        if self._gspo_group is None:
            raise RuntimeError("no sync group: call /control/sync/init before an update")
        version, tensors = weight_sync.receive_weights(self._gspo_group)
        counted = {"tensors": 0, "bytes": 0}

        def counting():  # type: ignore[no-untyped-def]
            for name, t in tensors:
                counted["tensors"] += 1
                counted["bytes"] += t.numel() * t.element_size()
                yield name, t

        stream = counting()
        self.model_runner.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]
        for _ in stream:  # every bucket is a collective: take part even if the loader stopped
            pass
        return {"version": version, **counted}

    def gspo_close_sync_group(self) -> None:
        self._gspo_group = None
        self._gspo_store = None
