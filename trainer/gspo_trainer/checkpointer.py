"""The learner's checkpoints: save (every rank its part, rank 0 commits), resume, export.

The layout and the atomic write are `checkpoint.py`'s; this module is the learner's use of
them across ranks: each rank writes its part aside, rank 0 commits only when every rank
succeeded, and a failed write leaves the previous checkpoints untouched. Training stops
rather than carry on without checkpoints (MAX_CHECKPOINT_FAILURES in a row, or a final one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gspo_trainer import checkpoint as ckpt
from gspo_trainer.learner_state import LearnerState
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.ranks import Ranks

log = logging.getLogger("gspo.learner")

MAX_CHECKPOINT_FAILURES = 3  # in a row; then the learner stops (see Checkpointer.checkpoint)


class CheckpointError(RuntimeError):
    """Checkpoints cannot be written; training on would risk losing everything since."""


class Checkpointer:
    """`trainer_state()` is what the learner adds beside the engine's state (step, data
    position, policy version); `resume` hands it back."""

    def __init__(
        self,
        directory: Path | None,
        keep: int,
        engine: Any,
        tokenizer: Any,
        ranks: Ranks,
        metrics: LearnerMetrics,
        state: LearnerState,
        trainer_state: Callable[[], dict[str, Any]],
    ) -> None:
        self.directory, self.keep = directory, keep
        self.engine, self.tokenizer = engine, tokenizer
        self.ranks, self.metrics, self.state = ranks, metrics, state
        self.trainer_state = trainer_state
        self.failures = 0  # consecutive
        self.schedule_position: int | None = None  # the resumed checkpoint's (load_state)

    def checkpoint(self, *, final: bool = False) -> None:
        """Save, and stop the run rather than train on without checkpoints: a final one that
        fails, or MAX_CHECKPOINT_FAILURES in a row, raise CheckpointError (the learner exits
        1; the next start resumes from the last good checkpoint, which a failed write never
        touches)."""
        if self.directory is None:
            return
        if self.save() is not None:
            self.failures = 0
            return
        self.failures += 1
        if final or self.failures >= MAX_CHECKPOINT_FAILURES:
            raise CheckpointError(
                f"{self.failures} checkpoint write(s) in a row failed at step "
                f"{self.state.step} (see the errors above); the newest good checkpoint is "
                f"{self.state.last_checkpoint or 'none'}, and training stops here rather than "
                "carry on without checkpoints: free space on the checkpoint volume or fix "
                "its permissions, then restart (the job resumes from it)"
            )

    def save(self) -> Path | None:
        """Every rank writes its part aside; rank 0 commits only if every rank succeeded.
        Returns the checkpoint on every rank, or None on every rank when it failed (logged,
        counted, the aside copy removed; the previous checkpoints are untouched)."""
        if self.directory is None:
            return None
        phase, self.state.phase = self.state.phase, "Checkpointing"
        start = time.perf_counter()
        step, rank = self.state.step, self.ranks.rank
        final = None
        try:
            ok = True
            # Every rank runs the same collectives whatever fails: the barrier, DeepSpeed's
            # own inside save_state (which records a failed write and raises after them),
            # then the agreement.
            if rank == 0:
                ckpt.clear_stale(self.directory)
            self.ranks.barrier()
            hashed: dict[str, ckpt.Entry] = {}  # this rank's files, hashed as it wrote them
            try:
                tmp = ckpt.aside(self.directory, step)
                hashed = ckpt.save_state(self.engine, tmp, rank, self.trainer_state())
            except Exception:
                log.exception("Checkpoint at step %d: this rank could not write its part", step)
                ok = False
            ok = self.ranks.all(ok)
            parts = self.ranks.gather(hashed)  # rank 0: every rank's entries
            if ok and rank == 0:
                try:
                    merged = {rel: e for part in parts or [] for rel, e in part.items()}
                    final = ckpt.commit(self.directory, step, self.keep, merged)
                except Exception:
                    log.exception("Checkpoint at step %d could not be committed", step)
                    ok = False
            ok = self.ranks.all(ok)
            if ok:
                final = self.directory / ckpt.step_name(step)  # every rank: committed
                self.metrics.checkpoint_time.set(time.time())
                self.state.last_checkpoint, self.state.last_checkpoint_step = final.name, step
                if rank == 0:
                    log.info("Saved checkpoint %s", final)
            else:
                final = None
                self.metrics.checkpoint_failures.inc()
                log.error(
                    "Checkpoint at step %d FAILED; the newest good one is still %s",
                    step,
                    self.state.last_checkpoint or "none",
                )
                if rank == 0:
                    ckpt.clear_stale(self.directory)  # give the space back
                # Cleared before any rank can stop (its launcher then stops the others).
                self.ranks.barrier()
        finally:
            self.state.phase = phase
        self.metrics.observe_seconds("checkpoint", time.perf_counter() - start)
        return final

    def resume(self) -> dict[str, Any] | None:
        """Load the newest complete checkpoint into the engine and the RNGs; returns its
        trainer state (None without one)."""
        if self.directory is None:
            return None
        found = self._newest_intact()
        if found is None:
            return None
        state, self.schedule_position = ckpt.load_state(self.engine, found, self.ranks.rank)
        ckpt.set_rng_state(state["rng"])
        self.state.step = int(state["step"])
        self.state.last_checkpoint, self.state.last_checkpoint_step = found.name, self.state.step
        log.info("Resumed from %s at step %d (checksums verified)", found, self.state.step)
        return state

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint every rank finds intact: rank 0 lists them, each rank checks
        its own share of each one's checksums (checkpoint.verify), all at once, newest
        first; one with a bad file anywhere is logged (by the rank that found it, naming
        the files) and passed over for the one before."""
        assert self.directory is not None
        rank, world = self.ranks.rank, self.ranks.world
        names = [p.name for _, p in reversed(ckpt.list_steps(self.directory))] if rank == 0 else []
        for name in self.ranks.broadcast(names):
            path = self.directory / name
            bad = ckpt.verify(path, rank, world)
            if bad:
                log.warning(
                    "Checkpoint %s failed verification on rank %d (%s); skipped for the "
                    "previous one",
                    path,
                    rank,
                    ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""),
                )
            if self.ranks.all(not bad):
                return path
        return None

    def export(self, shard_bytes: int) -> Path | None:
        """The final policy as HF safetensors under <checkpoint dir>/export, in shards of at
        most `shard_bytes`. Every rank gathers (a layer at a time: ParamStream); rank 0
        writes; a failed write fails the run on every rank (no rank is left waiting), with
        the final checkpoint already committed and intact."""
        from gspo_trainer.param_stream import ParamStream

        if self.directory is None:
            return None
        out = self.directory / "export"
        ok = True
        stream = ParamStream.of(self.engine, self.ranks)
        if self.ranks.rank != 0:
            stream.follow()
        else:
            layers = stream.layers()
            try:
                ckpt.export_hf(layers, self.engine.module, self.tokenizer, out, shard_bytes)
                log.info("Exported the policy to %s", out)
            except Exception:
                log.exception("Exporting the policy to %s failed", out)
                ok = False
            finally:  # a failed write still gathers the layers left, as the followers do
                layers.close()
                stream.finish()
        if not self.ranks.all(ok):
            raise CheckpointError(
                f"exporting the final policy to {out} failed (see the errors above); the "
                f"final checkpoint {self.state.last_checkpoint or 'none'} is intact: free "
                "space on the checkpoint volume and rerun the job, which resumes from that "
                "checkpoint and exports again, or set checkpoint.exportHf: false"
            )
        return out
