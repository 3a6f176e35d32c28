"""The operator's pods, run for real on the local cluster (local_cluster.py).

`kubectl apply` a tiny job (examples/local-cluster.yaml: 2 learner pods over gloo between two
network namespaces, 1 vLLM rollout server); the operator renders its JobSet, JobSet's and the
Job controller's stand-ins make the pods, and the node runs them as processes. Faults are
real: a learner rank SIGKILLed, the rollout server SIGKILLed, a learner pod evicted, the
JobSet suspended (SIGTERM to the pods), a learner that refuses its configuration. Each phase
prints how long it took.

Needs root (network and mount namespaces) and the real kubectl; skipped otherwise.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml
from kubelet import pod_problems, scheduling_problems
from local_cluster import LocalCluster, local_cluster
from netns import unavailable_reason
from storage import GKE_CLASSES

from gspo_api import ports

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = list(yaml.safe_load_all((REPO / "examples/local-cluster.yaml").read_text()))
JOB = "tiny-cluster"
MAX_STEPS = 150  # of the faults run: three times the steps its faults take to land
# What the pods compile on a first start (DeepSpeed's CPU comm op, torch.compile's kernels),
# kept between runs on this machine in the example's build-cache claim.
BUILD_CACHE = Path(os.environ.get("GSPO_LOCAL_CLUSTER_CACHE", "/tmp/gspo-local-cluster-cache"))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


def manifest(tmp: Path, **spec: dict) -> Path:
    """examples/local-cluster.yaml with spec sections updated, written to a file."""
    docs = copy.deepcopy(EXAMPLE)
    job = next(d for d in docs if d["kind"] == "GSPOJob")
    for section, fields in spec.items():
        job["spec"][section] = {**job["spec"].get(section, {}), **fields}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def share_build_cache(cluster: LocalCluster) -> None:
    """Back the example's build-cache claim with the directory kept between runs."""
    BUILD_CACHE.mkdir(parents=True, exist_ok=True)
    BUILD_CACHE.chmod(0o1777)  # a volume provisioned for any uid (the pods run as 10001)
    claim = cluster.claim_dir("build-cache")
    claim.parent.mkdir(parents=True, exist_ok=True)
    if not claim.exists():
        claim.symlink_to(BUILD_CACHE, target_is_directory=True)


def rank_pid(job: str, rank: int) -> int | None:
    """The learner process of global rank `rank` (a child of torch.distributed.run)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        wanted = (f"GSPO_JOB_NAME={job}", f"RANK={rank}", "LOCAL_RANK=0")  # a learner rank
        if all(w.encode() in env for w in wanted) and any(
            e.startswith(b"GSPO_NNODES=") for e in env
        ):
            return int(proc.name)
    return None


def printed_step(table: str) -> str:
    """The STEP cell of `kubectl get gspo`'s one row (cells are aligned under the header)."""
    lines = table.rstrip().splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("NAME")), None)
    assert at is not None and "REWARD" in lines[at], table
    header, row = lines[at], lines[at + 1]
    start = header.index("STEP")
    cell = row[start : header.index("REWARD")].strip()
    assert cell.isdigit(), table
    return cell


def checkpoints(cluster: LocalCluster) -> list[str]:
    root = cluster.claim_dir(f"{JOB}-checkpoints")
    return sorted(p.name for p in root.glob("step-*")) if root.exists() else []


def history_steps(cluster: LocalCluster) -> list[int]:
    path = cluster.claim_dir(f"{JOB}-checkpoints") / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


# A learner's last words when it stops as asked: after a final checkpoint, or, stopped before
# it trained a step since it started, with the checkpoint it resumed from holding that step.
STOPPED = r"Stopped at step (\d+) (?:after a final checkpoint|before training a step)"


async def test_a_job_trains_through_faults_suspend_and_resume_to_succeeded(tmp_path) -> None:
    async with local_cluster(tmp_path / "cluster") as cluster:
        share_build_cache(cluster)
        # Every fault lands within the first ~50 steps (the learner waits while its server is
        # replaced, and is evicted at its first step after the resume); steps take 0.1-1 s.
        path = manifest(tmp_path, algorithm={"maxSteps": MAX_STEPS})
        out = await cluster.kubectl("apply", "--validate=false", "-f", str(path))
        assert f"gspojob.gspo.dev/{JOB} created" in out

        # --- every learner pod Ready (each serves /healthz), training under way -------------
        await cluster.wait(
            lambda: cluster.condition(JOB, "LearnerReady").get("status") == "True",
            600,
            "both learner pods Ready",
            JOB,
        )
        assert len(cluster.pods(JOB, "learner", running=True)) == 2
        await cluster.wait(
            lambda: (cluster.status(JOB).get("step") or 0) >= 2, 300, "step 2 in the status", JOB
        )
        cluster.mark("start until step 2 (pods, vLLM load, DeepSpeed over two namespaces)")
        steps_seen = set()
        for _ in range(2):
            out = await cluster.kubectl("get", "gspo", JOB)
            steps_seen.add(printed_step(out))
            last = int(max(steps_seen))
            await cluster.wait(
                lambda last=last: (cluster.status(JOB).get("step") or 0) > last,
                120,
                "the step to advance",
                JOB,
            )
        # The learner trains once the server answers; the pod is Ready only at the kubelet's
        # next probe (every 5 s), which a fast start can leave behind a few steps.
        for condition in ("RolloutReady", "WeightsSynced"):
            await cluster.wait(
                lambda c=condition: cluster.condition(JOB, c).get("status") == "True",
                60,
                f"{condition} True",
                JOB,
            )
        (held,) = cluster.status(JOB)["serverVersions"].values()  # the one server's version
        assert held is not None and held >= 1
        # The learner generates with the job's token; anyone else reaching the pod is refused.
        (server_pod,) = cluster.pods(JOB, "rollout", running=True)
        base = f"http://{server_pod['status']['podIP']}:{ports.ROLLOUT_HTTP_PORT}"
        async with aiohttp.ClientSession() as session:
            body = {"model": "any", "prompt": "1+2=", "max_tokens": 2}
            for path in ("/v1/completions", "/tokenize", "/control/pause"):
                async with session.post(base + path, json=body) as resp:
                    assert resp.status == 401, (path, await resp.text())

        # --- a learner rank SIGKILLed: the group restarts from the newest checkpoint ---------
        await cluster.wait(lambda: checkpoints(cluster), 300, "a first checkpoint", JOB)
        first_server = cluster.pods(JOB, "rollout")[0]["metadata"]["name"]
        pid = rank_pid(JOB, 1)
        assert pid is not None, "no learner rank 1 process"
        os.kill(pid, signal.SIGKILL)
        await cluster.wait(
            lambda: cluster.status(JOB).get("restarts") == 1, 120, "a JobSet restart", JOB
        )
        await cluster.wait(
            lambda: (
                "Resumed from"
                in "".join(
                    cluster.log(p["metadata"]["name"], "learner")
                    for p in cluster.pods(JOB, "learner")
                )
            ),
            600,
            "the new learner group to resume from a checkpoint",
            JOB,
        )
        cluster.mark("learner rank SIGKILLed -> resumed from the newest checkpoint")
        await cluster.wait(
            lambda: cluster.status(JOB).get("phase") == "Running", 600, "Running again", JOB
        )

        # --- the rollout server SIGKILLed: replaced alone, synced before it serves -----------
        # The JobSet restart replaced every pod; the learner's resume (and the phase) can come
        # before the new rollout pod runs, so wait for it, and for the old one to be gone.
        def restarted_servers() -> list[str]:
            names = [p["metadata"]["name"] for p in cluster.pods(JOB, "rollout", running=True)]
            return names if names and first_server not in names else []

        (server,) = await cluster.wait(
            restarted_servers, 300, "the restarted group's rollout pod, alone", JOB
        )
        cluster.node.kill_process("default", server)
        await cluster.wait(
            lambda: [
                p
                for p in cluster.pods(JOB, "rollout", running=True)
                if p["metadata"]["name"] != server
            ],
            300,
            "a replacement rollout pod",
            JOB,
        )
        (replacement,) = [
            p["metadata"]["name"]
            for p in cluster.pods(JOB, "rollout")
            if p["metadata"]["name"] != server
        ]
        await cluster.wait(
            lambda: "Loaded policy version" in cluster.log(replacement, "rollout"),
            600,
            "the replacement to be synced",
            JOB,
        )
        await cluster.wait(
            lambda: cluster.status(JOB).get("rolloutReady") == "1/1",
            300,
            "the replacement Ready",
            JOB,
        )
        assert cluster.status(JOB)["restarts"] == 1  # the learner was not restarted
        cluster.mark("rollout server SIGKILLed -> replaced and synced, learner kept going")

        # --- suspend: SIGTERM, a final checkpoint; resume continues from it ------------------
        at = cluster.status(JOB).get("step") or 0
        await cluster.kubectl(
            "patch", "gspojob", JOB, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}'
        )

        def stopped_at() -> list[int]:
            logs = "".join(
                p.read_text(errors="replace") for p in (cluster.workdir / "logs").glob("*learner*")
            )
            return [int(s) for s in re.findall(STOPPED, logs)]

        def gone() -> bool:  # no learner pod left, terminating ones included
            return not [
                p
                for p in cluster.api.list_kind("Pod", "default")
                if p["metadata"]["labels"].get("gspo.dev/role") == "learner"
                and p["metadata"]["labels"].get("gspo.dev/job-name") == JOB
            ]

        await cluster.wait(
            lambda: cluster.status(JOB).get("phase") == "Suspended" and gone(),
            300,
            "Suspended with every learner pod gone",
            JOB,
        )
        stopped = stopped_at()
        assert stopped and max(stopped) >= at, (stopped, at)
        assert f"step-{max(stopped):06d}" in checkpoints(cluster)
        cluster.mark(f"suspended: final checkpoint at step {max(stopped)}")
        await cluster.kubectl(
            "patch",
            "gspojob",
            JOB,
            "--type=merge",
            "-p",
            '{"spec":{"runPolicy":{"suspend":false}}}',
        )

        def trained_past(step: int) -> bool:
            """From the running learners' logs, not the status: progress reaches the status
            at most every 30 s per job (the operator's write budget), time enough for the
            learner to finish every step left and leave nothing running to evict."""
            logs = "".join(
                cluster.log(p["metadata"]["name"], "learner")
                for p in cluster.pods(JOB, "learner", running=True)
            )
            return any(int(n) > step for n in re.findall(r"\bstep (\d+) reward", logs))

        await cluster.wait(
            lambda: trained_past(max(stopped)), 600, "training again after the resume", JOB
        )
        cluster.mark("resumed -> training again")

        # --- a learner pod evicted (a drain): restarted from its final checkpoint, not counted -
        evicted = cluster.pods(JOB, "learner", running=True)[0]["metadata"]["name"]
        await cluster.node.evict("default", evicted)
        await cluster.wait(
            lambda: cluster.status(JOB).get("restarts") == 2,
            300,
            "a restart after the eviction",
            JOB,
        )
        jobset = cluster.api.get("JobSet", "default", JOB)["status"]
        assert jobset["restarts"] == 2 and jobset.get("restartsCountTowardsMax") == 1, jobset
        words = await cluster.wait(
            lambda: re.search(STOPPED, cluster.log(evicted, "learner")),
            300,
            "the evicted learner's final checkpoint",
            JOB,
        )
        assert f"step-{int(words.group(1)):06d}" in checkpoints(cluster)
        await cluster.wait(
            lambda: cluster.status(JOB).get("phase") == "Running",
            600,
            "Running after the eviction",
            JOB,
        )
        cluster.mark(
            f"learner pod evicted at step {words.group(1)} -> restarted from its final "
            "checkpoint, not counted"
        )

        out = await cluster.kubectl(
            "wait", "--for=condition=Succeeded", f"gspojob/{JOB}", "--timeout=900s", timeout_s=960
        )
        assert "condition met" in out
        cluster.mark("-> Succeeded")

        # --- the exported model is on the claim and loads with transformers ------------------
        assert cluster.status(JOB)["restarts"] == 2
        steps = history_steps(cluster)
        assert max(steps) == MAX_STEPS and max(stopped) + 1 in steps
        export = cluster.claim_dir(f"{JOB}-checkpoints") / "export"
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(export)
        AutoTokenizer.from_pretrained(export)
        assert model.config.model_type == "qwen3_moe"
        print("phases (s):", ", ".join(f"{w}: {s:.0f}" for w, s in cluster.phases))


async def test_a_learner_that_refuses_its_config_fails_the_job_at_once(tmp_path) -> None:
    """A data file with a bad row (a JSON scalar where an object belongs): the learner's
    preflight names the row and exits 2, and JobSet fails the job on that first exit."""
    async with local_cluster(tmp_path / "cluster") as cluster:
        share_build_cache(cluster)
        rows = BUILD_CACHE / f"bad-rows-{os.getpid()}.jsonl"  # /cache in the learner pods
        rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n5\n")
        rows.chmod(0o644)
        path = manifest(tmp_path, data={"source": f"/cache/{rows.name}", "format": "jsonl"})
        await cluster.kubectl("apply", "--validate=false", "-f", str(path))
        out = await cluster.kubectl(
            "wait", "--for=condition=Failed", f"gspojob/{JOB}", "--timeout=300s", timeout_s=330
        )
        assert "condition met" in out
        failed = cluster.condition(JOB, "Failed")
        assert failed["reason"] == "InvalidConfig", failed
        assert "spec.data.source" in failed["message"], failed
        assert f"{rows.name}' line 2 is a int, not a mapping" in failed["message"], failed
        assert cluster.status(JOB)["restarts"] == 0  # exit 2 is not retried
        rows.unlink()
        cluster.mark("exit 2 -> Failed with the learner's words")


async def test_the_flagship_example_is_pending_for_gpus_only(tmp_path) -> None:
    """examples/gspojob.yaml cannot run here (GPUs), but nothing else stands in its way once
    its prerequisites exist: env sources, volumes, claims and probes all resolve."""
    example = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())
    name = example["metadata"]["name"]
    prereqs = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf-token"},
            "stringData": {"token": "hf_x"},
        },
        *(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim},
                # The class the example's own ReadWriteMany claim names: with no class the
                # claim takes the newest default, GKE's ReadWriteOnce standard-rwo wherever
                # it was added a second after the cluster's own (a creationTimestamp has
                # whole seconds), and is never provisioned.
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "standard-rwx",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
            for claim in ("hf-model-cache", "math-data")
        ),
    ]
    # No Kueue here: without the queue the JobSet is not held suspended for admission.
    example["spec"]["runPolicy"]["scheduling"].pop("queue")
    example["spec"]["runPolicy"]["scheduling"].pop("priorityClassName")
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump_all([*prereqs, example]))
    async with local_cluster(tmp_path / "cluster") as cluster:
        for sc in GKE_CLASSES:  # the example's checkpoint claim asks for Filestore's
            cluster.api.add(copy.deepcopy(sc))
        await cluster.kubectl("apply", "--validate=false", "-f", str(path))
        await cluster.wait(
            lambda: (
                len(cluster.pods(name, "learner")) == 2 and len(cluster.pods(name, "rollout")) == 4
            ),
            60,
            "the pods",
            name,
        )

        def pending_for_gpus() -> bool:
            pods = cluster.pods(name, "learner") + cluster.pods(name, "rollout")
            reasons = [
                c.get("message", "")
                for p in pods
                for c in (p.get("status") or {}).get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False"
            ]
            return len(reasons) == 6 and all("Insufficient nvidia.com/gpu" in r for r in reasons)

        await cluster.wait(pending_for_gpus, 60, "every pod Pending for GPUs", name)
        for pod in cluster.pods(name, "learner") + cluster.pods(name, "rollout"):
            assert pod_problems(pod, cluster.api) == [], pod["metadata"]["name"]
            needs = scheduling_problems(pod, cluster.node.capacity)
            assert needs and all(
                "nvidia.com/gpu" in n or "cpu" in n or "memory" in n for n in needs
            ), needs
        await cluster.wait(
            lambda: (
                "Insufficient nvidia.com/gpu"
                in cluster.condition(name, "Running").get("message", "")
            ),
            30,
            "the job's status to say why it is Pending",
            name,
        )
        cluster.mark("the flagship example: Pending for GPUs only")
