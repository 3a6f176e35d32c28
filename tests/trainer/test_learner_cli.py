"""`gspo learner` config loading, the embedded default's manifest, and rollout discovery."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from checkout import REPO

from gspo_api.ports import free_port
from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import SpecError
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.learner_cli import load_spec, main
from gspo_trainer.rollout.client import RolloutClient
from gspo_trainer.rollout.discovery import FleetDiscovery, resolve_urls


def test_examples_tiny_yaml_is_the_embedded_default() -> None:
    on_disk = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    assert on_disk == tiny_manifest()


def test_config_may_be_a_manifest_or_a_bare_spec(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(tiny_manifest()))
    bare = tmp_path / "spec.yaml"
    bare.write_text(yaml.safe_dump(tiny_manifest()["spec"]))
    assert load_spec(manifest) == load_spec(bare)
    written = tiny_manifest()["spec"]["algorithm"]["learningRate"]
    assert written != GSPOJobSpec.model_fields["algorithm"].default_factory().learning_rate
    assert load_spec(bare).algorithm.learning_rate == written  # the file's, not the default


def test_a_bad_config_exits_2_naming_the_field(tmp_path: Path, capsys) -> None:
    spec = tiny_manifest()["spec"]
    spec["algorithm"]["groupSize"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError):
        load_spec(path)
    assert main(["--config", str(path)]) == 2
    assert "spec.algorithm.groupSize" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2


def test_a_config_of_broken_yaml_exits_2_naming_the_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec:\n  algorithm: {groupSize: 4\n  model: x\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML at line" in err and "Traceback" not in err
    path.write_text("- just\n- a list\n")
    assert main(["--config", str(path)]) == 2
    assert "not a GSPOJob manifest" in capsys.readouterr().err


def test_dns_entries_resolve_to_one_url_per_address() -> None:
    table = {"rollout.ns.svc": ["10.0.0.7", "10.0.0.3"], "v6": ["fd00::1"]}

    def resolver(host: str, port: int) -> list[str]:
        return sorted(table[host])

    urls = resolve_urls("dns+http://rollout.ns.svc:8000, http://fixed:9000/", resolver)
    assert urls == ["http://10.0.0.3:8000", "http://10.0.0.7:8000", "http://fixed:9000"]
    assert resolve_urls("dns+http://v6:8000", resolver) == ["http://[fd00::1]:8000"]


def test_discovery_adds_new_servers_and_drops_gone_ones() -> None:
    addresses = ["127.0.0.1"]

    def resolver(host: str, port: int) -> list[str]:
        return list(addresses)

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        start = resolve_urls("dns+http://rollout:1", resolver)
        async with RolloutClient(start, "t", probe_timeout_s=1) as client:
            fleet = FleetDiscovery(client, "dns+http://rollout:1", resolver)
            unchanged = await fleet.discover()
            addresses[:] = ["127.0.0.2"]
            added = await fleet.discover()
            return unchanged, added, sorted(client.servers)

    unchanged, added, now = asyncio.run(scenario())
    assert unchanged == []
    assert added == ["http://127.0.0.2:1"]
    assert now == ["http://127.0.0.2:1"]


def test_sigterm_reaches_a_rank_that_never_yields_to_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks other than 0 train without awaiting anything (no rollout HTTP), so a stop
    request handed to the event loop would wait for the end of training; an evicted rank 1
    must see it at its next step boundary, like rank 0, to write its final checkpoint."""
    import os
    import signal
    import threading
    import time

    import gspo_trainer.learner as learner_module
    from gspo_trainer.learner_cli import parse_args, run
    from gspo_trainer.learner_state import LearnerState

    class BusyLearner:  # steps in the main thread, never awaiting
        def __init__(self, *_: object, **__: object) -> None:
            self.state = LearnerState()

        @classmethod
        def build(cls, *a: object, **kw: object) -> BusyLearner:
            return cls(*a, **kw)

        async def run(self) -> int:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if self.state.stop_requested:
                    self.state.phase = "Suspending"
                    return 0
                time.sleep(0.01)  # a training step's worth of blocking work
            return 1  # the stop never arrived

    monkeypatch.setattr(learner_module, "Learner", BusyLearner)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # a rank under torch.distributed.run
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        args = parse_args(["--checkpoint-dir", str(tmp_path)])
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        spec = GSPOJobSpec.model_validate(tiny_manifest()["spec"])
        started = time.monotonic()
        assert asyncio.run(run(args, spec)) == 0
        assert time.monotonic() - started < 10
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


async def test_the_pod_is_ready_while_the_learner_still_loads(tmp_path: Path, monkeypatch) -> None:
    """Kueue's WaitForPodsReady evicts a job whose pods are not all Ready within its timeout
    (5 minutes by default); a large model loads for longer. /healthz (the learner's readiness
    probe) answers from the start, and rank 0's /progress says "Starting" meanwhile."""
    import json
    import urllib.request

    from gspo_api.progress import LearnerProgress
    from gspo_trainer import learner, learner_cli

    port = free_port()
    seen: dict[str, object] = {}

    class Loading:
        """Stands in for Learner: its constructor is where the model loads."""

        def __init__(self, *_: object, **__: object) -> None:
            base = f"http://127.0.0.1:{port}"
            with urllib.request.urlopen(base + "/healthz", timeout=5) as resp:
                seen["healthz"] = resp.status
            with urllib.request.urlopen(base + "/progress", timeout=5) as resp:
                seen["phase"] = json.loads(resp.read())["phase"]
            self.state = type("State", (), {"phase": "Succeeded", "stop_requested": False})()

        @classmethod
        def build(cls, *a: object, **kw: object) -> Loading:
            return cls(*a, **kw)

        async def run(self) -> int:
            return 0

        def progress(self) -> LearnerProgress:
            return LearnerProgress()

    monkeypatch.setattr(learner, "Learner", Loading)
    monkeypatch.setenv("RANK", "0")
    spec = tiny_manifest()["spec"]
    spec["metrics"] = {"port": port}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    flags = {
        "--config": path,
        "--checkpoint-dir": tmp_path,
        "--metrics-host": "127.0.0.1",
        "--rollout-urls": "http://127.0.0.1:1",
    }
    args = learner_cli.parse_args([str(x) for kv in flags.items() for x in kv])
    assert await learner_cli.run(args, load_spec(path)) == 0
    assert seen == {"healthz": 200, "phase": "Starting"}


def test_a_config_error_found_while_running_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found after preflight (prompts too long for the model once tokenized, a row the
    learner reads later): the code JobSet's failure policy does not retry, not 1."""
    from gspo_api.validation import ConfigError
    from gspo_trainer import learner_cli

    async def refuses(args, spec):  # type: ignore[no-untyped-def]
        raise ConfigError("data.source: all 3 prompts are longer than data.maxPromptTokens=8")

    monkeypatch.setattr(learner_cli, "run", refuses)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest()))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gspo learner: data.source: all 3 prompts are longer than data.maxPromptTokens=8"


def test_a_rank_that_refuses_its_config_makes_its_group_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.distributed.run turns a rank's exit 2 into 1; the rank's message, left in the
    file the launcher names, makes the launcher exit 2 with it."""
    import sys

    from gspo_api import ports
    from gspo_trainer import learner_cli

    rank = (
        "import os, sys; os.environ['TORCHELASTIC_RUN_ID'] = 'x'; "
        "from gspo_trainer.learner_cli import refuse; "
        "refuse(\"data.source 'd.jsonl' row 3 is 5, not an object\"); sys.exit(1)"
    )
    from checkout import checkout_env

    monkeypatch.setenv("PYTHONPATH", checkout_env()["PYTHONPATH"])  # this checkout's code
    monkeypatch.setattr(learner_cli, "group_command", lambda argv: [sys.executable, "-c", rank])
    assert learner_cli.launch_group([]) == ports.INVALID_CONFIG_EXIT_CODE == 2
    assert capsys.readouterr().err.strip().endswith("row 3 is 5, not an object")
