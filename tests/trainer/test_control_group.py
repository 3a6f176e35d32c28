"""The learner's control collectives outlast rank 0 working alone; checkpoints are hashed by
the ranks that write them and verified, on resume, by the rank that owns each file.

The default group here is gloo with a 1-second timeout, standing in for NCCL's watchdog
under DeepSpeed's default (10 minutes, deepspeed/constants.py default_pg_timeout): rank 1
waits in a control collective while rank 0 works for longer than that, as it does while it
generates, scores, evaluates or commits a checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from gspo_api.ports import free_port
from gspo_api.validation import parse_spec
from gspo_trainer import checkpoint as ckpt
from gspo_trainer.jobs import tiny_manifest
from gspo_trainer.ranks import Ranks, control_timeout_s, data_timeout_s

DEFAULT_TIMEOUT_S = 1.0
RANK0_ALONE_S = 2.5  # longer than the default group's timeout


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
    )
    ranks = Ranks(control_timeout_s=60)
    ranks.barrier()
    if rank == 0:
        time.sleep(RANK0_ALONE_S)  # rank 0 alone (collecting, committing a checkpoint)
    agreed = ranks.any(rank == 0)
    got = ranks.broadcast({"step": 7} if rank == 0 else None)
    parts = ranks.gather({f"f{rank}": rank})
    if rank == 0:
        Path(out).write_text(json.dumps({"agreed": agreed, "got": got, "parts": parts}))
    ranks.barrier()
    os._exit(0)  # gloo's threads and interpreter teardown: see engine.exit_rank


def test_a_rank_waits_on_the_control_group_longer_than_the_default_timeout(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.json"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.loads(out.read_text()) == {
        "agreed": True,
        "got": {"step": 7},
        "parts": [{"f0": 0}, {"f1": 1}],
    }


def test_the_timeouts_follow_the_spec() -> None:
    raw = tiny_manifest()["spec"]
    spec = parse_spec(raw)
    raw["weightSync"] = {**raw.get("weightSync", {}), "timeoutSeconds": 3000}
    raw["rollout"]["requestTimeoutSeconds"] = 2000
    longer = parse_spec(raw)
    assert spec.weight_sync.timeout_seconds == 600 and spec.rollout.request_timeout_seconds == 900
    assert control_timeout_s(spec) > 3600  # the startup wait alone is 30 minutes
    assert control_timeout_s(longer) - control_timeout_s(spec) == 6 * 2400 + 2 * 1100
    assert data_timeout_s(spec) >= 600 and data_timeout_s(longer) > 3000


# --- the manifest from the ranks' own hashes ------------------------------------------------


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def test_the_manifest_is_built_from_each_ranks_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank hashes what it wrote; rank 0's commit hashes only what no rank listed (a
    file DeepSpeed copies in itself), and on resume each rank verifies its own files."""
    tmp = ckpt.aside(tmp_path, 5)
    _write(
        tmp,
        {
            "engine/zero_pp_rank_0_model_states.pt": b"a" * 100,
            "trainer-rank0.pt": b"b" * 10,
            "engine/zero_pp_rank_1_model_states.pt": b"c" * 200,
            "trainer-rank1.pt": b"d" * 20,
            "engine/zero_to_fp32.py": b"#",
        },
    )
    rank0 = ckpt.hash_files(tmp, ["engine/zero_pp_rank_0_model_states.pt", "trainer-rank0.pt"], 0)
    rank1 = ckpt.hash_files(tmp, ["engine/zero_pp_rank_1_model_states.pt", "trainer-rank1.pt"], 1)
    hashed_at_commit = []
    real_sha = ckpt.sha256_file
    monkeypatch.setattr(
        ckpt, "sha256_file", lambda p: hashed_at_commit.append(p.name) or real_sha(p)
    )
    final = ckpt.commit(tmp_path, 5, keep=2, hashed={**rank0, **rank1})
    assert hashed_at_commit == ["zero_to_fp32.py"]
    files = json.loads((final / ckpt.MANIFEST).read_text())["files"]
    assert {rel: e["rank"] for rel, e in files.items()} == {
        "engine/zero_pp_rank_0_model_states.pt": 0,
        "trainer-rank0.pt": 0,
        "engine/zero_pp_rank_1_model_states.pt": 1,
        "trainer-rank1.pt": 1,
        "engine/zero_to_fp32.py": 0,
    }
    assert files["trainer-rank1.pt"]["sha256"] == rank1["trainer-rank1.pt"]["sha256"]
    # Rank 1's file damaged: rank 1 finds it, rank 0 (checking only its own) does not.
    (final / "trainer-rank1.pt").write_bytes(b"x" * 20)
    assert ckpt.verify(final, rank=1, world=2) == ["trainer-rank1.pt"]
    assert ckpt.verify(final, rank=0, world=2) == []
    assert ckpt.verify(final) == ["trainer-rank1.pt"]  # one process checks everything
    # Resumed by one rank only: it owns every file.
    assert ckpt.verify(final, rank=0, world=1) == ["trainer-rank1.pt"]


def test_a_file_a_rank_listed_but_that_is_gone_fails_the_commit(tmp_path: Path) -> None:
    tmp = ckpt.aside(tmp_path, 1)
    _write(tmp, {"trainer-rank0.pt": b"a"})
    listed = {"trainer-rank1.pt": {"bytes": 1, "sha256": "0", "rank": 1}}
    with pytest.raises(FileNotFoundError, match=r"trainer-rank1\.pt"):
        ckpt.commit(tmp_path, 1, keep=1, hashed=listed)
