"""`gspo validate`: exit 0 on valid manifests, one `file: path: message` line per problem."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = (REPO / "examples/gspojob.yaml").read_text()


def test_the_example_validates(gspo) -> None:
    out = gspo("validate", "examples/gspojob.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == ""


def test_problems_name_file_and_field(gspo, tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE)
    doc["spec"]["algorithm"]["groupSize"] = 1
    doc["spec"]["rollout"]["tensorParalel"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    out = gspo("validate", "examples/gspojob.yaml", str(bad))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    # The typo and the cross-field rule at once, though the models stop at the typo.
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{bad}: spec.rollout.tensorParalel: unknown field")
    assert "tensorParallelSize" in lines[0]
    assert lines[1].startswith(f"{bad}: spec.algorithm.groupSize: 1 leaves every response")


def test_cross_field_problem_and_multi_document_file(gspo, tmp_path: Path) -> None:
    good = yaml.safe_load(EXAMPLE)
    bad = yaml.safe_load(EXAMPLE)
    bad["spec"]["algorithm"]["groupSize"] = 1
    bad["kind"] = "Job"
    bad["metadata"]["name"] = "x" * 60
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([good, bad]))
    out = gspo("validate", str(path))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert f"{path}[1]: kind: 'Job' must be 'GSPOJob'" in lines
    assert any(line.startswith(f"{path}[1]: metadata.name: ") for line in lines)
    assert any(line.startswith(f"{path}[1]: spec.algorithm.groupSize: ") for line in lines)
    assert not any(line.startswith(f"{path}[0]") for line in lines)


def test_unreadable_file(gspo, tmp_path: Path) -> None:
    out = gspo("validate", str(tmp_path / "missing.yaml"))
    assert out.returncode == 1
    assert out.stdout == f"{tmp_path / 'missing.yaml'}: no such file\n"


# Refused with one learner pod and one server (the CRD's CEL rules too: test_crd_cel.py).
BAD_JOB_NAMES = ("1run", "Run", "run-", "run.a", "x" * 51)


def test_names_that_cannot_name_services_are_refused() -> None:
    from gspo_operator.names import check_job_name

    assert check_job_name("qwen3-run-1") is None
    for bad in BAD_JOB_NAMES:
        assert check_job_name(bad), bad


def test_other_kinds_beside_the_job_are_left_to_kubectl(gspo, tmp_path: Path) -> None:
    """A file may carry the claim or Secret a job needs (examples/local-cluster.yaml does)."""
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
             "spec": {"accessModes": ["ReadWriteOnce"]}}  # fmt: skip
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([claim, yaml.safe_load(EXAMPLE)]))
    out = gspo("validate", str(both))
    assert out.returncode == 0, out.stdout + out.stderr
    rendered = gspo("render", str(both))
    assert rendered.returncode == 0, rendered.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered.stdout)]
    assert "JobSet" in kinds and "PersistentVolumeClaim" in kinds  # the job's own claim only
    assert len([k for k in kinds if k == "PersistentVolumeClaim"]) == 1
    alone = tmp_path / "claim.yaml"
    alone.write_text(yaml.safe_dump(claim))
    out = gspo("validate", str(alone))
    assert out.returncode == 1 and "no GSPOJob" in out.stdout


# --- the memory plan ------------------------------------------------------------------------
def _example_with(tmp_path: Path, name: str = "one-gpu.yaml", **learner: object) -> Path:
    doc = yaml.safe_load(EXAMPLE)
    doc["spec"]["learner"].update(learner)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_example_prints_its_memory_plan(gspo) -> None:
    out = gspo("validate", "examples/gspojob.yaml")
    assert out.returncode == 0 and out.stdout == ""
    assert "examples/gspojob.yaml: memory plan, per GPU: NVIDIA H100 80GB: 80 GiB" in out.stderr
    assert "learner: 16 GPUs (2 x 8), ZeRO-3, bfloat16" in out.stderr
    assert "rollout: 4 servers x tensor parallel 2" in out.stderr
    assert "DOES NOT FIT" not in out.stderr


def test_the_example_on_one_learner_gpu_is_refused(gspo, tmp_path: Path) -> None:
    path = _example_with(tmp_path, replicas=1, gpusPerReplica=1)
    out = gspo("validate", str(path))
    assert out.returncode == 1
    [line] = out.stdout.splitlines()
    assert line.startswith(f"{path}: spec.learner: the learner needs ")
    assert "per GPU and the GPU has 80.0 GiB" in line
    assert "learner.replicas: 16 (16 GPUs)" in line and "learner.offloadOptimizer: true" in line
    assert "DOES NOT FIT" in out.stderr  # the table shows where the memory goes
    allowed = gspo("validate", "--allow-overcommit", str(path))
    assert allowed.returncode == 0 and allowed.stdout == ""
    assert f"{path}: warning: spec.learner: the learner needs " in allowed.stderr
    roomy = gspo("validate", "--gpu-memory", "600", str(path))
    assert roomy.returncode == 0, roomy.stdout


def test_the_annotation_allows_an_overcommit(gspo, tmp_path: Path) -> None:
    doc = yaml.safe_load(_example_with(tmp_path, replicas=1, gpusPerReplica=1).read_text())
    doc["metadata"]["annotations"] = {"gspo.dev/allow-overcommit": "true"}
    path = tmp_path / "annotated.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = gspo("validate", str(path))
    assert out.returncode == 0 and "warning: spec.learner" in out.stderr


def test_a_model_with_no_config_here_skips_the_plan(gspo, tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE)
    doc["spec"]["model"]["name"] = "org/not-cached-anywhere"
    path = tmp_path / "unknown.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = gspo("validate", str(path))
    assert out.returncode == 0 and out.stdout == ""
    assert (
        "warning: memory plan skipped: no config.json for 'org/not-cached-anywhere'" in out.stderr
    )
