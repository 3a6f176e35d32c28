"""Build a real Learner on the tiny MoE with the in-process rollout source (tests only)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

from gspo_api.validation import parse_spec
from gspo_trainer.engine import load_model, resolve_model_path
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.learner import Learner
from gspo_trainer.rollout.local import LocalRollout


def tiny_spec(**algorithm: Any) -> Any:
    """The embedded default with `algorithm` overrides, in a smaller step: the width-64 model
    (builtin:tiny-qwen3-moe) at its lr, 3e-4, and groups of 8 (16 x 8 responses; the
    default's wider model and groups of 16 learn faster but cost three times the time per
    step, which these tests do not need). Evaluation is off unless asked for
    (evalEverySteps): these tests are about training, and an evaluation would add its own
    generations and reward calls to what they count. Collection is synchronous
    (maxStaleness 0, where the embedded default runs one step ahead) unless asked for: these
    tests compare runs step for step, resumed against straight through, which holds exactly
    only when every step samples with the weights it updates."""
    manifest = copy.deepcopy(tiny_manifest())
    manifest["spec"]["model"]["name"] = "builtin:tiny-qwen3-moe"
    manifest["spec"]["algorithm"].update(
        {"evalEverySteps": 0, "groupSize": 8, "learningRate": 3e-4, "maxStaleness": 0, **algorithm}
    )
    return manifest


def staged_spec(stage: int) -> Any:
    """The tiny MoE's spec under learner.zeroStage `stage` (for tests of the engine itself)."""
    manifest = copy.deepcopy(tiny_manifest())
    manifest["spec"]["model"]["name"] = "builtin:tiny-qwen3-moe"
    manifest["spec"]["learner"]["zeroStage"] = stage
    return parse_spec(manifest["spec"])


def make_learner(cache: Path, ckpt: Path | None, manifest: dict[str, Any] | None = None,
                 **kw: Any) -> Learner:  # fmt: skip
    spec = parse_spec((manifest or tiny_spec())["spec"])
    path = resolve_model_path(spec, str(cache))
    model, tok = load_model(spec, path)
    rollout = LocalRollout(model, tok.pad_token_id, tok.eos_token_id)
    return Learner.build(spec, rollout, checkpoint_dir=ckpt, model_path=path, **kw)


def run(learner: Learner) -> int:
    return asyncio.run(learner.run())


def params(learner: Learner) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}


class WrappedFleet:
    """A test's wrapper around a rollout source (`inner`) that changes generate or
    sync_weights: the rest of the learner's RolloutSource goes to `inner` unchanged."""

    inner: Any

    async def fleet_state(self) -> tuple[int, int]:
        return await self.inner.fleet_state()  # type: ignore[no-any-return]

    def server_versions(self) -> dict[str, int | None]:
        return self.inner.server_versions()  # type: ignore[no-any-return]

    async def discover(self) -> list[str]:
        return await self.inner.discover()  # type: ignore[no-any-return]
