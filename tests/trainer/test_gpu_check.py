"""bench/gpu_check.py --dry-run: the GPU check's code runs on this CPU at toy size, every
section, so it is ready (not rotten) the day a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from checkout import checkout_env

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_passes_every_section() -> None:
    env = checkout_env()
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(proc.stdout)
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-2000:])
    assert report["pytest_gpu"]["returncode"] == 0
    loss = report["fused_loss"]
    assert abs(loss["loss"] - loss["loss_reference"]) < 1e-2
    assert loss["grad_weight_max_rel_error"] < 2e-2 and loss["grad_hidden_max_rel_error"] < 2e-2
    for kind in ("update_dense", "update_moe"):
        assert report[kind]["zero3_trace"] == "COMPLETE"
        assert report[kind]["micro_batches"] > 1 and report[kind]["mfu"] > 0
    assert report["update_moe"]["experts"] and report["update_dense"]["attention"] == "sdpa"
    ckpt = report["checkpoint"]
    assert ckpt["update_moved_weights"] and ckpt["resume_bit_exact"]
    assert report["sync_moe"]["bytes"] > 0 and report["sync_moe"]["gb_per_s"] > 0
