"""Bucketing and the header: pure functions, plus one real two-process gloo broadcast."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from gspo_api.ports import free_port
from gspo_trainer.rollout import weight_sync as ws


def _named(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, dtype) in shapes.items():
        out[name] = (torch.randn(shape, generator=gen) * 10).to(dtype)
    return out


def _round_trip(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[ws.Bucket]:
    metas = [
        (n, tuple(t.shape), str(t.dtype)[6:], t.numel() * t.element_size())
        for n, t in tensors.items()
    ]
    buckets = ws.plan_buckets(metas, bucket_bytes)
    decoded = list(ws.decode_layout(ws.encode_layout(buckets)))
    assert decoded == buckets
    seen = {}
    send = ws.SendBuffers(decoded, "cpu")
    stream = iter(tensors.items())  # read in order, as the sender reads its source
    for k, bucket in enumerate(decoded):
        seen.update(
            (n, t.clone()) for n, t in ws.unflatten_bucket(bucket, send.fill(k, bucket, stream))
        )
    assert next(stream, None) is None
    assert list(seen) == list(tensors)
    for name, t in tensors.items():
        assert seen[name].dtype == t.dtype and seen[name].shape == t.shape
        assert torch.equal(seen[name], t)
    return buckets


def test_round_trip_mixed_dtypes_and_shapes() -> None:
    tensors = _named(
        {
            "a": ((3, 5), torch.float32),
            "b": ((7,), torch.bfloat16),
            "c": ((), torch.float16),
            "d": ((2, 3, 4), torch.int64),
            "e": ((0,), torch.float32),
            "f": ((9,), torch.uint8),
        }
    )
    _round_trip(tensors, bucket_bytes=128)
    _round_trip(tensors, bucket_bytes=1 << 20)


def test_bucket_boundaries_respect_size_and_alignment() -> None:
    tensors = _named({f"w{i}": ((10,), torch.float32) for i in range(10)})  # 40 bytes each
    buckets = _round_trip(tensors, bucket_bytes=128)
    # offsets 0 and 64 fit (64 + 40 = 104 <= 128); a third would start at 128 and overflow
    assert [len(b.tensors) for b in buckets] == [2, 2, 2, 2, 2]
    for b in buckets:
        assert b.nbytes <= 128
        assert all(m.offset % ws.ALIGN_BYTES == 0 for m in b.tensors)


def test_tensor_larger_than_a_bucket_gets_its_own() -> None:
    tensors = _named(
        {
            "small": ((4,), torch.float32),
            "big": ((100,), torch.float32),
            "tail": ((4,), torch.float32),
        }
    )
    buckets = _round_trip(tensors, bucket_bytes=64)
    assert [[m.name for m in b.tensors] for b in buckets] == [["small"], ["big"], ["tail"]]
    assert buckets[1].nbytes == 400


def test_header_rejects_other_format() -> None:
    raw = ws.encode_layout([]).replace(b'"format":1', b'"format":99')
    with pytest.raises(ValueError, match="different versions"):
        ws.decode_layout(raw)


def test_bad_bucket_size_is_named() -> None:
    with pytest.raises(ValueError, match="bucket size"):
        ws.plan_buckets([("a", (1,), "float32", 4)], 0)


def _receiver(port: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    from safetensors.torch import save

    store = ws.connect_store("127.0.0.1", port, is_master=False, timeout_s=30)
    group = ws.open_group(store, "t", 1, 2, timeout_s=30)
    for _ in range(2):  # the second update reuses the cached layout on both sides
        version, stream = ws.receive_weights(group)
        # plain bytes: a tensor sent through the queue would be shared by file descriptor,
        # which dies with this process before the parent reads the second update
        queue.put((version, save({n: t.clone() for n, t in stream})))


def _received(queue: mp.Queue) -> tuple[int, dict[str, torch.Tensor]]:  # type: ignore[type-arg]
    from safetensors.torch import load

    version, raw = queue.get(timeout=60)
    return version, load(raw)


def test_sender_to_receiver_over_gloo() -> None:
    tensors = _named({f"layer{i}.w": ((i + 1, 33), torch.float32) for i in range(20)})
    tensors["emb"] = torch.arange(1000, dtype=torch.bfloat16).reshape(10, 100)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, queue))
    proc.start()
    try:
        store = ws.connect_store("127.0.0.1", port, is_master=True, timeout_s=30)
        group = ws.open_group(store, "t", 0, 2, timeout_s=30)
        sender = ws.WeightSender(group, bucket_mb=0.01)
        stats = sender.send(tensors.items(), version=3)
        version, got = _received(queue)
        updated = {n: t * 2 for n, t in tensors.items()}
        sender.send(updated.items(), version=4)
        version2, got2 = _received(queue)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert version == 3 and stats.buckets > 1 and stats.tensors == 21
    assert stats.bytes_total == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    assert version2 == 4
    for name, t in updated.items():
        assert torch.equal(got2[name], t), name


def test_checkpoint_names_match_a_saved_moe_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    from gspo_trainer.tiny import build_tiny_model

    model, _ = build_tiny_model("builtin:tiny-qwen3-moe", seed=3)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    converted = dict(ws.checkpoint_named_tensors(model.named_parameters()))
    assert set(converted) == set(saved)
    for name, t in saved.items():
        assert torch.equal(converted[name], t), name
