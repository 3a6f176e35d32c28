"""The GSPO learner: one step is rollout -> reward -> advantages -> πold -> updates -> sync.

Every rank runs the same loop. Rank 0 alone talks to the rollout fleet and scores rewards,
then broadcasts the batch; each rank takes an equal share of every mini-batch, and DeepSpeed
averages the gradients, so the update is the mean over the whole mini-batch whatever the
number of ranks. Departures from the paper: πold is the learner's own recompute by default
(the engine's log-probs are measured against it and reported as the mismatch); a step's
responses form `miniBatches` contiguous mini-batches, one optimizer update each.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gspo_trainer import checkpoint as ckpt
from gspo_trainer import ports
from gspo_trainer.config import GSPOJobSpec
from gspo_trainer.data import PromptStream, fit_prompts, load_eval_examples, load_examples
from gspo_trainer.engine import begin_forward
from gspo_trainer.metrics import LearnerMetrics
from gspo_trainer.progress import LearnerProgress
from gspo_trainer.rewards import Scored, build_scorer
from gspo_trainer.rollout.client import RolloutError
from gspo_trainer.rollout.types import RolloutBatch, SamplingParams, step_seed
from gspo_trainer.samples import format_samples, pick_samples, samples_due
from gspo_trainer.trackers import build_trackers

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gspo.learner")


class RolloutSource(Protocol):
    """What the learner needs from rollouts: `RolloutClient` in production."""

    async def generate(self, prompts: Any, params: SamplingParams) -> RolloutBatch: ...

    async def sync_weights(self, named_tensors: Any, version: int) -> Any: ...


@dataclass
class Packed:
    """A step's responses as tensors, one row per response (N rows, groups contiguous)."""

    ids: torch.Tensor  # (N, L) prompt + response, right-padded
    attn: torch.Tensor  # (N, L)
    targets: torch.Tensor  # (N, L-1) ids[:, 1:]
    mask: torch.Tensor  # (N, L-1) bool, True where targets is a response token
    engine_logp: torch.Tensor  # (N, L-1) engine log-probs at the mask
    rewards: torch.Tensor  # (N,)
    lengths: torch.Tensor  # (N,) response tokens


def pack(prompts: list[list[int]], responses: list[list[int]], engine_logps: list[list[float]],
         rewards: list[float], group_size: int, pad_id: int) -> Packed:  # fmt: skip
    import torch

    rows = [prompts[i // group_size] + r for i, r in enumerate(responses)]
    L = max(len(r) for r in rows)
    N = len(rows)
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    attn = torch.zeros((N, L), dtype=torch.long)
    mask = torch.zeros((N, L - 1), dtype=torch.bool)
    engine_logp = torch.zeros((N, L - 1))
    for i, row in enumerate(rows):
        p, n = len(prompts[i // group_size]), len(responses[i])
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        mask[i, p - 1 : p - 1 + n] = True
        engine_logp[i, p - 1 : p - 1 + n] = torch.tensor(engine_logps[i], dtype=torch.float32)
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    return Packed(ids, attn, ids[:, 1:], mask, engine_logp,
                  torch.tensor(rewards, dtype=torch.float32), lengths)  # fmt: skip


def micro_slices(rows: slice, count: int) -> list[slice]:
    """`rows` cut into `count` contiguous, nearly equal parts, none empty."""
    n = rows.stop - rows.start
    count = max(1, min(count, n))
    bounds = [rows.start + (n * j) // count for j in range(count + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def micro_count(rows_per_update: int, padded_len: int, token_budget: int) -> int:
    """Micro-batches so that each holds at most `token_budget` padded tokens (one row each
    when a single row is longer than the budget)."""
    per_micro = max(1, token_budget // max(padded_len, 1))
    return -(-rows_per_update // per_micro)


MAX_CHECKPOINT_FAILURES = 3  # in a row; then the learner stops (see Learner.checkpoint)


class CheckpointError(RuntimeError):
    """Checkpoints cannot be written; training on would risk losing everything since."""


@dataclass
class LearnerState:
    step: int = 0
    policy_version: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_step: int | None = None
    phase: str = "Starting"
    reward: float | None = None
    message: str = ""
    stop_requested: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


class _Stopping(Exception):
    """Every rank agreed to stop (SIGTERM) mid-step: a final checkpoint, then exit 143."""


class Learner:
    def __init__(
        self,
        spec: GSPOJobSpec,
        rollout: RolloutSource | None,
        *,
        checkpoint_dir: str | Path | None,
        model_path: str | None = None,
        metrics: LearnerMetrics | None = None,
        history_path: str | Path | None = None,
        tracker_dir: str | Path | None = None,
    ) -> None:
        import torch.distributed as dist

        from gspo_trainer import engine as eng
        from gspo_trainer.moe import moe_shape

        self.spec = spec
        self.rollout = rollout
        self.metrics = metrics or LearnerMetrics()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.history_path = Path(history_path) if history_path else None
        if self.history_path is not None:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
        self.state = LearnerState()
        self.checkpoint_failures = 0  # consecutive
        # GSPOCheckpointTooOld scales its threshold by this: unset, it fell to its floor.
        self.metrics.checkpoint_every_steps.set(spec.checkpoint.every_steps)
        eng.init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        where = tracker_dir or checkpoint_dir
        failures = self.metrics.tracker_failures
        self.trackers = build_trackers(spec.metrics.report_to, where, self.rank, failures)
        path = model_path or eng.resolve_model_path(spec)
        model, self.tokenizer = eng.load_model(spec, path)
        self.hf_config = model.config
        # The KL reference is the starting policy, frozen (a full copy on every rank).
        self.ref_model = None
        if spec.algorithm.kl_coef > 0:
            import copy

            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.engine = eng.build_engine(spec, model)
        self.moe = moe_shape(model.config) if spec.model.moe is not None else None
        self.scorer = build_scorer(
            spec.reward,
            on_failure=lambda r: self.metrics.reward_failures.labels(r).inc(),
            max_response_tokens=spec.algorithm.max_response_tokens,
        )
        limit = spec.data.max_prompt_tokens
        examples, dropped = fit_prompts(load_examples(spec.data, self.tokenizer),
                                        self.tokenizer, limit)  # fmt: skip
        self.metrics.prompts_dropped.labels("train").inc(dropped)
        self.stream = PromptStream(examples, spec.data.shuffle_seed)
        self.eval_examples = None
        if spec.algorithm.eval_every_steps > 0:
            self.eval_examples = load_eval_examples(spec.data, self.tokenizer)
            if self.eval_examples is not None:
                self.eval_examples, dropped = fit_prompts(
                    self.eval_examples, self.tokenizer, limit,
                    "data.evalSource" if spec.data.eval_source else "data.source",
                )  # fmt: skip
                self.metrics.prompts_dropped.labels("eval").inc(dropped)
            if self.eval_examples is None and self.rank == 0:
                log.warning("algorithm.evalEverySteps is set but data.evalSource is not: a "
                            "data set of your own is evaluated only on a held-out set, so "
                            "this run is not evaluated")  # fmt: skip
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id

    # --- progress ------------------------------------------------------------------------

    def progress(self) -> LearnerProgress:
        s = self.state
        return LearnerProgress(
            phase=s.phase, step=s.step, max_steps=self.spec.algorithm.max_steps, reward=s.reward,
            last_checkpoint=s.last_checkpoint, last_checkpoint_step=s.last_checkpoint_step,
            policy_version=s.policy_version, message=s.message,
            server_versions=dict(getattr(self.rollout, "server_versions", dict)()),
        )  # fmt: skip

    # --- the run -------------------------------------------------------------------------

    async def run(self) -> int:
        """Resume, sync, train to maxSteps (or until asked to stop), checkpoint, export; the
        trackers (rank 0) see the whole run, however it ends."""
        self.trackers.start(self.spec.to_manifest_dict())
        try:
            return await self._run()
        finally:
            self.trackers.finish(self.state.phase)

    async def _run(self) -> int:
        alg = self.spec.algorithm
        self.resume()
        self.state.phase = "Running"
        try:
            await self._await_fleet(starting=True)  # servers load the model meanwhile
            await self.sync(self.state.step)
            while self.state.step < alg.max_steps:
                # A stop is agreed at the start of each step, in _await_fleet (raises _Stopping).
                await self.train_step(self.state.step + 1)
                every = self.spec.checkpoint.every_steps
                # after a failed checkpoint, try again at the next step, not an interval on
                due = self.state.step % every == 0 or self.checkpoint_failures > 0
                if due and self.state.step < alg.max_steps:
                    self.checkpoint()
        except _Stopping:
            self.state.phase = "Suspending"
            self.checkpoint(final=True)
            log.info("Stopped at step %d after a final checkpoint", self.state.step)
            return 0
        if self.state.last_checkpoint_step != self.state.step:  # not when resumed at the end
            self.checkpoint(final=True)
        if self.spec.checkpoint.export_hf:
            self.export()
        self.state.phase = "Succeeded"
        return 0

    async def _await_fleet(self, *, starting: bool = False) -> None:
        """Every rank: wait until a rollout server can serve. Starting, that is any server that
        answers (it gets the weights next; pods start together and vLLM may take as long as
        its startup probe allows to load); later, one holding the current policy: servers
        that appeared or came back are synced, for up to rollout.requestTimeoutSeconds."""
        limit_s = (
            ports.ROLLOUT_STARTUP_SECONDS if starting else self.spec.rollout.request_timeout_seconds
        )
        waited_s, delay_s = 0.0, 0.5
        state = getattr(self.rollout, "fleet_state", None)
        while True:
            if self._agree_stop():  # suspended: the servers are stopping too
                raise _Stopping
            added = await self._discovered()
            ready, stale = (await state()) if self.rank == 0 and state is not None else (1, 0)
            if not starting and self._any_rank(added or stale > 0):
                await self.sync(self.state.policy_version)
                if self.rank == 0 and state is not None:
                    ready, stale = await state()
            short = ready + stale == 0 if starting else ready == 0
            if not self._any_rank(short):
                return
            if waited_s >= limit_s:
                raise RuntimeError(
                    f"no rollout server could serve policy version {self.state.policy_version} "
                    f"for {waited_s:.0f} s"
                )
            if waited_s == 0:
                log.warning("No rollout server can serve yet; waiting up to %.0f s", limit_s)
            await asyncio.sleep(delay_s)
            waited_s, delay_s = waited_s + delay_s, min(delay_s * 2, 10.0)

    async def _discovered(self) -> bool:
        """Rank 0 re-resolves the fleet; True on every rank when servers were added."""
        added = False
        discover = getattr(self.rollout, "discover", None)
        if self.rank == 0 and discover is not None:
            added = bool(await discover())
        return self._any_rank(added)

    def _any_rank(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0])
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _agree_stop(self) -> bool:
        """True on every rank when any rank was asked to stop (SIGTERM)."""
        return self._any_rank(self.state.stop_requested)

    async def sync(self, version: int) -> float:
        """Push the policy to the rollout servers (rank 0; ZeRO-3 gathers on every rank)."""
        from gspo_trainer import engine as eng

        start = time.perf_counter()
        sent = 0
        with eng.full_parameters(self.engine) as named:
            if self.rank == 0:
                try:
                    report = await self.rollout.sync_weights(named, version)
                    sent = int(getattr(report, "bytes_total", 0))
                except RolloutError as exc:
                    # Suspended or deleted, the servers stop with the learner: the update is
                    # done, so the final checkpoint goes ahead; the next start syncs again.
                    if not self.state.stop_requested:
                        raise
                    log.warning(
                        "Weight sync to version %d skipped while stopping: %s", version, exc
                    )
        self.state.policy_version = version
        self.metrics.policy_version.set(version)
        self.metrics.observe_seconds("weight_sync", time.perf_counter() - start)
        return float(sent)

    # --- one step ------------------------------------------------------------------------

    def sampling(self, step: int) -> SamplingParams:
        """Sampling of step `step`, seeded from (algorithm.seed, step): sample j of prompt i
        draws with its own seed (SamplingParams.seed), so a run is repeatable and every
        sample of a batch has a stream of its own (one seed shared by every prompt's request
        would draw every prompt's samples from one random stream)."""
        alg = self.spec.algorithm
        return SamplingParams(
            n=alg.group_size, max_tokens=alg.max_response_tokens, temperature=alg.temperature,
            top_p=alg.top_p, top_k=-1, seed=step_seed(alg.seed, step),
            stop_token_ids=(self.eos_id,),
        )  # fmt: skip

    def eval_due(self, step: int) -> bool:
        """Evaluate at every evalEverySteps-th step and after the last (so a run always ends
        with its final accuracy)."""
        every = self.spec.algorithm.eval_every_steps
        if every <= 0 or self.eval_examples is None:
            return False
        return step % every == 0 or step == self.spec.algorithm.max_steps

    async def evaluate(self, step: int) -> dict[str, float]:
        """Rank 0: the policy the rollout servers hold (synced just before) on the evaluation
        set, through the same engine as the rollouts: `eval_accuracy`, the share of prompts
        whose greedy answer (temperature 0) scores full reward, and `eval_mean_at_k`, the
        mean reward of k = groupSize samples per prompt at the training temperature (what
        training sees, without its prompt order). {} on other ranks, or when no server could
        serve (logged; training goes on)."""
        if self.rank != 0 or self.eval_examples is None:
            return {}
        alg = self.spec.algorithm
        examples = self.eval_examples
        prompts = self._prompt_ids(examples)
        greedy = SamplingParams(n=1, max_tokens=alg.max_response_tokens, temperature=0.0,
                                stop_token_ids=(self.eos_id,))  # fmt: skip
        sampled = replace(self.sampling(step), seed=step_seed(alg.seed, step, "eval"))
        t0 = time.perf_counter()
        try:
            scores = []
            for params in (greedy, sampled):
                batch = await self.rollout.generate(prompts, params)
                completions = [c for group in batch.groups for c in group]
                scores.append(self.scorer.score(self._scored(examples, completions)))
        except RolloutError as exc:
            log.warning("Step %d: evaluation skipped: %s", step, exc)
            return {}
        greedy_scores, sampled_scores = scores
        return {
            "eval_accuracy": sum(r >= 1.0 for r in greedy_scores) / len(greedy_scores),
            "eval_mean_at_k": sum(sampled_scores) / len(sampled_scores),
            "eval_seconds": time.perf_counter() - t0,
        }

    def _prompt_ids(self, examples: list[Any]) -> list[list[int]]:
        """The prompts' token ids as the rollout servers get them (no special tokens added;
        data.fit_prompts counts them the same way)."""
        return [self.tokenizer(e.prompt, add_special_tokens=False).input_ids for e in examples]

    def _scored(self, examples: list[Any], completions: list[Any]) -> list[Scored]:
        """What the reward sees of each completion: its prompt, decoded text, reference
        answer, whether it ended with EOS, and its length in tokens."""
        return [
            Scored(examples[c.prompt_index].prompt,
                   self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                   examples[c.prompt_index].answer, c.finish_reason == "stop",
                   len(c.token_ids))
            for c in completions
        ]  # fmt: skip

    async def collect(
        self, step: int, examples: list[Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Rank 0: rollouts and rewards. Returns the payload every rank needs, and timings;
        the payload is {"retry": True} when no rollout server was left to serve it."""

        if self.rank != 0:
            return {}, {}
        prompts = self._prompt_ids(examples)
        t0 = time.perf_counter()
        try:
            batch = await self.rollout.generate(prompts, self.sampling(step))
        except RolloutError as exc:
            log.warning("Step %d: %s; waiting for a rollout server", step, exc)
            return {"retry": True}, {}
        t1 = time.perf_counter()
        completions = [c for group in batch.groups for c in group]
        scored = self._scored(examples, completions)
        rewards, components = self.scorer.score_components(scored)  # components: reward/<name>
        due = samples_due(step, self.spec.metrics.samples_every_steps)
        t2 = time.perf_counter()
        payload = {
            "prompts": prompts,
            "responses": [c.token_ids for c in completions],
            "engine_logps": [c.logprobs for c in completions],
            "rewards": rewards,
            "reward_components": components,
            "texts": ([s.prompt for s in scored], [s.completion for s in scored]) if due else None,
        }
        return payload, {"rollout": t1 - t0, "reward": t2 - t1}

    def _broadcast(self, payload: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        if self.world == 1:
            return payload
        box = [payload if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def _rows(self, n: int, k: int) -> slice:
        """This rank's rows of mini-batch k, of a step with n responses."""
        per_update = n // self.spec.algorithm.mini_batches
        share = per_update // self.world
        start = k * per_update + self.rank * share
        return slice(start, start + share)

    def _forward(self, packed: Packed, rows: slice, router: bool, model: Any = None):
        """Final hidden states (n, L-1, H) predicting targets, and router logits if MoE."""
        module = model
        if module is None:
            begin_forward(self.engine)
            module = self.engine.module
        attn = packed.attn[rows]
        L = int(attn.sum(-1).max())
        base = getattr(module, module.base_model_prefix)
        kw = {"output_router_logits": True} if (router and self.moe) else {}
        out = base(input_ids=packed.ids[rows, :L], attention_mask=attn[:, :L], **kw)
        hidden = out.last_hidden_state[:, : L - 1]
        return hidden, L, getattr(out, "router_logits", None)

    def _micro(self, packed: Packed, my: list[slice]) -> list[list[slice]]:
        """Each mini-batch's rows in micro-batches within learner.microBatchTokens; every rank
        runs as many (ZeRO's collectives in backward pair up across ranks)."""
        import torch
        import torch.distributed as dist

        budget = self.spec.learner.micro_batch_tokens
        need = max(
            micro_count(r.stop - r.start, int(packed.attn[r].sum(-1).max()), budget) for r in my
        )
        if self.world > 1:
            box = torch.tensor([need])
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            need = int(box.item())
        return [micro_slices(r, need) for r in my]

    def _token_mask(self, packed: Packed, rows: slice, L: int) -> torch.Tensor:
        """(n*L,) True at response-token positions, the layout of router logits."""
        import torch

        m = packed.mask[rows, : L - 1]
        return torch.cat([torch.zeros_like(m[:, :1]), m], 1).reshape(-1)

    async def train_step(self, step: int) -> dict[str, float]:
        import torch

        from gspo_trainer.advantages import group_advantages
        from gspo_trainer.engine import lm_head_weight, score_with_head
        from gspo_trainer.logprobs import token_logprobs_from_hidden
        from gspo_trainer.loss import LEVEL_OF
        from gspo_trainer.moe import expert_load, router_aux_loss, routing_drift, top_k_experts

        alg, t_step = self.spec.algorithm, time.perf_counter()
        # --- rollout and reward (rank 0), then every rank gets the batch ---------------
        # A server that appeared gets the current weights first; with none left to serve,
        # every rank waits for one to return (and syncs it) and the batch is drawn again.
        position = self.stream.state_dict()
        examples = self.stream.next_batch(alg.prompts_per_step)
        while True:
            try:
                await self._await_fleet()
            except _Stopping:
                self.stream.load_state_dict(position)  # the batch is drawn again on resume
                raise
            payload, timings = await self.collect(step, examples)
            payload = self._broadcast(payload)
            if not payload.get("retry"):
                break
        G = alg.group_size
        packed = pack(payload["prompts"], payload["responses"], payload["engine_logps"],
                      payload["rewards"], G, self.pad_id)  # fmt: skip
        N = packed.rewards.shape[0]
        # --- advantages ------------------------------------------------------------------
        advantages, adv_stats = group_advantages(packed.rewards, G)
        # --- πold: the learner's recompute (or the engine's log-probs) -------------------
        t0 = time.perf_counter()
        module = self.engine.module
        my = [self._rows(N, k) for k in range(alg.mini_batches)]
        micro = self._micro(packed, my)
        old: dict[int, torch.Tensor] = {}
        ref: dict[int, torch.Tensor] = {}
        old_experts: dict[int, list[torch.Tensor]] = {}
        mismatch_sum = mismatch_n = 0.0
        with torch.no_grad():
            for k, rows in enumerate(my):
                width = int(packed.attn[rows].sum(-1).max()) - 1
                old[k] = torch.zeros(rows.stop - rows.start, width)
                if self.ref_model is not None:
                    ref[k] = torch.zeros_like(old[k])
                experts = []
                for sub in micro[k]:
                    here = slice(sub.start - rows.start, sub.stop - rows.start)
                    hidden, L, router = self._forward(packed, sub, router=True)
                    mask, targets = packed.mask[sub, : L - 1], packed.targets[sub, : L - 1]
                    logp = score_with_head(module, _logp, hidden, targets, mask,
                                           alg.temperature)  # fmt: skip
                    eng_logp = packed.engine_logp[sub, : L - 1]
                    mismatch_sum += float((logp - eng_logp).abs()[mask].sum())
                    mismatch_n += float(mask.sum())
                    source = eng_logp if alg.old_logprob_source == "engine" else logp
                    old[k][here, : L - 1] = source
                    if self.ref_model is not None:
                        h_ref, _, _ = self._forward(packed, sub, router=False,
                                                    model=self.ref_model)  # fmt: skip
                        ref[k][here, : L - 1] = token_logprobs_from_hidden(
                            h_ref, lm_head_weight(self.ref_model), targets,
                            temperature=alg.temperature, mask=mask,
                        ).logp  # fmt: skip
                    if router is not None and self.moe:
                        experts.append(top_k_experts(router, self._token_mask(packed, sub, L),
                                                     self.moe[1]))  # fmt: skip
                if experts:
                    old_experts[k] = _per_layer(experts)
        t1 = time.perf_counter()
        # --- updates: one optimizer step per mini-batch, its gradient accumulated over
        # micro-batches, each weighted by its share of the mini-batch's responses ---------
        sums: dict[str, float] = {}
        aux_coef = self.spec.model.moe.router_aux_loss_coef if self.spec.model.moe else 0.0
        kw = dict(level=LEVEL_OF[alg.loss_level], clip_low=alg.clip_low, clip_high=alg.clip_high)
        for k, rows in enumerate(my):
            for j, sub in enumerate(micro[k]):
                here = slice(sub.start - rows.start, sub.stop - rows.start)
                share = (sub.stop - sub.start) / (rows.stop - rows.start)
                hidden, L, router = self._forward(packed, sub, router=aux_coef > 0)
                mask, targets = packed.mask[sub, : L - 1], packed.targets[sub, : L - 1]
                old_sub = old[k][here, : L - 1]
                kl = {}
                if k in ref:
                    kl = {"ref_logprobs": ref[k][here, : L - 1], "kl_coef": alg.kl_coef}
                loss, stats, scores = score_with_head(
                    module, _fused, hidden, targets, mask, old_sub, advantages[sub],
                    alg.temperature, {**kw, **kl},
                )  # fmt: skip
                entropy = scores.entropy
                if router is not None and self.moe and aux_coef > 0:
                    aux = router_aux_loss(router, self._token_mask(packed, sub, L), *self.moe)
                    loss = loss + aux_coef * aux
                    _add(sums, "router_aux_loss", share * float(aux.detach()))
                # DeepSpeed steps the optimizer only after the mini-batch's last micro-batch.
                self.engine.set_gradient_accumulation_boundary(j == len(micro[k]) - 1)
                self.engine.backward(loss * share)
                self.engine.step()
                _add(sums, "loss", share * float(stats["loss"]))
                _add(sums, "clip_fraction_low", share * float(stats["clip_frac_low"]))
                _add(sums, "clip_fraction_high", share * float(stats["clip_frac_high"]))
                _add(sums, "log_ratio_abs", share * float(stats["abs_log_seq_ratio"]))
                _add(sums, "kl", share * float(stats.get("kl", torch.zeros(()))))
                if entropy is not None:
                    ent = float(entropy[mask].mean()) if mask.any() else 0.0
                    _add(sums, "entropy", share * ent)
        grad_norm = self.engine.get_global_grad_norm()
        # --- routing drift: top-k experts under πθ (after the updates) vs πold ----------
        drift = None
        if old_experts:
            with torch.no_grad():
                new = []
                for parts in micro:
                    experts = []
                    for sub in parts:
                        _, L, router = self._forward(packed, sub, router=True)
                        experts.append(top_k_experts(router, self._token_mask(packed, sub, L),
                                                     self.moe[1]))  # fmt: skip
                    new.append(_per_layer(experts))
            drift = routing_drift([e for k in old_experts for e in old_experts[k]],
                                  [e for layers in new for e in layers])  # fmt: skip
        t2 = time.perf_counter()
        # --- weight sync -----------------------------------------------------------------
        sent = None
        evaluating = self.eval_due(step)
        # An evaluation reads the servers' weights: they get this step's update first.
        if step % self.spec.weight_sync.every_steps == 0 or evaluating:
            sent = await self.sync(step)
        t3 = time.perf_counter()
        evaluation = await self.evaluate(step) if evaluating else {}
        # --- stats, averaged over ranks --------------------------------------------------
        mb = alg.mini_batches
        local = {key: value / mb for key, value in sums.items()}
        local["clip_fraction"] = local["clip_fraction_low"] + local["clip_fraction_high"]
        local["logprob_mismatch"] = mismatch_sum / max(mismatch_n, 1.0)
        if drift is not None:
            local["routing_drift"] = drift
        stats = self._mean_over_ranks(local)
        # The step's own time: an evaluation is reported apart (eval_seconds).
        step_s = time.perf_counter() - t_step - evaluation.get("eval_seconds", 0.0)
        tokens = float(packed.lengths.sum())
        stats.update(
            reward_mean=float(adv_stats["reward_mean"]),
            reward_std=float(adv_stats["reward_std"]),
            zero_advantage_fraction=float(adv_stats["zero_spread_share"]),
            response_length=float(packed.lengths.mean()),
            tokens_per_second=tokens / step_s,
        )
        if grad_norm is not None:
            stats["grad_norm"] = float(grad_norm)
        if sent is not None:
            stats["weight_sync_bytes"] = sent
        stats.update(evaluation)  # rank 0 only, like the history and the metrics
        stats.update(payload["reward_components"])
        if payload["texts"] is not None:  # samples.py; trackers read stats["samples"]
            stats["samples"] = pick_samples(*payload["texts"], packed.rewards.tolist(),
                advantages.tolist(), G, self.spec.metrics.samples_per_log)  # fmt: skip
        # --- metrics, progress, history (rank 0) -----------------------------------------
        self.state.step = step
        self.state.reward = stats["reward_mean"]
        if self.rank == 0:
            self.metrics.observe_step(step, stats)
            self.metrics.tokens.inc(tokens)
            for phase, seconds in (*timings.items(), ("logprob", t1 - t0),
                                   ("update", t2 - t1), ("step", step_s)):  # fmt: skip
                self.metrics.observe_seconds(phase, seconds)
            if old_experts and self.spec.model.moe and self.spec.model.moe.report_expert_load:
                self.metrics.observe_expert_load(
                    expert_load(old_experts[0], self.moe[0])  # type: ignore[index]
                )
            record = {"step": step, "seconds": step_s, "time": time.time(), **stats,
                      **{f"{k}_seconds": v for k, v in timings.items()},
                      "logprob_seconds": t1 - t0, "update_seconds": t2 - t1,
                      "sync_seconds": t3 - t2}  # fmt: skip
            self.state.history.append(record)
            if self.history_path is not None:
                with open(self.history_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            self.trackers.log(step, record)
            log.info(
                "step %d reward %.3f clip %.4f |log s| %.2e entropy %.3f len %.1f "
                "mismatch %.2e drift %s %.2fs", step, stats["reward_mean"],
                stats["clip_fraction"], stats["log_ratio_abs"], stats.get("entropy", 0.0),
                stats["response_length"], stats["logprob_mismatch"],
                f"{drift:.3f}" if drift is not None else "-", step_s,
            )  # fmt: skip
            if "samples" in stats:
                log.info("%s", format_samples(step, stats["samples"]))
        return stats

    def _mean_over_ranks(self, local: dict[str, float]) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        if self.world == 1:
            return dict(local)
        keys = sorted(local)
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vec)
        return {k: float(v) / self.world for k, v in zip(keys, vec.tolist(), strict=True)}

    # --- checkpoints -----------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.state.step, "data": self.stream.state_dict(),
                "rng": ckpt.rng_state(), "policy_version": self.state.policy_version}  # fmt: skip

    def checkpoint(self, *, final: bool = False) -> None:
        """Save, and stop the run rather than train on without checkpoints: a final one that
        fails, or MAX_CHECKPOINT_FAILURES in a row, raise CheckpointError (the learner exits
        1; the next start resumes from the last good checkpoint, which a failed write never
        touches)."""
        if self.checkpoint_dir is None:
            return
        if self.save_checkpoint() is not None:
            self.checkpoint_failures = 0
            return
        self.checkpoint_failures += 1
        if final or self.checkpoint_failures >= MAX_CHECKPOINT_FAILURES:
            raise CheckpointError(
                f"{self.checkpoint_failures} checkpoint write(s) in a row failed at step "
                f"{self.state.step} (see the errors above); the newest good checkpoint is "
                f"{self.state.last_checkpoint or 'none'}, and training stops here rather than "
                "carry on without checkpoints: free space on the checkpoint volume or fix "
                "its permissions, then restart (the job resumes from it)"
            )

    def save_checkpoint(self) -> Path | None:
        """Every rank writes its part aside; rank 0 commits only if every rank succeeded.
        Returns the checkpoint on every rank, or None on every rank when it failed (logged,
        counted, the aside copy removed; the previous checkpoints are untouched)."""
        if self.checkpoint_dir is None:
            return None
        phase, self.state.phase = self.state.phase, "Checkpointing"
        start = time.perf_counter()
        step = self.state.step
        final = None
        try:
            ok = True
            # Every rank runs the same collectives whatever fails: the barrier, DeepSpeed's
            # own inside save_state (which records a failed write and raises after them),
            # then the agreement.
            if self.rank == 0:
                ckpt.clear_stale(self.checkpoint_dir)
            self._barrier()
            try:
                tmp = ckpt.aside(self.checkpoint_dir, step)
                ckpt.save_state(self.engine, tmp, self.rank, self.trainer_state())
            except Exception:
                log.exception("Checkpoint at step %d: this rank could not write its part", step)
                ok = False
            ok = self._all_ranks(ok)
            if ok and self.rank == 0:
                try:
                    final = ckpt.commit(self.checkpoint_dir, step, self.spec.checkpoint.keep)
                except Exception:
                    log.exception("Checkpoint at step %d could not be committed", step)
                    ok = False
            ok = self._all_ranks(ok)
            if ok:
                final = self.checkpoint_dir / ckpt.step_name(step)  # every rank: committed
                self.metrics.checkpoint_time.set(time.time())
                self.state.last_checkpoint, self.state.last_checkpoint_step = final.name, step
                if self.rank == 0:
                    log.info("Saved checkpoint %s", final)
            else:
                final = None
                self.metrics.checkpoint_failures.inc()
                log.error("Checkpoint at step %d FAILED; the newest good one is still %s",
                          step, self.state.last_checkpoint or "none")  # fmt: skip
                if self.rank == 0:
                    ckpt.clear_stale(self.checkpoint_dir)  # give the space back
                # Cleared before any rank can stop (its launcher then stops the others).
                self._barrier()
        finally:
            self.state.phase = phase
        self.metrics.observe_seconds("checkpoint", time.perf_counter() - start)
        return final

    def _all_ranks(self, flag: bool) -> bool:
        return not self._any_rank(not flag)

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier()

    def resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the step resumed at."""
        if self.checkpoint_dir is None:
            return 0
        found = self._newest_intact()
        if found is None:
            return 0
        state = ckpt.load_state(self.engine, found, self.rank)
        self.stream.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        self.state.step = int(state["step"])
        self.state.last_checkpoint, self.state.last_checkpoint_step = found.name, self.state.step
        log.info("Resumed from %s at step %d (checksums verified)", found, self.state.step)
        return self.state.step

    def _newest_intact(self) -> Path | None:
        """Rank 0 verifies (checksums: see checkpoint.newest_intact); every rank gets its pick."""
        assert self.checkpoint_dir is not None
        found = ckpt.newest_intact(self.checkpoint_dir) if self.rank == 0 else None
        choice = self._broadcast({"choice": found.name if found else None})["choice"]
        return self.checkpoint_dir / choice if choice else None

    def export(self) -> Path | None:
        """The final policy as HF safetensors under <checkpoint dir>/export. Every rank
        gathers; rank 0 writes; a failed write fails the run on every rank (no rank is left
        waiting), with the final checkpoint already committed and intact."""
        from gspo_trainer import engine as eng

        if self.checkpoint_dir is None:
            return None
        out = self.checkpoint_dir / "export"
        ok = True
        with eng.full_parameters(self.engine) as named:
            if self.rank == 0:
                try:
                    ckpt.export_hf(named, self.engine.module, self.tokenizer, out)
                    log.info("Exported the policy to %s", out)
                except Exception:
                    log.exception("Exporting the policy to %s failed", out)
                    ok = False
        if not self._all_ranks(ok):
            raise CheckpointError(
                f"exporting the final policy to {out} failed (see the errors above); the "
                f"final checkpoint {self.state.last_checkpoint or 'none'} is intact: free "
                "space on the checkpoint volume and rerun the job, which resumes from that "
                "checkpoint and exports again, or set checkpoint.exportHf: false"
            )
        return out


def _per_layer(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-layer expert choices of several micro-batches, joined per layer."""
    import torch

    return [torch.cat(layer) for layer in zip(*parts, strict=True)]


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _logp(hidden, weight, targets, mask, temperature):
    from gspo_trainer.logprobs import token_logprobs_from_hidden

    return token_logprobs_from_hidden(hidden, weight.detach(), targets, temperature=temperature,
                                      mask=mask).logp  # fmt: skip


def _fused(hidden, weight, targets, mask, old_logp, advantages, temperature, kw):
    from gspo_trainer.fused_loss import policy_loss_from_hidden

    return policy_loss_from_hidden(hidden, weight, targets, mask, old_logp, advantages,
                                   temperature=temperature, **kw)  # fmt: skip
