"""The cluster quick start as README.md writes it: `helm install` with the chart's defaults,
then `kubectl apply -f examples/gspojob.yaml` from a kubeconfig that names no namespace (kubectl
then uses `default`). The operator runs with exactly the `--namespace` arguments the real helm
renders into its Deployment, against the API stand-in, and the job must get a status: an
operator that watched only its own namespace left it with none, and no event.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from checkout import REPO
from kubectl import KUBECTL, Kubectl
from operator_harness import eventually

HELM = REPO / ".tools" / "helm" / "helm"

pytestmark = [
    pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed"),
    pytest.mark.skipif(not HELM.exists(), reason="helm is not installed (make tools)"),
]


def chart_watched_namespaces() -> list[str]:
    """The `--namespace=` arguments of the operator Deployment `helm install gspo-operator
    charts/gspo-operator -n gspo-system` creates with every value at its default."""
    out = subprocess.run(
        [HELM, "template", "gspo-operator", REPO / "charts" / "gspo-operator", "-n", "gspo-system"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    (deploy,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a.removeprefix("--namespace=") for a in args if a.startswith("--namespace=")]


async def test_the_quick_start_job_is_reconciled_by_a_default_install(
    api, run_operator, tmp_path: Path
) -> None:
    watched = chart_watched_namespaces()
    kubectl = Kubectl(api.base_url, tmp_path)
    config = yaml.safe_load(kubectl.config.read_text())
    del config["contexts"][0]["context"]["namespace"]  # a fresh kubeconfig names none
    kubectl.config.write_text(yaml.safe_dump(config))
    async with run_operator(api, interval_s=0.3, namespaces=tuple(watched)):
        out = await kubectl("apply", "-f", "examples/gspojob.yaml")
        assert "gspojob.gspo.dev/qwen3-30b-a3b-math created" in out, out
        assert api.get("GSPOJob", "default", "qwen3-30b-a3b-math") is not None

        def phase() -> str | None:
            job = api.get("GSPOJob", "default", "qwen3-30b-a3b-math") or {}
            return (job.get("status") or {}).get("phase")

        await eventually(
            phase, timeout_s=10, what=f"a status on the job in default (watched: {watched})"
        )
