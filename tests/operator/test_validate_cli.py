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
