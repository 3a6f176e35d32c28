"""The learner's small HTTP endpoint: GET /metrics (Prometheus) and GET /progress (JSON).

A thread, not the training loop's event loop, so scrapes answer while a step computes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.progress import PROGRESS_PATH, LearnerProgress


def serve_status(
    metrics: LearnerMetrics, progress: Callable[[], LearnerProgress], host: str, port: int
) -> ThreadingHTTPServer:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/metrics":
                body, ctype = generate_latest(metrics.registry), CONTENT_TYPE_LATEST
            elif path == PROGRESS_PATH:
                body, ctype = progress().to_json().encode(), "application/json"
            elif path in ("/healthz", "/health"):
                body, ctype = b"ok", "text/plain"
            else:
                self.send_error(404, "try /metrics or /progress")
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
