"""Which Adam DeepSpeed builds for each learner setting: DeepSpeedCPUAdam when the optimizer
is offloaded on GPUs (torch's Adam would step the fp32 state on one CPU thread), torch's
AdamW everywhere else (no kernel compiled at start-up). Checked with DeepSpeed's own choice
(DeepSpeedEngine.get_optimizer_configuration) on the config the learner builds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gspo_api.validation import parse_spec
from gspo_trainer.engine import ds_config, reference_ds_config
from gspo_trainer.jobs import tiny_manifest


def spec_with(stage: int, offload: bool, **algorithm: Any) -> Any:
    raw = tiny_manifest()["spec"]
    raw["learner"].update(zeroStage=stage, offloadOptimizer=offload)
    raw["algorithm"].update(algorithm)
    return parse_spec(raw)


def deepspeed_optimizer(cfg: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The optimizer class DeepSpeed's engine takes for `cfg` (its own selection code), and
    the keyword arguments it builds it with."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = SimpleNamespace(
        zero_use_cpu_optimizer=lambda: "offload_optimizer" in cfg["zero_optimization"],
        bf16_optimizer_states=lambda: False,
        zenflow=False,
    )
    assert cfg["optimizer"]["type"].lower() == "adamw"
    params = dict(cfg["optimizer"]["params"])
    cls, extra = DeepSpeedEngine.get_optimizer_configuration(engine, params, True)  # type: ignore[arg-type]
    return cls, {**params, **extra}


def deepspeed_builds(cfg: dict[str, Any]) -> type:
    return deepspeed_optimizer(cfg)[0]


@pytest.mark.parametrize(
    ("gpu", "stage", "offload", "expected"),
    [
        (True, 3, True, "DeepSpeedCPUAdam"),
        (True, 2, True, "DeepSpeedCPUAdam"),
        (True, 3, False, "AdamW"),  # on the GPU: torch's multi-tensor AdamW, nothing compiled
        (True, 0, True, "AdamW"),  # stage 0 offloads nothing
        (False, 3, True, "AdamW"),  # CPU-only: torch's, no C++ op compiled
        (False, 1, False, "AdamW"),
    ],
)
def test_the_adam_deepspeed_builds(gpu: bool, stage: int, offload: bool, expected: str) -> None:
    cfg = ds_config(spec_with(stage, offload), gpu=gpu)
    cls = deepspeed_builds(cfg)
    assert cls.__name__ == expected
    if expected == "AdamW":
        assert cls is torch.optim.AdamW
    params = cfg["optimizer"]["params"]
    assert params["lr"] == spec_with(stage, offload).algorithm.learning_rate
    assert "offload_optimizer" in cfg["zero_optimization"] or expected == "AdamW"


def test_the_reference_engine_has_no_optimizer() -> None:
    assert "optimizer" not in reference_ds_config(spec_with(3, True))


def test_adam_betas_reach_the_optimizer_deepspeed_builds() -> None:
    """algorithm.adamBeta1/adamBeta2 are the betas of the AdamW DeepSpeed builds (defaults:
    torch's), built here from DeepSpeed's own class and keyword arguments."""
    cases = (({}, (0.9, 0.999)), ({"adamBeta1": 0.8, "adamBeta2": 0.95}, (0.8, 0.95)))
    for algorithm, betas in cases:
        cls, kwargs = deepspeed_optimizer(ds_config(spec_with(1, False, **algorithm), gpu=False))
        optimizer = cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)
        assert tuple(optimizer.param_groups[0]["betas"]) == betas
