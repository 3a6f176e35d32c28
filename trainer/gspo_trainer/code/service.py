"""The sandbox as a service: the same LocalSandbox behind HTTP, and the learner's client.

reward.sandbox.mode service sends each test case to a sandbox fleet instead of running it in
the learner's pod: `POST /run` with the job's bearer token, JSON in and out (bytes as base64),
`GET /healthz` for readiness. The server runs `LocalSandbox` (its isolation and limits are the
server's reward.sandbox), so a program meets the same sandbox in both modes. A fleet that is
down, refuses the token or answers garbage is a `sandbox_failure` for that test case, counted
and logged, never a wrong answer.

    gspo sandbox-server --port 8080 --token-file /var/run/gspo/token
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gspo_api.ports import INVALID_CONFIG_EXIT_CODE
from gspo_api.spec import SandboxConfig
from gspo_trainer.code.sandbox import LocalSandbox, RunResult, run_bound_seconds

log = logging.getLogger("gspo.rewards.code")
RUN_PATH, HEALTH_PATH = "/run", "/healthz"
MAX_REQUEST_BYTES = 8 << 20  # a program, its tests and stdin


def serve_sandbox(
    sandbox: LocalSandbox,
    token: str,
    host: str,
    port: int,
    *,
    hashed: bool = False,
    concurrency: int | None = None,
    queue_seconds: float | None = None,
) -> ThreadingHTTPServer:
    """Serve `sandbox` on (host, port); every /run needs `Authorization: Bearer <token>`.
    With `hashed`, `token` is the token's hex SHA-256: what the operator's sandbox pods hold,
    so a program that reads it there holds nothing the job's other pods accept.

    At most `concurrency` programs run at once (reward.sandbox.concurrency by default): the
    Service spreads the learner's concurrency x replicas requests over the pods unevenly, and
    each pod's memory is sized for that many. A request beyond it waits for a slot as long as
    one run can take, then gets 503: the client waits for that and one run (request_timeout),
    so a program is never run for a caller that has given up on it."""
    want = token.encode()
    slots = threading.BoundedSemaphore(concurrency or sandbox.cfg.concurrency)
    queue_s = run_bound_seconds(sandbox.cfg) if queue_seconds is None else queue_seconds

    def authorized(header: str) -> bool:
        presented = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
        if hashed:
            presented = hashlib.sha256(presented.encode()).hexdigest()
        return bool(presented) and hmac.compare_digest(presented.encode(), want)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != HEALTH_PATH:
                self.send_error(404)
                return
            self._reply(200, {"ok": True})

        def do_POST(self) -> None:
            if self.path != RUN_PATH:
                self.send_error(404)
                return
            if not authorized(self.headers.get("Authorization", "")):
                self._reply(401, {"error": "a bearer token is needed: the job's token"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REQUEST_BYTES:
                self._reply(413, {"error": f"a request holds 1 to {MAX_REQUEST_BYTES} bytes"})
                return
            try:
                req = json.loads(self.rfile.read(length))
                files, argv = dict(req["files"]), list(req["argv"])
                stdin, env = base64.b64decode(req.get("stdin", "")), dict(req.get("env", {}))
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": f"malformed request: {exc}"})
                return
            if not slots.acquire(timeout=queue_s):
                self._reply(503, {"error": f"every slot stayed busy for {queue_s:.0f} s"})
                return
            try:
                result = sandbox.run(files, argv, stdin, env)
            finally:
                slots.release()
            self._reply(200, _encode(result))

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


# No HTTP(S)_PROXY: urllib's default opener would send every /run, the job's bearer token
# with it, through a proxy the learner's environment names; the sandbox is in the cluster.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request_timeout(cfg: SandboxConfig) -> float:
    """How long the learner waits for one /run: a wait for a slot on a busy pod (the server
    gives up on it after one run's bound) and then the run itself, with a margin."""
    return 2 * run_bound_seconds(cfg) + 10


class RemoteSandbox:
    """The learner's side of mode service: runs each program on the fleet at `url`."""

    def __init__(self, url: str, token: str, timeout_s: float) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    def run(
        self,
        files: dict[str, str],
        argv: list[str],
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
    ) -> RunResult:
        body = json.dumps(
            {
                "files": files,
                "argv": argv,
                "env": env or {},
                "stdin": base64.b64encode(stdin).decode(),
            }
        ).encode()
        request = urllib.request.Request(
            self.url + RUN_PATH,
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with _DIRECT.open(request, timeout=self.timeout_s) as response:
                return _decode(json.loads(response.read()))
        except urllib.error.HTTPError as exc:
            why = f"the sandbox service at {self.url} answered {exc.code} {exc.reason}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"the sandbox service at {self.url} is unreachable or garbled: {exc}"
        return RunResult(None, b"", b"", 0.0, failure=why)


def _encode(result: RunResult) -> dict:
    return {
        "exit_code": result.exit_code,
        "stdout": base64.b64encode(result.stdout).decode(),
        "stderr": base64.b64encode(result.stderr).decode(),
        "seconds": result.seconds,
        "timed_out": result.timed_out,
        "output_capped": result.output_capped,
        "failure": result.failure,
    }


def _decode(body: dict) -> RunResult:
    return RunResult(
        exit_code=None if body["exit_code"] is None else int(body["exit_code"]),
        stdout=base64.b64decode(body["stdout"]),
        stderr=base64.b64decode(body["stderr"]),
        seconds=float(body["seconds"]),
        timed_out=bool(body["timed_out"]),
        output_capped=bool(body["output_capped"]),
        failure=body["failure"],
    )


PR_SET_DUMPABLE = 4


def undumpable() -> None:
    """No core dumps, ptrace or /proc/<pid>/mem of this process by its own user."""
    import ctypes

    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="gspo sandbox-server",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port of POST /run and GET /healthz")
    token_source = p.add_mutually_exclusive_group(required=True)
    token_source.add_argument("--token-file", help="file holding the job's bearer token")
    token_source.add_argument("--token-sha256-file", help="file holding its hex SHA-256 instead")
    p.add_argument("--sandbox", default="{}", help="reward.sandbox as JSON (camelCase keys)")
    args = p.parse_args(argv)
    # The job's token passes through this process with every /run: a program run with
    # isolation none, as this user, must not read it from this process's memory (ptrace,
    # /proc/<pid>/mem), as the assert-style harness guards its own pass token.
    undumpable()
    # As a pod's first process the kernel ignores SIGTERM without a handler: the kubelet's
    # stop would wait out the grace period. 143, not 0: a Job counts 0 as done.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    with open(args.token_file or args.token_sha256_file, encoding="utf-8") as f:
        token = f.read().strip()
    sandbox = LocalSandbox(SandboxConfig.model_validate(json.loads(args.sandbox)))
    why, passing = sandbox.probe_run()
    if why is not None:
        # Exit 2, as a learner that cannot run as configured: the operator's podFailurePolicy
        # fails the sandbox Job at once (every pod on these nodes would refuse the same way),
        # and these last lines become the pod's termination message, copied into the job. A
        # probe that only ran out of time (a cold or loaded node) exits 1: the Job retries.
        print(f"the sandbox cannot run a program here: {why}", file=sys.stderr, flush=True)
        raise SystemExit(1 if passing else INVALID_CONFIG_EXIT_CODE)
    server = serve_sandbox(sandbox, token, args.host, args.port, hashed=not args.token_file)
    log.info("Serving the code sandbox on %s:%d (pid %d)", args.host, args.port, os.getpid())
    server.serve_forever()


if __name__ == "__main__":
    main()
