"""DeepSpeed is imported without mlflow (its autotuner's import), by the two processes that
import it first: a learner joining its group, and `gspo train` saving a built-in model; the
`mlflow` tracker still imports mlflow afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import checkout_env

REPORT = """
import json, sys
imported_first = 'deepspeed' in sys.modules  # by the step above, not by this report
import deepspeed.autotuning.autotuner as autotuner
loaded = sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'pandas', 'pyarrow'})
has_mlflow = autotuner.has_mlflow
import mlflow  # the tracker's import, as usual afterwards
print(json.dumps([loaded, has_mlflow, mlflow.__name__, imported_first]))
"""

FIRST_IMPORTS = {
    "a learner joining its group": (
        "from gspo_trainer.engine import init_distributed\ninit_distributed()\n"
    ),
    "a built-in model saved": (
        "import sys\nfrom gspo_trainer.tiny import materialize\n"
        "materialize('builtin:tiny-qwen3-moe', sys.argv[1])\n"
    ),
}


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_deepspeed_comes_without_mlflow_and_mlflow_still_imports(
    tmp_path: Path, first: str
) -> None:
    env = checkout_env(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS[first] + REPORT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, has_mlflow, imported, deepspeed = json.loads(proc.stdout.splitlines()[-1])
    assert deepspeed  # the step imported DeepSpeed: it, not the report, was the first
    assert loaded == [] and has_mlflow is False
    assert imported == "mlflow"
