"""Each learner rank on its own GPU, and every thread that touches CUDA on it too.

No GPU here: torch.cuda is replaced by a spy that keeps the current device per thread, as
CUDA does (a new thread starts on device 0), and records every set_device. The real call
sites run against it: the learner's entry point, the overlapped update's thread, the weight
sync's group set-up and sender threads, and the filesystem sync's writer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from checkout import checkout_env

from gspo_trainer import device
from gspo_trainer.learner import Learner
from gspo_trainer.rollout import client as client_mod
from gspo_trainer.rollout import weight_files, weight_sync
from gspo_trainer.rollout.client import RolloutClient, SyncOptions


class CudaSpy:
    """torch.cuda's device calls, per thread as in CUDA: `gpus` devices, 0 current at first."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.local = threading.local()
        self.calls: list[tuple[str, int]] = []  # (thread name, device) of each set_device

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, dev: Any) -> None:
        index = dev.index if isinstance(dev, torch.device) else int(dev)
        if not 0 <= index < self.gpus:
            raise RuntimeError(f"invalid device ordinal {index}")
        self.local.device = index
        self.calls.append((threading.current_thread().name, index))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> CudaSpy:
    spy = CudaSpy(8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: spy.gpus)
    monkeypatch.setattr(torch.cuda, "set_device", spy.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", spy.current_device)
    device.forget_selection()
    yield spy
    device.forget_selection()


def test_local_rank_3_of_8_selects_gpu_3(cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.select_device() == torch.device("cuda", 3)
    assert cuda.current_device() == 3
    assert device.rank_device() == torch.device("cuda", 3)


@pytest.mark.parametrize(
    ("local_rank", "words"), [("8", ["LOCAL_RANK=8", "sees 8 GPU"]), ("two", ["LOCAL_RANK='two'"])]
)
def test_a_local_rank_beyond_the_gpus_is_refused_naming_both(
    cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch, local_rank: str, words: list[str]
) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(device.DeviceError) as err:
        device.select_device()
    assert all(w in str(err.value) for w in words), err.value


def test_without_cuda_the_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _: pytest.fail("no CUDA call"))
    device.forget_selection()
    try:
        assert device.select_device() == torch.device("cpu")
        assert asyncio.run(device.to_thread(lambda: 7)) == 7
    finally:
        device.forget_selection()


def test_the_learner_process_selects_its_gpu_before_it_runs(
    cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`gspo learner` as rank 3 of a pod: its GPU is current before the learner (and its
    first collective) starts; too few GPUs for its LOCAL_RANK exits 2 naming both."""
    import yaml

    from gspo_trainer import learner_cli
    from gspo_trainer.jobs import tiny_manifest

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(tiny_manifest()))
    seen = []

    async def fake_run(args: Any, spec: Any) -> int:
        seen.append(cuda.current_device())
        return 0

    monkeypatch.setattr(learner_cli, "run", fake_run)
    monkeypatch.setattr("gspo_trainer.preflight.preflight", lambda spec: [])
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert learner_cli.main(["--config", str(config)]) == 0
    assert seen == [3]
    device.forget_selection()
    monkeypatch.setenv("LOCAL_RANK", "9")
    assert learner_cli.main(["--config", str(config)]) == 2


def on_device_in_thread(cuda: CudaSpy) -> tuple[int, bool]:
    """(the calling thread's device, whether it is a thread of its own)."""
    return cuda.current_device(), threading.current_thread() is not threading.main_thread()


def test_the_overlapped_update_thread_works_on_the_ranks_gpu(
    cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    device.select_device()
    learner = SimpleNamespace(spec=SimpleNamespace(algorithm=SimpleNamespace(max_staleness=1)))
    got = asyncio.run(Learner._off_loop(learner, lambda: on_device_in_thread(cuda)))  # type: ignore[arg-type]
    assert got == (3, True)


def test_the_sync_threads_work_on_the_ranks_gpu(
    cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The sync group's set-up, the sender and the filesystem writer: each in a thread, each
    on GPU 3 (rank 0 of a group whose LOCAL_RANK is 3 here, to tell it from the default)."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    device.select_device()
    seen: dict[str, tuple[int, bool]] = {}

    class Sender:
        def __init__(self, group: Any, bucket_mb: float) -> None:
            pass

        def send(self, tensors: Any, version: int) -> Any:
            seen["send"] = on_device_in_thread(cuda)
            return SimpleNamespace(bytes_total=0)

    def open_group(*args: Any, **kwargs: Any) -> Any:
        seen["open_group"] = on_device_in_thread(cuda)
        return SimpleNamespace(close=lambda abort: None)

    def write_version(*args: Any) -> Any:
        seen["write_version"] = on_device_in_thread(cuda)
        return tmp_path / "v1", 0

    async def post(self: Any, url: str, path: str, body: Any, timeout_s: float) -> Any:
        return {"policy_version": 1}

    monkeypatch.setattr(weight_sync, "open_group", open_group)
    monkeypatch.setattr(weight_sync, "connect_store", lambda *a, **k: object())
    monkeypatch.setattr(weight_sync, "WeightSender", Sender)
    monkeypatch.setattr(weight_files, "write_version", write_version)
    monkeypatch.setattr(client_mod.RolloutClient, "_post", post)

    async def sync(method: str) -> None:
        opts = SyncOptions("127.0.0.1", 1, method=method, directory=str(tmp_path))
        client = RolloutClient(["http://a"], sync=opts)
        client.refresh = _no_refresh  # type: ignore[method-assign]
        await client.sync_weights([("w", torch.zeros(2))], 1)

    asyncio.run(sync("broadcast"))
    asyncio.run(sync("filesystem"))
    assert seen == {k: (3, True) for k in ("open_group", "send", "write_version")}


async def _no_refresh(only_down: bool = False) -> None:
    return None


def test_a_checkpoint_keeps_the_random_state_of_this_ranks_gpu_only(
    cuda: CudaSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking for every GPU's random state would open a CUDA context on each of them from
    every rank; a rank keeps and restores its own device's."""
    from gspo_trainer import checkpoint as ckpt

    monkeypatch.setenv("LOCAL_RANK", "3")
    device.select_device()
    asked: list[tuple[str, Any]] = []
    state = torch.zeros(16, dtype=torch.uint8)

    def every_gpu(*args: Any) -> Any:
        pytest.fail("touched every GPU")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda dev="cuda": asked.append(("get", dev)) or state
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, dev="cuda": asked.append(("set", dev))
    )
    saved = ckpt.rng_state()
    ckpt.set_rng_state(saved)
    old_style = {**saved, "cuda": [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]}
    ckpt.set_rng_state(old_style)  # a checkpoint that kept all eight: this rank's is the 4th
    assert asked == [("get", torch.device("cuda", 3))] + [("set", torch.device("cuda", 3))] * 2


def test_a_cpu_learner_compiles_no_deepspeed_op_on_its_first_start(tmp_path: Path) -> None:
    """DeepSpeed's CPU backend would JIT-compile its shared-memory op on a machine's first
    learner start, under a lock file a killed learner leaves behind for every later learner
    to wait on forever; the learner never uses the op, so nothing is compiled at all."""
    probe = (
        "from gspo_trainer.engine import init_distributed\n"
        "import deepspeed.comm.comm as comm\n"
        "init_distributed()\n"
        "print('shm op', comm.cdb.shm_comm_op)\n"
    )
    env = {**checkout_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shm op None" in proc.stdout
    assert not (tmp_path / "ext").exists(), list((tmp_path / "ext").rglob("*"))
