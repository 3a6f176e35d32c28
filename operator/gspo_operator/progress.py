"""Read the learner's progress (GET /progress on rank 0's metrics port)."""

from __future__ import annotations

import logging

import aiohttp
from pydantic import ValidationError

from gspo_api.progress import PROGRESS_PATH, LearnerProgress

log = logging.getLogger(__name__)


async def fetch_progress(
    session: aiohttp.ClientSession, host: str, port: int, *, timeout_s: float = 3.0
) -> LearnerProgress | None:
    """The learner's progress, or None when it cannot be read now (the next timer retries)."""
    url = f"http://{host}:{port}{PROGRESS_PATH}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return LearnerProgress.model_validate(await resp.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError, ValidationError) as exc:
        log.debug("progress from %s unavailable: %s", url, exc)
        return None
