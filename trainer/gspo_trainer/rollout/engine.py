"""The vLLM engine behind a rollout server: a thin adapter over `AsyncLLM`.

The HTTP layer talks to any object with this adapter's four coroutines (`generate`,
`init_sync_group`, `receive_weights`, `shutdown`), so it is tested without vLLM.
Imports vLLM only inside `VLLMEngine.start`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from gspo_trainer.rollout.types import SamplingParams

WORKER_EXTENSION = "gspo_trainer.rollout.worker_ext.WeightSyncExtension"
WARMUP_PROMPT_TOKENS = 8  # the CPU backend dies on a first forward of <= 4 tokens


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class EngineOptions:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    workers: int
    max_model_len: int  # prompt + response tokens the engine can hold
    vocab_size: int

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Sample]: ...

    def tokenize(self, text: str) -> list[int]: ...

    async def init_sync_group(self, **coords: Any) -> None: ...

    async def receive_weights(self, timeout_s: float) -> dict[str, int]: ...

    async def load_weights_file(self, path: str, timeout_s: float) -> dict[str, int]: ...

    async def shutdown(self) -> None: ...


def to_vllm_params(params: SamplingParams) -> Any:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=0,  # the sampled token's own log-prob, from the raw logits
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output holding all n samples
    )


class VLLMEngine:
    def __init__(self, llm: Any, workers: int) -> None:
        self.llm = llm
        self.workers = workers
        self.max_model_len = int(llm.model_config.max_model_len)
        self.vocab_size = int(llm.model_config.get_vocab_size())
        self._ids = itertools.count()

    @classmethod
    async def start(cls, options: EngineOptions) -> VLLMEngine:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs: dict[str, Any] = dict(
            model=options.model,
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            # The log-probs of the distribution the sampler drew from (after temperature):
            # the learner's are computed under the same temperature, so their gap (the
            # mismatch metric; oldLogprobSource engine) is numerics only.
            logprobs_mode="processed_logprobs",
        )
        if _on_cpu():
            kwargs["enforce_eager"] = True
        kwargs.update(options.extra)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        engine = cls(llm, workers=options.tensor_parallel_size)
        await engine.warm_up()
        return engine

    async def warm_up(self) -> None:
        await warm_up(self.llm)

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Sample]:
        request_id = f"gspo-{next(self._ids)}"
        final = None
        async for out in self.llm.generate(
            {"prompt_token_ids": prompt}, to_vllm_params(params), request_id=request_id
        ):
            final = out
        if final is None:
            raise RuntimeError(f"engine returned nothing for request {request_id}")
        samples = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"request {request_id} ended with {c.finish_reason!r}")
            logprobs = [
                step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs or [], strict=False)
            ]
            samples.append(Sample(list(c.token_ids), logprobs, c.finish_reason))
        return samples

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.get_tokenizer().encode(text, add_special_tokens=False))

    async def init_sync_group(self, **coords: Any) -> None:
        await init_sync_group(self.llm, **coords)

    async def receive_weights(self, timeout_s: float) -> dict[str, int]:
        return await receive_weights(self.llm, timeout_s)

    async def load_weights_file(self, path: str, timeout_s: float) -> dict[str, int]:
        return await load_weights_file(self.llm, path, timeout_s)

    async def shutdown(self) -> None:
        self.llm.shutdown()
        await asyncio.sleep(0)


# The engine operations a rollout server needs, on any vLLM engine client (AsyncLLM here;
# the OpenAI server's EngineClient in the endpoint plugin): the worker extension's methods
# through collective_rpc, and the prefix cache dropped after new weights.


async def warm_up(llm: Any) -> None:
    """One short generation at start-up: the CPU backend's first forward must be a prompt of
    at least 5 tokens (a shorter one kills the worker), so it is made here, not by a user."""
    from vllm import SamplingParams as VLLMSamplingParams

    vocab = int(llm.model_config.get_vocab_size())
    prompt = [i % vocab for i in range(3, 3 + WARMUP_PROMPT_TOKENS)]
    params = VLLMSamplingParams(n=1, max_tokens=2, temperature=0.0)
    async for _ in llm.generate({"prompt_token_ids": prompt}, params, request_id="gspo-warm-up"):
        pass


async def init_sync_group(llm: Any, **coords: Any) -> int:
    """Every worker joins the learner's weight-sync group; returns how many did."""
    timeout_s = float(coords["timeout_s"])
    results = await llm.collective_rpc("gspo_init_sync_group", timeout=timeout_s + 5, kwargs=coords)
    return len(results)


async def receive_weights(llm: Any, timeout_s: float) -> dict[str, int]:
    results = await llm.collective_rpc("gspo_receive_weights", timeout=timeout_s)
    first = results[0]
    if any(r["version"] != first["version"] for r in results):
        raise RuntimeError(f"workers received different versions: {results}")
    await llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return dict(first)


async def load_weights_file(llm: Any, path: str, timeout_s: float) -> dict[str, int]:
    results = await llm.collective_rpc(
        "gspo_load_weights_file", timeout=timeout_s, kwargs={"path": path}
    )
    if any(r != results[0] for r in results):
        raise RuntimeError(f"workers loaded different weights from {path}: {results}")
    await llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return dict(results[0])


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
