"""The environment `gspo train` gives its servers and learner: Hub access as on a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_operator.render import render_job
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.train import process_env
from gspo_trainer.validation import parse_spec


def spec_with(name: str, offline: bool = False):  # type: ignore[no-untyped-def]
    manifest = tiny_manifest()
    manifest["spec"]["model"].update(name=name, offline=offline)
    return parse_spec(manifest["spec"])


@pytest.mark.parametrize(
    ("name", "offline", "expected"),
    [
        ("builtin:small-qwen3-moe", False, "1"),  # built on the spot: nothing to download
        ("Qwen/Qwen3-0.6B", False, None),  # a Hub model downloads, as transformers would
        ("Qwen/Qwen3-0.6B", True, "1"),  # unless the job says offline
    ],
)
def test_hub_access_follows_the_model(name: str, offline: bool, expected: str | None) -> None:
    env = process_env(spec_with(name, offline), {"PATH": "/bin", "RANK": "3"}, Path("/c"), "t")
    assert env.get("HF_HUB_OFFLINE") == expected
    assert env["PATH"] == "/bin" and "RANK" not in env  # the caller's, less its own group


def test_the_same_rule_as_the_pods_on_a_cluster() -> None:
    for name, offline in (("builtin:tiny-qwen3", False), ("Qwen/Qwen3-0.6B", False),
                          ("Qwen/Qwen3-0.6B", True)):  # fmt: skip
        spec = spec_with(name, offline)
        local = process_env(spec, {}, Path("/c"), "t").get("HF_HUB_OFFLINE")
        job = {"metadata": {"name": "env", "namespace": "ml", "uid": "u"}}
        objects = render_job(job, spec, token="t")
        envs = [e for e in _env_vars(objects) if e.get("name") == "HF_HUB_OFFLINE"]
        assert (local == "1") == bool(envs), name


def _env_vars(node: object) -> list[dict]:
    """Every container env entry anywhere in the rendered objects."""
    found: list[dict] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                found += [e for e in value if isinstance(e, dict)]
            else:
                found += _env_vars(value)
    elif isinstance(node, list):
        for item in node:
            found += _env_vars(item)
    return found
