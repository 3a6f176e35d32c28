"""The learner's status endpoint: every learner pod answers its readiness probe."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from gspo_api.ports import HEALTH_PATH
from gspo_api.progress import LearnerProgress
from gspo_trainer.status_server import serve_status


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


@pytest.mark.parametrize("rank0", [True, False])
def test_every_learner_pod_serves_healthz_and_only_rank_0_progress(rank0: bool) -> None:
    port = _port()
    progress = (lambda: LearnerProgress(step=3, phase="Running")) if rank0 else None
    server = serve_status(None, progress, "127.0.0.1", port)
    try:
        assert _get(port, HEALTH_PATH) == (200, b"ok")
        status, body = _get(port, "/progress")
        if rank0:
            assert status == 200 and LearnerProgress.model_validate_json(body).step == 3
        else:
            assert status == 404
        assert _get(port, "/metrics")[0] == 404  # metrics disabled, or not rank 0
    finally:
        server.shutdown()
