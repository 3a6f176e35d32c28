"""Sample completions: a few of a step's responses, shown to a person (log, history, trackers).

Every `metrics.samplesEverySteps` steps learner rank 0 logs `metrics.samplesPerLog` responses
with their prompt, reward and advantage, and keeps them on that step's history.jsonl record
under "samples" (a list of plain dicts, what a tracker turns into a table).

Which ones, deterministically: the groups in order; from a group with spread, its best
response, then its worst (the ones the advantage pushes up and down most; the first on a tie);
from a group whose rewards all agree (zero advantage), its first response only; until
`count` are picked. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_TEXT_CHARS = 200  # per prompt or response in the log; history keeps the whole text


def samples_due(step: int, every_steps: int) -> bool:
    """True at every `every_steps`-th step (never when it is 0)."""
    return every_steps > 0 and step % every_steps == 0


def pick_samples(
    prompts: Sequence[str],
    responses: Sequence[str],
    rewards: Sequence[float],
    advantages: Sequence[float],
    group_size: int,
    count: int,
) -> list[dict[str, Any]]:
    """Up to `count` samples, as in the module docstring. Every sequence holds one entry per
    response (N = groups x group_size, groups contiguous, as the learner packs them).

    Each sample: {"group", "index" (the response's row in the step), "prompt", "response",
    "reward", "advantage"}.
    """
    n = len(responses)
    if not (len(prompts) == len(rewards) == len(advantages) == n):
        raise ValueError(
            f"pick_samples: {len(prompts)} prompts, {n} responses, {len(rewards)} rewards and "
            f"{len(advantages)} advantages; give one of each per response"
        )
    picked: list[int] = []
    for start in range(0, n, group_size):
        rows = range(start, min(start + group_size, n))
        best = max(rows, key=lambda i: (rewards[i], -i))
        worst = min(rows, key=lambda i: (rewards[i], i))
        picked += [best, worst] if rewards[best] != rewards[worst] else [rows[0]]
        if len(picked) >= count:
            break
    return [
        {
            "group": i // group_size,
            "index": i,
            "prompt": prompts[i],
            "response": responses[i],
            "reward": float(rewards[i]),
            "advantage": float(advantages[i]),
        }
        for i in picked[:count]
    ]


def format_samples(step: int, samples: Sequence[dict[str, Any]]) -> str:
    """A short block for the log: one header, then two lines per sample."""
    lines = [f"Samples at step {step}:"]
    for s in samples:
        lines.append(
            f"  group {s['group']} response {s['index']}: reward {s['reward']:.3f} "
            f"advantage {s['advantage']:+.3f}"
        )
        lines.append(f"    {_short(s['prompt'])} -> {_short(s['response'])}")
    return "\n".join(lines)


def _short(text: str) -> str:
    """One line, quoted (newlines and spaces visible), cut to MAX_TEXT_CHARS."""
    cut = text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + "..."
    return repr(cut)
