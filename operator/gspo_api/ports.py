"""Ports and entrypoint names shared by the pods, the operator that renders them and the chart.

One place, so the operator never guesses what the learner or the rollout server listens on.
"""

import random
import socket
from collections.abc import Mapping
from pathlib import Path

ROLLOUT_HTTP_PORT = 8000  # rollout server: generation, health, control, /metrics
RENDEZVOUS_PORT = 29500  # torch.distributed rendezvous of the learner group (MASTER_PORT)
# The learner group's rendezvous backend: torch's static one, store bound (rendezvous.py).
RENDEZVOUS_BACKEND = "gspo-static"
WEIGHT_SYNC_PORT = 29600  # torch.distributed group of learner rank 0 and the rollout workers
LEARNER_METRICS_PORT = 9090  # learner /metrics and /progress (spec.metrics.port overrides)
# Every learner pod answers this on the metrics port (its readiness probe); rank 0 also
# serves /metrics (when metrics are enabled) and /progress (always: the operator reads it).
HEALTH_PATH = "/healthz"
OPERATOR_METRICS_PORT = 8080  # operator /metrics
OPERATOR_HEALTH_PORT = 8081  # operator liveness (/healthz)

RESERVED_PORTS = {
    ROLLOUT_HTTP_PORT: "the rollout server's HTTP API",
    RENDEZVOUS_PORT: "the learner rendezvous",
    WEIGHT_SYNC_PORT: "weight sync",
}

# `gspo` subcommands the pods run; the operator and the images start exactly these.
# SIGTERM makes the learner write a final checkpoint and exit (143, below); suspend relies on
# it. The kubelet waits this long (the learner pods' terminationGracePeriodSeconds), and a learner
# group's launcher gives its ranks all but a minute of it before killing them.
LEARNER_GRACE_SECONDS = 1800
# How long a rollout server may take to load its model (its startup probe's budget); the
# learner waits as long for the first server to answer, since pods start together.
ROLLOUT_STARTUP_SECONDS = 1800
# A learner stopped by SIGTERM before maxSteps (after its final checkpoint) exits with this
# code, never 0: on a cluster a pod that is evicted or drained and exits 0 would count as a
# completed index of the learner Job, and the job would "succeed" mid-run. 128 + SIGTERM, as a
# container runtime reports a process that SIGTERM ended; the learner Job's podFailurePolicy
# sends it to JobSet as a disruption (restart from that checkpoint, not counted).
LEARNER_STOPPED_EXIT_CODE = 143
# A learner that cannot run as configured (a bad spec, data row or reward function; a model
# or GPUs not there) exits with this code, found before or during training: the learner Job's
# podFailurePolicy fails it and JobSet fails the job at once (LearnerInvalidConfig), where
# any other failure would be restarted up to runPolicy.backoffLimit times.
INVALID_CONFIG_EXIT_CODE = 2
# Where a rank of a learner group writes the configuration error it stops on, so the group's
# launcher (which torch.distributed.run's exit 1 would hide it from) exits with it too.
ENV_CONFIG_ERROR_FILE = "GSPO_CONFIG_ERROR_FILE"
LEARNER_COMMAND = ("gspo", "learner")
ROLLOUT_COMMAND = ("gspo", "rollout-server")
OPERATOR_COMMAND = ("gspo", "operator")

# Environment variables the pods read.
ENV_CONFIG_PATH = "GSPO_CONFIG"  # path of the run config (ConfigMap mount)
# The job's token: the bearer token the rollout servers' routes (generation, weight sync),
# the learner's calls to them and a code reward's sandbox service ask for (from the job's
# Secret J-job-token; `gspo train` generates one and writes it to <output-dir>/job-token).
ENV_JOB_TOKEN = "GSPO_JOB_TOKEN"
# Its earlier name: still read when ENV_JOB_TOKEN is unset, so the pods of a job created by an
# earlier release (their template sets that name) and users' scripts keep working.
ENV_JOB_TOKEN_EARLIER = "GSPO_SYNC_TOKEN"
# A rollout server's settings for the endpoint plugin (vllm_plugin.py), by environment: the
# plugin cannot add flags to vLLM's command line.
ENV_WEIGHTS_DIR = "GSPO_WEIGHTS_DIR"  # weightSync.method filesystem: the learner's directory
ENV_INITIAL_VERSION = "GSPO_INITIAL_POLICY_VERSION"  # serve the loaded weights as this version
ENV_ENGINE_NICE = "GSPO_ENGINE_NICE"  # the front end's children (its engine) this much below it
# The policy version that produced a generation, on each reply of a plugin server.
VERSION_HEADER = "x-gspo-policy-version"
ENV_ROLLOUT_URLS = "GSPO_ROLLOUT_URLS"  # comma-separated rollout base URLs
ENV_CHECKPOINT_DIR = "GSPO_CHECKPOINT_DIR"
ENV_JOB_NAME = "GSPO_JOB_NAME"  # the GSPOJob's name (metrics labels, log lines)
ENV_POD_IP = "GSPO_POD_IP"  # this pod's IP (downward API): learner rank 0 hosts weight sync on it
# The learner group: torch.distributed's MASTER_ADDR/MASTER_PORT plus these three; a learner
# pod starts GSPO_NPROC_PER_NODE processes (one per GPU, 1 on CPU) as node GSPO_NODE_RANK.
ENV_NODE_RANK = "GSPO_NODE_RANK"
ENV_NNODES = "GSPO_NNODES"
ENV_NPROC_PER_NODE = "GSPO_NPROC_PER_NODE"

# Where pods find things.
CONFIG_DIR = "/etc/gspo"  # ConfigMap mount; holds CONFIG_FILE, the whole GSPOJob manifest
CONFIG_FILE = "gspojob.yaml"
CHECKPOINT_DIR = "/checkpoints"  # checkpoint volume mount
# weightSync.method filesystem: learner rank 0 writes each policy version under this
# directory of the checkpoint volume; the rollout pods mount the volume at the same path.
WEIGHTS_SUBDIR = "weights"
# GSPO_ROLLOUT_URLS may name a headless Service instead of fixed servers:
# "dns+http://HOST:PORT" means "every address HOST resolves to, re-resolved each step".
ROLLOUT_DNS_SCHEME = "dns+http"

# reward.sandbox.mode service with no serviceUrl: the operator runs the job's sandbox pods
# (`gspo sandbox-server`, code/service.py) behind a Service and points the learner at it.
SANDBOX_HTTP_PORT = 8080  # a sandbox pod's POST /run and GET /healthz
SANDBOX_COMMAND = ("gspo", "sandbox-server")
ENV_SANDBOX_URL = "GSPO_SANDBOX_URL"  # the learner's: base URL of the job's sandbox Service
# Where a sandbox pod holds the job token's SHA-256 (not the token: what it checks against).
SANDBOX_TOKEN_DIR = "/var/run/gspo/sandbox"
# How long the learner waits for the job's sandbox pods to answer (they start with it).
SANDBOX_STARTUP_SECONDS = 600


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_WINDOW = 16384  # ports just below the kernel's ephemeral range that free_port draws from
# Kubernetes' NodePort range starts here: on a machine that is also a node (k3s, minikube)
# kube-proxy forwards those ports on every address with no socket bound to show it.
NODE_PORTS = 30000
_drawn: set[int] = set()  # what this process handed out: not bound yet, so not seen as taken
_random = random.SystemRandom()  # not the random module's state, which a caller may seed


def free_port(ephemeral: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A TCP port free on this machine now, for a process of it to bind next (the local
    run's servers and learner, the tests' rendezvous). Drawn at random below the kernel's
    ephemeral range, not from it: the kernel hands that range out to every outgoing
    connection, so a port it gave `bind(0)` and that was closed again can be any process's
    next connection's before a server that imports vLLM for 30 s binds it (two runs side by
    side, their gloo meshes and HTTP clients, took one so: "Address already in use"). Another
    process may still bind it first: callers that must not fail retry or bind it at once.
    Below NodePorts too, and never one this process handed out already. Without the range
    (not Linux), the kernel's choice."""
    try:
        low = int(ephemeral.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    top = min(low, NODE_PORTS)
    start = max(1024, top - PORT_WINDOW)
    for _ in range(64 if top > start else 0):
        port = _random.randrange(start, top)
        if port in _drawn:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: free for a loopback bind and a wildcard one
            except OSError:
                continue
        _drawn.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_token(environ: Mapping[str, str]) -> str | None:
    """The job's token from the environment (ENV_JOB_TOKEN, else its earlier name), or None
    when neither is set."""
    return environ.get(ENV_JOB_TOKEN) or environ.get(ENV_JOB_TOKEN_EARLIER) or None
