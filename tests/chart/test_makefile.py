"""What each make target needs: `make train` only Python and make (the test tools, helm from
npm and promtool/nft through apt-get, are built for the test targets alone), and `make images`
builds the three images with the names the chart and a GSPOJob use by default. Read with
`make -n` (what make would run), from a scratch venv and tools folder so nothing counts as built.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from checkout import REPO

from gspo_api.spec import LearnerConfig, RolloutConfig

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
TOOL_BUILDERS = ("npm ", "apt-get", "dpkg")


def planned(tmp_path: Path, *args: str) -> str:
    """The commands `make -n ARGS` prints for a checkout with no venv and no tools yet."""
    scratch = [f"VENV={tmp_path / 'venv'}", f"TOOLS={tmp_path / 'tools'}"]
    result = subprocess.run(
        ["make", "-n", "-C", str(REPO), *scratch, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_train_builds_no_test_tool(tmp_path: Path) -> None:
    train = planned(tmp_path, "train")
    assert "gspo train" in train
    assert not [t for t in TOOL_BUILDERS if t in train], train
    assert all(t in planned(tmp_path, "test") for t in TOOL_BUILDERS)


def test_make_images_builds_the_images_the_chart_and_a_job_name(tmp_path: Path) -> None:
    chart = yaml.safe_load((REPO / "charts/gspo-operator/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/gspo-operator/values.yaml").read_text())
    operator_image = f"{values['image']['repository']}:{chart['appVersion']}"
    defaults = {
        "operator": operator_image,
        "learner": LearnerConfig.model_fields["image"].default,
        "rollout": RolloutConfig.model_fields["image"].default,
    }
    builds = planned(tmp_path, "push-images").splitlines()
    for image, tag in defaults.items():
        assert f"docker build -f docker/{image}.Dockerfile -t {tag} ." in builds, builds
        assert builds.index(f"docker push {tag}") > builds.index(
            f"docker build -f docker/{image}.Dockerfile -t {tag} ."
        )
    custom = planned(tmp_path, "images", "REGISTRY=registry.example.com/ml", "TAG=1.2")
    assert "-t registry.example.com/ml/gspo-learner:1.2 ." in custom
    assert not [t for t in (*TOOL_BUILDERS, "pip ") if t in custom], custom
