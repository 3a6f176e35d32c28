"""Sync: push the policy to the rollout servers (pause -> load -> resume, in the client).

Rank 0 sends the parameters as a ParamStream: under ZeRO-3 every rank gathers them one layer
at a time as rank 0's sender fills its buckets (the other ranks follow its passes), so no
rank ever holds the whole model. Rank 0 holds the collector's fleet lock, so it waits for a
generation in flight and none starts meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gspo_trainer.learner_state import LearnerState, unless_stopped
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.ranks import Ranks
from gspo_trainer.rollout.client import RolloutError
from gspo_trainer.step.rollout import RolloutSource

log = logging.getLogger("gspo.learner")


class WeightSync:
    def __init__(
        self,
        engine: Any,
        rollout: RolloutSource,
        fleet_lock: asyncio.Lock,
        ranks: Ranks,
        metrics: LearnerMetrics,
        state: LearnerState,
    ) -> None:
        self.engine, self.rollout, self.fleet_lock = engine, rollout, fleet_lock
        self.ranks, self.metrics, self.state = ranks, metrics, state

    async def push(self, version: int, *, final: bool = False) -> float:
        """The policy as `version`, on every server that can take it; bytes sent (rank 0).

        `final` (the last step's sync, which its evaluation reads) is tried even when asked
        to stop: a run that ends at this step ends with its final accuracy if its servers
        still answer (a learner pod drained alone), and no resume would make it up. When
        they stop too (a suspend), vLLM holds the call open until its pods are killed, so
        the final checkpoint comes that grace period later (at most the sync's own
        weightSync.timeoutSeconds), once, at the run's last step.
        """
        from gspo_trainer.param_stream import ParamStream

        start = time.perf_counter()
        sent, waited_s, pushed = 0, 0.0, False
        if not final and self.ranks.any(self.state.stop_requested):
            # Asked to stop (every rank agrees, so none follows a stream rank 0 never sends):
            # the servers stop with the learner, and one that vLLM is stopping holds a
            # control call open until its pod is killed (learner_state.unless_stopped). The
            # update is done, the final checkpoint goes ahead; the next start syncs again.
            log.info("Weight sync to version %d skipped: stopping", version)
            return 0.0
        stream = ParamStream.of(self.engine, self.ranks)
        if self.ranks.rank != 0:
            stream.follow()
            pushed = True
        else:
            try:
                # A generation in flight (run ahead) finishes first, unless a stop comes.
                acquire = self.fleet_lock.acquire()  # final: nothing runs ahead to wait on
                if await (acquire if final else unless_stopped(self.state, acquire)) is None:
                    log.info("Weight sync to version %d skipped: stopping", version)
                    return 0.0  # no pass started: finish() releases the other ranks
                try:
                    waited_s = time.perf_counter() - start
                    report = await self.rollout.sync_weights(stream, version)
                finally:
                    self.fleet_lock.release()
                sent = int(getattr(report, "bytes_total", 0))
                pushed = True
            except RolloutError as exc:
                # Suspended or deleted, the servers stop with the learner: the update is
                # done, so the final checkpoint goes ahead; the next start syncs again.
                if not self.state.stop_requested:
                    raise
                log.warning("Weight sync to version %d skipped while stopping: %s", version, exc)
            finally:
                stream.finish()
        if pushed:  # state.policy_version names the version the servers hold
            self.state.policy_version = version
            self.metrics.policy_version.set(version)
        # The sync's own time: waiting for a generation in flight is the step's, not its.
        self.metrics.observe_seconds("weight_sync", time.perf_counter() - start - waited_s)
        return float(sent)
