"""The real kubectl, pointed at the API stand-in: what a user types, with a transcript."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
NS = "default"


def write_kubeconfig(url: str, path: Path, namespace: str = NS) -> Path:
    """A kubeconfig for the API stand-in at `url`: no auth, `namespace` by default."""
    context = {"cluster": "stand-in", "user": "user", "namespace": namespace}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "user", "user": {}}],
        "contexts": [{"name": "stand-in", "context": context}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Kubectl:
    def __init__(self, url: str, home: Path) -> None:
        self.config = write_kubeconfig(url, home / "kubeconfig")
        self.transcript: list[str] = []

    async def __call__(self, *args: str, ok: bool = True, timeout_s: float = 60) -> str:
        env = {**os.environ, "KUBECONFIG": str(self.config), "HOME": str(self.config.parent)}
        proc = await asyncio.create_subprocess_exec(
            KUBECTL,
            *args,
            env=env,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        text = out.decode()
        self.transcript.append(f"$ kubectl {' '.join(args)}\n{text}")
        if ok:
            assert proc.returncode == 0, text
        return text
