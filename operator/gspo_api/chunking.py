"""How many tokens the fused log-prob/loss scores at once on a device: pure arithmetic,
without torch, so the memory plan (which the operator runs) sizes the same chunk the learner
takes."""

from __future__ import annotations

# Tokens per chunk on a CPU. At vocab 32k a float32 chunk is 31 MiB; see BENCHMARKS.md for
# the trade. A GPU takes thousands (`chunk_tokens`).
DEFAULT_CHUNK_TOKENS = 256
# On a GPU a chunk holds about 10 bytes per (token, vocabulary entry) at once (its float32
# logits, kept for the gradient, the float32 probabilities made from them, their bf16 copy
# for the matmuls); the chunk takes up to this share of the device's memory.
GPU_CHUNK_MEMORY_SHARE = 1 / 16
GPU_CHUNK_BYTES_PER_LOGIT = 10
GPU_CHUNK_TOKENS = (1024, 16384)  # the range a GPU's chunk stays in, multiples of 256


def chunk_tokens(device_type: str, vocab: int, device_memory_bytes: int = 0) -> int:
    """Tokens per chunk for a device: DEFAULT_CHUNK_TOKENS on a CPU (its matmuls are as fast
    in small blocks, and memory is what it lacks); on a GPU as many as keep a chunk's
    temporaries within GPU_CHUNK_MEMORY_SHARE of the device's memory, a multiple of 256
    within GPU_CHUNK_TOKENS: a big matmul keeps the GPU busy where 256 tokens leave it
    waiting on launches, and a response within one chunk is never recomputed (fused_loss).
    An 80 GB H100 with Qwen3's 151,936-token vocabulary: 3,328 tokens."""
    if device_type == "cpu" or device_memory_bytes <= 0:
        return DEFAULT_CHUNK_TOKENS
    fit = int(device_memory_bytes * GPU_CHUNK_MEMORY_SHARE) // (GPU_CHUNK_BYTES_PER_LOGIT * vocab)
    low, high = GPU_CHUNK_TOKENS
    return max(low, min(high, fit // 256 * 256))
