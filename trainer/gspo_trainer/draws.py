"""Which prompts each training step trains on, drawn ahead of the step that trains them.

Run-ahead collection (algorithm.maxStaleness > 0) generates the next steps' rollouts while
this one trains, so their prompts are drawn before their step; every rank draws the same
ones in step order, so the data stream stays the same everywhere. A checkpoint at step k
keeps the stream's position after step k's draw, not after the draws ahead of it: those
are drawn again on resume, and the resumed run trains on the prompts the uninterrupted one
would have.
"""

from __future__ import annotations

from gspo_trainer.data import Example, PromptStream


class PromptDraws:
    """The drawn, not yet trained batches by step, and the stream position after each draw."""

    def __init__(self, stream: PromptStream, per_step: int, step: int) -> None:
        self.stream, self.per_step = stream, per_step
        self._restart(step)

    def _restart(self, step: int) -> None:
        self.batches: dict[int, list[Example]] = {}
        self.last_drawn = step
        self.positions: dict[int, dict[str, int]] = {step: self.stream.state_dict()}

    def resume(self, position: dict[str, int], step: int) -> None:
        """Continue after `step` from a checkpoint's stream position (drawn ahead: dropped)."""
        self.stream.load_state_dict(position)
        self._restart(step)

    def until(self, step: int) -> None:
        """Draw the prompts of every step up to `step`, in step order."""
        while self.last_drawn < step:
            self.last_drawn += 1
            self.batches[self.last_drawn] = self.stream.next_batch(self.per_step)
            self.positions[self.last_drawn] = self.stream.state_dict()

    def batch(self, step: int) -> list[Example]:
        """Step `step`'s prompts (drawn by `until`)."""
        return self.batches[step]

    def collected(self, step: int) -> None:
        """`step`'s rollouts are in hand: its prompts are not needed again."""
        del self.batches[step]

    def trained(self, step: int) -> None:
        """`step` is trained: the positions before it go (a checkpoint is only ever written
        at the last trained step)."""
        self.positions = {k: v for k, v in self.positions.items() if k >= step}

    def position(self, step: int) -> dict[str, int]:
        """The stream's position after `step`'s draw: what a checkpoint at `step` keeps."""
        return self.positions[step]
