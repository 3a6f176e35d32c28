"""What a rollout server asks of its vLLM engine, on any engine client (the OpenAI server's
EngineClient, which the gspo endpoint plugin is handed; an AsyncLLM): the worker extension's
methods through `collective_rpc`, the prefix cache dropped after new weights, and a warm-up.
Imports vLLM only inside `warm_up`.
"""

from __future__ import annotations

from typing import Any

WARMUP_PROMPT_TOKENS = 8  # the CPU backend dies on a first forward of <= 4 tokens
WARMUP_SAMPLED_BATCHES = (1, 3)  # two batch sizes: the second compile is the dynamic one
RPC_GRACE_S = 60.0


def rpc_timeout(op_timeout_s: float) -> float:
    """How long to wait on workers whose own operations are each bounded by `op_timeout_s`
    (the store connect and group join, each collective of a broadcast): long enough that a
    worker always answers first. vLLM's executor reads replies in call order, without ids: a
    call it gives up on leaves its reply queued, and the next call (the learner re-forming
    the group after a server died mid-broadcast) would read that stale error as its own.
    vLLM's uniproc executor (a one-core server's, `train.server_env`) ignores the timeout and
    runs the call in the engine's own thread: there the operations' own bounds are all there
    is (weight_sync.wait_bounded, and PeerCancelWatch, which keeps store calls off that
    thread)."""
    return 2 * op_timeout_s + RPC_GRACE_S


async def warm_up(llm: Any) -> None:
    """Generations at start-up that a user's first request would otherwise pay for:
    - a greedy one: the CPU backend's first forward must be a prompt of at least 5 tokens
      (a shorter one kills the worker);
    - two sampled ones with each token's log-prob, as the learner asks (`generate_body`):
      vLLM's sampler torch.compiles `batched_count_greater_than` (vllm/v1/sample/ops/
      logprobs.py) on its first log-prob request and again, with a dynamic batch size, on
      the first one of another batch size. On the 2-core CPU that is about 3 s, which
      otherwise lands in a run's first step while the learner waits; here it overlaps the
      learner's own start."""
    from vllm import SamplingParams as VLLMSamplingParams

    vocab = int(llm.model_config.get_vocab_size())
    prompt = [i % vocab for i in range(3, 3 + WARMUP_PROMPT_TOKENS)]
    warm_ups = [VLLMSamplingParams(n=1, max_tokens=2, temperature=0.0)] + [
        VLLMSamplingParams(n=n, max_tokens=2, temperature=1.0, seed=n, logprobs=0)
        for n in WARMUP_SAMPLED_BATCHES
    ]
    for k, params in enumerate(warm_ups):
        request_id = "gspo-warm-up" if k == 0 else f"gspo-warm-up-{k}"
        async for _ in llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
            pass


async def init_sync_group(llm: Any, **coords: Any) -> int:
    """Every worker joins the learner's weight-sync group; returns how many did."""
    timeout_s = float(coords["timeout_s"])
    results = await llm.collective_rpc(
        "gspo_init_sync_group", timeout=rpc_timeout(timeout_s), kwargs=coords
    )
    return len(results)


async def receive_weights(llm: Any, timeout_s: float) -> dict[str, int]:
    results = await llm.collective_rpc("gspo_receive_weights", timeout=rpc_timeout(timeout_s))
    first = results[0]
    if any(r["version"] != first["version"] for r in results):
        raise RuntimeError(f"workers received different versions: {results}")
    await llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return dict(first)


async def load_weights_file(llm: Any, path: str, timeout_s: float) -> dict[str, int]:
    results = await llm.collective_rpc(
        "gspo_load_weights_file", timeout=rpc_timeout(timeout_s), kwargs={"path": path}
    )
    if any(r != results[0] for r in results):
        raise RuntimeError(f"workers loaded different weights from {path}: {results}")
    await llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return dict(results[0])
