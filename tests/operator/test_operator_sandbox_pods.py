"""reward.sandbox.mode service with no serviceUrl: the operator renders the job's sandbox pods.

A `sandbox` replicated job in the JobSet (so Kueue admits it with the job), its Service (the
learner's $GSPO_SANDBOX_URL) and a NetworkPolicy; the pods hold the job's token and nothing
else of the job. The NetworkPolicies are read with the local cluster's NetworkPolicy semantics
(tests/cluster/netpol.py, from kubernetes' networking types): who may connect to whom.
"""

from __future__ import annotations

import hashlib

import pytest
from netpol import PodAddress, peer_pods, policy_types, selector_matches, selects
from rendered_checks import check_rendered
from test_operator_render import (
    EXAMPLE,
    by_kind,
    container,
    env_of,
    job,
    one,
    pod_template,
    rendered,
)

from gspo_api import ports
from gspo_api.spec import MAX_SANDBOX_REPLICAS, SandboxConfig
from gspo_operator import names, render
from gspo_operator.render import SANDBOX_BACKOFF_LIMIT

NAME, NS = "qwen3-30b-a3b-math", "team-a"
SANDBOX = {
    "mode": "service",
    "replicas": 3,
    "runtimeClassName": "gvisor",
    "concurrency": 8,
    "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
}


def code_job(sandbox: dict | None = None, **overrides) -> dict:
    return job(
        reward={"kind": "code", "sandbox": SANDBOX if sandbox is None else sandbox}, **overrides
    )


def sandbox_objects(objs: list[dict]) -> list[str]:
    return [
        f"{o['kind']} {o['metadata']['name']}"
        for o in objs
        if o["metadata"]["labels"].get(names.ROLE_LABEL) == names.SANDBOX
    ]


def replicated_names(objs: list[dict]) -> list[tuple[str, int]]:
    return [
        (r["name"], r["replicas"]) for r in by_kind(objs, "JobSet")[0]["spec"]["replicatedJobs"]
    ]


def test_rendered_sandbox_pods_pass_the_api_server_and_jobset_checks() -> None:
    # With user settings on the learner that must not reach the sandbox pods.
    objs = rendered(
        code_job(
            learner__imagePullSecrets=["registry"],
            runPolicy__scheduling={
                "nodeSelector": {"pool": "h100"},
                "priorityClassName": "research",
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        )
    )
    assert check_rendered(objs) == []
    assert sandbox_objects(objs) == [f"Service {NAME}-sandbox", f"NetworkPolicy {NAME}-sandbox"]
    sandbox_job = next(
        r for r in by_kind(objs, "JobSet")[0]["spec"]["replicatedJobs"] if r["name"] == "sandbox"
    )
    assert sandbox_job["replicas"] == 3
    assert sandbox_job["template"]["spec"]["backoffLimit"] == SANDBOX_BACKOFF_LIMIT
    assert sandbox_job["template"]["spec"]["parallelism"] == 1  # one Job per pod, as rollout
    rules = by_kind(objs, "JobSet")[0]["spec"]["failurePolicy"]["rules"]
    (out_of_retries,) = [r for r in rules if r["targetReplicatedJobs"] == ["sandbox"]]
    assert out_of_retries["action"] == "FailJobSet"
    pod = pod_template(objs, "sandbox")["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["priorityClassName"] == "research"
    # The accelerator pool and its (GPU) taints are the learner's: no model code there.
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod_template(objs, "learner")["spec"]["tolerations"]
    # No injected mesh proxy: under the egress deny-all it would keep the pod un-Ready.
    annotations = pod_template(objs, "sandbox")["metadata"]["annotations"]
    assert annotations == {"sidecar.istio.io/inject": "false", "linkerd.io/inject": "disabled"}
    assert pod["imagePullSecrets"] == [{"name": "registry"}]  # the learner's image


def test_the_sandbox_pod_holds_the_token_and_nothing_else_of_the_job() -> None:
    objs = rendered(
        code_job(
            learner__env=[{"name": "WANDB_API_KEY", "value": "secret"}],
            learner__serviceAccountName="trainer",
            model__hfTokenSecret={"name": "hf", "key": "token"},
            model__cache={"claimName": "hf-cache"},
        )
    )
    pod = pod_template(objs, "sandbox")["spec"]
    learner = pod_template(objs, "learner")["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert pod["securityContext"] == learner["securityContext"]  # the operator's fixed one
    (c,) = pod["containers"]
    assert c["securityContext"] == container(objs, "learner")["securityContext"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert sorted(volumes) == ["home", "sandbox-token", "tmp"]  # no config, checkpoint, cache
    assert volumes["home"] == {"name": "home", "emptyDir": {}}
    # Of the job's token, only its SHA-256: a program that reads it cannot use it elsewhere.
    token = volumes["sandbox-token"]["secret"]
    assert token["secretName"] == names.token_secret(NAME)
    assert token["items"] == [{"key": "token-sha256", "path": "token-sha256"}]
    assert token["defaultMode"] == 0o440
    (secret,) = by_kind(objs, "Secret")
    assert secret["stringData"]["token-sha256"] == hashlib.sha256(b"t0ken").hexdigest()
    # The token an earlier release's Secret lends (reconcile) comes with its own SHA-256.
    lent = render.with_token(secret, "earlier")["stringData"]
    assert lent == {"token": "earlier", "token-sha256": hashlib.sha256(b"earlier").hexdigest()}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[ports.SANDBOX_TOKEN_DIR]["readOnly"] is True
    env = env_of(c)
    assert not {
        "WANDB_API_KEY",
        "HF_TOKEN",
        ports.ENV_JOB_TOKEN,
        ports.ENV_JOB_TOKEN_EARLIER,
    } & set(env)
    assert all("valueFrom" not in e for e in c["env"])  # no Secret reaches its environment
    assert c["command"] == list(ports.SANDBOX_COMMAND)
    assert f"--token-sha256-file={ports.SANDBOX_TOKEN_DIR}/token-sha256" in c["args"]
    (limits,) = [a for a in c["args"] if a.startswith("--sandbox=")]
    applied = SandboxConfig.model_validate_json(limits.removeprefix("--sandbox="))
    assert applied.isolation == "namespaces" and applied.concurrency == 8
    assert applied.mode == "local"  # the pod runs programs itself
    assert c["resources"] == SANDBOX["resources"]
    assert c["readinessProbe"]["httpGet"] == {"path": ports.HEALTH_PATH, "port": "sandbox"}
    assert c["ports"] == [
        {"name": "sandbox", "containerPort": ports.SANDBOX_HTTP_PORT, "protocol": "TCP"}
    ]


def test_the_learner_is_pointed_at_the_sandbox_service() -> None:
    objs = rendered(code_job())
    url = env_of(container(objs, "learner"))[ports.ENV_SANDBOX_URL]
    service = one(objs, "Service", names.sandbox_service(NAME))
    assert url == f"http://{NAME}-sandbox.{NS}.svc:{ports.SANDBOX_HTTP_PORT}"
    assert service["spec"]["ports"][0]["port"] == ports.SANDBOX_HTTP_PORT
    labels = pod_template(objs, "sandbox")["metadata"]["labels"]
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, labels)
    for role in ("learner", "rollout"):
        other = pod_template(objs, role)["metadata"]["labels"]
        assert not selector_matches({"matchLabels": service["spec"]["selector"]}, other)


@pytest.mark.parametrize(
    "reward",
    [
        {"kind": "code"},  # mode local
        {"kind": "code", "sandbox": {"mode": "service", "serviceUrl": "http://sandbox:8080"}},
    ],
)
def test_no_sandbox_pods_in_mode_local_or_with_a_service_url(reward: dict) -> None:
    objs = rendered(job(reward=reward))
    assert sandbox_objects(objs) == []
    replicated = by_kind(objs, "JobSet")[0]["spec"]["replicatedJobs"]
    assert [r["name"] for r in replicated] == ["learner", "rollout"]
    assert ports.ENV_SANDBOX_URL not in env_of(container(objs, "learner"))
    (secret,) = by_kind(objs, "Secret")
    assert list(secret["stringData"]) == ["token"]
    (policy,) = by_kind(objs, "NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {names.JOB_LABEL: NAME}}


def test_sandbox_pod_names_stay_within_jobsets_limit_at_the_most_replicas() -> None:
    """`<job>-sandbox-9-0` is as long as the learner's `<job>-learner-0-<i>`: a job name the
    learner's pod names allow is never refused for its sandbox pods."""
    spec = EXAMPLE["spec"]
    longest = names.max_job_name(spec["learner"]["replicas"], spec["rollout"]["replicas"])
    sandbox = {"mode": "service", "replicas": MAX_SANDBOX_REPLICAS, "runtimeClassName": "gvisor"}
    objs = rendered(code_job(sandbox, metadata_name="a" * longest))
    assert check_rendered(objs) == []
    assert replicated_names(objs)[-1] == ("sandbox", MAX_SANDBOX_REPLICAS)


# --- who may connect to whom -------------------------------------------------------------


def pods_of(objs: list[dict]) -> dict[str, PodAddress]:
    """One pod of each role of the job, another job's learner, and a pod of another
    namespace, as the NetworkPolicy semantics see them."""
    out = {}
    for i, role in enumerate(("learner", "rollout", "sandbox")):
        template = pod_template(objs, role)
        pod = {"metadata": {"name": role, "namespace": NS, **template["metadata"]}}
        pod["spec"] = template["spec"]
        out[role] = PodAddress.of(pod, f"10.0.0.{i + 1}")
    stranger = {names.JOB_LABEL: "other", names.ROLE_LABEL: "learner"}
    out["other-job"] = PodAddress(NS, "other", "10.0.1.1", stranger)
    out["elsewhere"] = PodAddress("monitoring", "scraper", "10.0.2.1", {"app": "x"})
    return out


def ingress_admits(policies: list[dict], src: PodAddress, dst: PodAddress, port: int) -> bool:
    """Whether `dst` admits a TCP connection from `src` to `port` (the union of the rules of
    every policy that selects it; not isolated: everything passes)."""
    selecting = [p for p in policies if selects(p, dst) and "Ingress" in policy_types(p)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from") or []
            peer_ok = not peers or any(src in peer_pods(peer, NS, [src], {}) for peer in peers)
            opened = [p.get("port") for p in rule.get("ports") or []]
            if peer_ok and (not opened or port in opened):
                return True
    return False


def egress_isolated_with_no_rule(policies: list[dict], src: PodAddress) -> bool:
    selecting = [p for p in policies if selects(p, src) and "Egress" in policy_types(p)]
    return bool(selecting) and not any(p["spec"].get("egress") for p in selecting)


def test_only_the_jobs_learner_reaches_the_sandbox_and_the_sandbox_reaches_nothing() -> None:
    objs = rendered(code_job())
    policies = by_kind(objs, "NetworkPolicy")
    pods = pods_of(objs)
    sandbox, port = pods["sandbox"], ports.SANDBOX_HTTP_PORT
    assert ingress_admits(policies, pods["learner"], sandbox, port)
    for who in ("rollout", "other-job", "elsewhere"):
        assert not ingress_admits(policies, pods[who], sandbox, port), who
    for other_port in (ports.RENDEZVOUS_PORT, ports.ROLLOUT_HTTP_PORT, 9090):
        assert not ingress_admits(policies, pods["learner"], sandbox, other_port)
    # Nothing out, not even DNS: Egress isolated, no egress rule at all (no `egress: []`
    # either: the API server drops an empty list, and the operator would see drift).
    assert egress_isolated_with_no_rule(policies, sandbox)
    (own,) = [p for p in policies if p["metadata"]["name"] == names.sandbox_network_policy(NAME)]
    assert "egress" not in own["spec"]
    # The job's own traffic is untouched, and the sandbox is no peer of the job's pods.
    assert ingress_admits(policies, pods["rollout"], pods["learner"], ports.RENDEZVOUS_PORT)
    assert ingress_admits(policies, pods["learner"], pods["rollout"], ports.ROLLOUT_HTTP_PORT)
    for role in ("learner", "rollout"):
        assert not ingress_admits(policies, sandbox, pods[role], ports.RENDEZVOUS_PORT), role
        assert not egress_isolated_with_no_rule(policies, pods[role]), role


def test_a_sandbox_job_out_of_retries_fails_the_job_as_sandbox_failed() -> None:
    from test_operator_status import NOW, RAW, cond, js, observed, pods, servers, step

    from gspo_api.validation import parse_spec
    from gspo_operator.views import PodView

    sandbox = {"mode": "service", "runtimeClassName": "gvisor"}
    raw = {**RAW, "reward": {"kind": "code", "sandbox": sandbox}}
    failed_pod = PodView(
        f"{NAME}-sandbox-0-0-abcde",
        role="sandbox",
        phase="Failed",
        exit_code=1,
        message="Traceback (most recent call last): ... MemoryError",
    )
    # A rollout server that failed once earlier (its Job replaced it) does not make the
    # sandbox's failure a rollout one: JobSet's message names the Job that failed first.
    old_rollout = PodView(
        f"{NAME}-rollout-0-0-fghij", role="rollout", phase="Failed", exit_code=1, message="OOM"
    )
    # What JobSet writes (failJobSetActionApplier, pkg/controllers/failure_policy.go).
    message = (
        "applying FailJobSet failure policy action (first failed job: "
        f"{names.jobset(NAME)}-sandbox-0)"
    )
    failed = js(Failed=("FailJobSetFailurePolicyAction", message))
    obs = observed(pods("Running"), servers(1), [old_rollout, failed_pod], jobset=failed)
    out = step(parse_spec(raw), obs, {"phase": "Running"}, NOW)
    assert out.status["phase"] == "Failed"
    assert cond(out.status, "Failed")["reason"] == "SandboxFailed"
    sandboxed = cond(out.status, "CodeSandboxed")
    assert sandboxed["status"] == "True"


@pytest.mark.parametrize(
    ("message", "role"),
    [
        (
            "applying FailJobSet failure policy action (first failed job: exp-a-rollout-1)",
            "rollout",
        ),
        (
            "jobset failed due to one or more job failures (first failed job: x-sandbox-10)",
            "sandbox",
        ),
        ("applying FailJobSet failure policy action (first failed job: x-learner-0)", "learner"),
        ("reached maximum restarts", None),
    ],
)
def test_the_failed_role_is_read_from_jobsets_first_failed_job(message, role) -> None:
    from gspo_operator.status import first_failed_role

    assert first_failed_role(message) == role


def test_a_sandbox_pod_refused_its_isolation_fails_the_job_at_once_with_its_words() -> None:
    """`gspo sandbox-server` exits 2 when its node refuses the isolation: the sandbox Job's
    podFailurePolicy fails it at once (every pod would refuse), not after 20 replacements,
    and the pod's termination message reaches the job's Failed condition."""
    from test_operator_status import NOW, RAW, cond, js, observed, pods, servers, step

    from gspo_api.validation import parse_spec
    from gspo_operator.views import PodView

    objs = rendered(code_job())
    sandbox_job = next(
        r for r in by_kind(objs, "JobSet")[0]["spec"]["replicatedJobs"] if r["name"] == "sandbox"
    )
    rules = sandbox_job["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": "sandbox",
            "operator": "In",
            "values": [ports.INVALID_CONFIG_EXIT_CODE],
        },
    }
    sandbox = {"mode": "service", "runtimeClassName": "gvisor"}
    raw = {**RAW, "reward": {"kind": "code", "sandbox": sandbox}}
    why = "the sandbox cannot run a program here: unshare(CLONE_NEWUSER) refused"
    refused = PodView(
        f"{NAME}-sandbox-0-0-abcde", role="sandbox", phase="Failed", exit_code=2, message=why
    )
    message = f"applying FailJobSet failure policy action (first failed job: {NAME}-sandbox-0)"
    failed = js(Failed=("FailJobSetFailurePolicyAction", message))
    obs = observed(pods("Running"), servers(1), [refused], jobset=failed)
    out = step(parse_spec(raw), obs, {"phase": "Running"}, NOW)
    failed_cond = cond(out.status, "Failed")
    assert failed_cond["reason"] == "SandboxRefused"
    assert why in failed_cond["message"] and "not retried" in failed_cond["message"]


def test_sandbox_pods_without_resources_request_room_for_concurrency_programs() -> None:
    """Unset resources would make the pods BestEffort: not counted by Kueue, evicted first,
    and with no room for concurrency programs of memoryMib each."""
    sandbox = {"mode": "service", "runtimeClassName": "gvisor", "concurrency": 4}
    c = container(rendered(code_job({**sandbox, "memoryMib": 1024})), "sandbox")
    memory = f"{4 * 1024 + 256}Mi"
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": memory},
        "limits": {"memory": memory},
    }
