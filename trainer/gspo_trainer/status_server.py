"""The learner's small HTTP endpoint: GET /metrics (Prometheus), /progress (JSON), /healthz.

A thread, not the training loop's event loop, so scrapes answer while a step computes. Rank 0
serves all three; the first process of every other learner pod serves /healthz alone, so
each pod's readiness probe has an answer (metrics and progress exist on rank 0 only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gspo_api.ports import HEALTH_PATH
from gspo_api.progress import PROGRESS_PATH, LearnerProgress
from gspo_trainer.metrics import LearnerMetrics


def serve_status(
    metrics: LearnerMetrics | None,
    progress: Callable[[], LearnerProgress] | None,
    host: str,
    port: int,
) -> ThreadingHTTPServer:
    """Serve what is given: /metrics when `metrics`, /progress when `progress`, /healthz always."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/metrics" and metrics is not None:
                body, ctype = generate_latest(metrics.registry), CONTENT_TYPE_LATEST
            elif path == PROGRESS_PATH and progress is not None:
                body, ctype = progress().to_json().encode(), "application/json"
            elif path in (HEALTH_PATH, "/health"):
                body, ctype = b"ok", "text/plain"
            else:
                self.send_error(404, f"not served here; try {HEALTH_PATH}")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="gspo-status", daemon=True).start()
    return server
