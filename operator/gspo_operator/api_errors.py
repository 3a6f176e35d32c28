"""What an API error means for a job, and how long to wait before trying again. Pure.

Kubernetes answers 429 (throttled) and 5xx (overloaded, restarting) for moments that pass:
back off with jitter, change nothing. 403 (RBAC, a ResourceQuota, an admission policy), 404
(a kind or namespace not served) and 409 (a name taken by another owner) can clear without
the spec changing, once an admin acts: the job is Blocked, retried with backoff. 400 and 422
say the object itself is invalid: the job Failed, until its spec changes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

Verdict = Literal["transient", "blocked", "invalid"]

BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0


def classify(status: int) -> Verdict:
    """The verdict on an HTTP status from the API server (0: no answer at all)."""
    if status in (400, 422):
        return "invalid"
    if status == 429 or status >= 500 or status == 0:
        return "transient"
    return "blocked"


def backoff_s(
    failures: int,
    *,
    retry_after_s: float | None = None,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = BACKOFF_CAP_S,
    uniform: Callable[[], float] = random.random,
) -> float:
    """Exponential backoff after `failures` failures in a row (1 is the first), with jitter
    in [half, whole] so many jobs throttled at once do not come back together; never sooner
    than the server's Retry-After."""
    ceiling = min(cap_s, base_s * 2 ** max(failures - 1, 0))
    delay = ceiling * (0.5 + 0.5 * uniform())
    return max(delay, retry_after_s or 0.0)
