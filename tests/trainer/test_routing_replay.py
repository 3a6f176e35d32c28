"""Routing Replay on the 16-expert built-in MoE: the update's forward runs each token on the
experts πold chose for it, packed or padded, in other micro-batches, after the router moved;
without it the choices drift. And the 16-expert model's routing drift as the learner measures
it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from learner_helpers import make_learner, tiny_spec

from gspo_api.validation import ConfigError, SpecError, parse_spec
from gspo_trainer.moe import moe_shape
from gspo_trainer.step.batch import Packed, pack
from gspo_trainer.step.plan import MiniBatch
from gspo_trainer.step.policy import Policy, per_layer
from gspo_trainer.step.routing_replay import RoutingReplay, replay_scores, token_slots
from gspo_trainer.step.update import routing_drift_after
from gspo_trainer.tiny import build_tiny_model, materialize

MODEL = "builtin:tiny-qwen3-moe-16e"


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_model(MODEL, seed=0)[1]


def fresh_model() -> Any:
    """The 16-expert model, new for each test: they move its routers and hook it."""
    return build_tiny_model(MODEL, seed=0)[0].eval()


def batch(tok: Any, rows: int = 6) -> Packed:
    """`rows` responses of varied lengths to two prompts (groups of rows / 2)."""
    g = torch.Generator().manual_seed(1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    responses = [torch.randint(3, 15, (3 + 2 * i,), generator=g).tolist() for i in range(rows)]
    logps = [[0.0] * len(r) for r in responses]
    return pack(prompts, responses, logps, [0.0] * rows, rows // 2, tok.pad_token_id)


def policy_of(model: Any, *, replay: bool, packs: bool) -> Policy:
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), optimizer=None)
    return Policy(engine, moe_shape(model.config), pack=packs,
                  replay=RoutingReplay(model) if replay else None)  # fmt: skip


class Seen:
    """What each sparse block's experts were given (the experts' own input, after any hook on
    the router), by token slot: per layer, (slots + 1, k) expert ids and their gate weights."""

    def __init__(self, model: Any, replay: RoutingReplay, tokens: int) -> None:
        self.experts = [torch.full((tokens + 1, 2), -1) for _ in replay.routers]
        self.weights = [torch.zeros(tokens + 1, 2) for _ in replay.routers]
        blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
        self.handles = [b.experts.register_forward_pre_hook(self._hook(i, replay))
                        for i, b in enumerate(blocks)]  # fmt: skip

    def _hook(self, layer: int, replay: RoutingReplay) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            _, index, weight = args  # (N, H), (N, k), (N, k)
            order = index.sort(-1)
            self.experts[layer][replay.slots] = order.values
            self.weights[layer][replay.slots] = weight.gather(1, order.indices).detach()

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def free_choice(policy: Policy, packed: Packed) -> list[torch.Tensor]:
    """Per layer, (slots + 1, k): the experts the current router picks, routing freely."""
    n = len(packed.seq_lengths)
    with torch.no_grad():
        fwd = policy.forward(packed, slice(0, n), router=True)
    slots = token_slots(packed.seq_lengths, slice(0, n), fwd.L)
    out = []
    for logits in fwd.router:
        layer = torch.full((sum(packed.seq_lengths) + 1, 2), -1)
        layer[slots] = logits.topk(2, -1).indices.sort(-1).values
        out.append(layer)
    return out


def move_routers(model: Any) -> None:
    """Each router's weights shifted by noise twice their spread: an update's worth and more."""
    torch.manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3MoeTopKRouter":
                m.weight.add_(torch.randn_like(m.weight) * m.weight.std() * 2)


def test_replay_runs_each_token_on_its_pi_old_experts_after_the_router_moved(tok: Any) -> None:
    """Recorded padded in one forward, replayed packed in two micro-batches of other rows."""
    model = fresh_model()
    packed = batch(tok)
    n, tokens = len(packed.seq_lengths), sum(packed.seq_lengths)
    recorder = policy_of(model, replay=True, packs=False)
    replay = recorder.replay
    assert replay is not None and len(replay.routers) == 4
    seen = Seen(model, replay, tokens)
    with torch.no_grad():
        recorder.forward(packed, slice(0, n), router=False, routing="record")
    old = [e.clone() for e in seen.experts]
    assert all((e[:tokens] >= 0).all() for e in old)  # every real token recorded

    move_routers(model)
    replayer = Policy(recorder.engine, recorder.moe, pack=True, replay=replay)
    assert replayer.packs()
    for rows in (slice(0, 2), slice(2, n)):
        hidden = replayer.forward(packed, rows, router=False, routing="replay").hidden
        hidden.sum().backward()  # the gates carry gradients to the router
    for layer in range(4):
        assert torch.equal(seen.experts[layer][:tokens], old[layer][:tokens])
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in replay.routers)
    seen.close()

    # Without replay the moved routers choose other experts for many tokens.
    moved = free_choice(replayer, packed)
    changed = sum(
        int((m[:tokens] != o[:tokens]).any(-1).sum()) for m, o in zip(moved, old, strict=True)
    )
    assert changed > tokens // 4


def test_replayed_gates_are_the_current_softmax_over_the_recorded_experts(tok: Any) -> None:
    model = fresh_model()
    packed = batch(tok)
    n, tokens = len(packed.seq_lengths), sum(packed.seq_lengths)
    policy = policy_of(model, replay=True, packs=True)
    replay = policy.replay
    assert replay is not None
    seen = Seen(model, replay, tokens)
    logits_by_slot: list[torch.Tensor] = [torch.zeros(0)] * 4

    def keep(layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            at = torch.zeros(tokens + 1, output[0].shape[-1])
            at[replay.slots] = output[0].detach()
            logits_by_slot[layer] = at

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(replay.routers)]
    with torch.no_grad():
        policy.forward(packed, slice(0, n), router=False, routing="record")
        old = [e.clone() for e in seen.experts]
        move_routers(model)
        policy.forward(packed, slice(0, n), router=False, routing="replay")
    for layer in range(4):
        chosen = old[layer][:tokens]
        current = logits_by_slot[layer][:tokens]
        expected = current.gather(1, chosen).softmax(-1)  # norm_topk_prob: renormalised
        torch.testing.assert_close(seen.weights[layer][:tokens], expected)
    for h in handles:
        h.remove()
    seen.close()


def test_replay_scores_are_the_routers_own_for_its_own_choice() -> None:
    logits = torch.randn(7, 16)
    probs = logits.softmax(-1)
    top = probs.topk(2, -1)
    torch.testing.assert_close(replay_scores(logits, top.indices, True),
                               top.values / top.values.sum(-1, keepdim=True))  # fmt: skip
    torch.testing.assert_close(replay_scores(logits, top.indices, False), top.values)


def test_token_slots_number_the_real_tokens_and_send_padding_to_the_spare_one() -> None:
    lengths = (2, 3, 1)
    assert token_slots(lengths, slice(1, 3), 3).tolist() == [2, 3, 4, 5, 6, 6]
    assert token_slots(lengths, slice(0, 1), 3).tolist() == [0, 1, 6]


def test_routing_drift_of_the_16_expert_model(tok: Any) -> None:
    """Zero without an update, above zero once the routers move: what the learner reports on
    a diagnostics step (routing_drift_after)."""
    model = fresh_model()
    packed = batch(tok)
    policy = policy_of(model, replay=False, packs=True)
    mb = MiniBatch(slice(0, len(packed.seq_lengths)), [slice(0, 3), slice(3, 6)])
    with torch.no_grad():
        old = per_layer([policy.experts(packed, sub, policy.forward(packed, sub, router=True))
                         for sub in mb.micro])  # fmt: skip
    assert len(old) == 4
    assert routing_drift_after(policy, packed, mb, old) == [0.0] * 4
    move_routers(model)
    drift = routing_drift_after(policy, packed, mb, old)
    assert all(0.0 < d <= 1.0 for d in drift)


def test_refused_for_a_model_without_experts_and_without_a_learner_pi_old() -> None:
    dense = build_tiny_model("builtin:tiny-qwen3", seed=0)[0]
    with pytest.raises(ConfigError, match=r"spec\.algorithm\.routingReplay: .* no experts"):
        RoutingReplay(dense)
    spec = tiny_spec(routingReplay=True)["spec"]
    spec["model"]["name"] = "builtin:small-qwen3"
    with pytest.raises(
        SpecError, match=r"spec\.algorithm\.routingReplay: builtin:small-qwen3 is dense"
    ):
        parse_spec(spec)
    spec = tiny_spec(routingReplay=True, oldLogprobSource="engine")["spec"]
    with pytest.raises(SpecError, match=r"spec\.algorithm\.routingReplay: .*oldLogprobSource"):
        parse_spec(spec)


def test_the_learner_refuses_it_for_a_dense_model_it_reads_from_a_path(tmp_path: Path) -> None:
    """A local (or Hub) model's experts are known only once its config is read: at start."""
    manifest = tiny_spec(routingReplay=True)
    manifest["spec"]["model"]["name"] = str(materialize("builtin:tiny-qwen3", tmp_path))
    with pytest.raises(ConfigError, match=r"spec\.algorithm\.routingReplay: .* no experts"):
        make_learner(tmp_path, None, manifest)


def test_a_learner_step_with_routing_replay(tmp_path: Path) -> None:
    """GRPO with Routing Replay on the 16-expert model under ZeRO-3 (MoE blocks gathered whole)
    with gradient checkpointing (each layer's forward runs again in backward, replaying): two
    mini-batches, each recorded by its πold forward and replayed by its update; routing drift
    reported."""
    manifest = tiny_spec(lossLevel="grpo", routingReplay=True, miniBatches=2, promptsPerStep=2)
    spec = manifest["spec"]
    spec["model"].update(name=MODEL, gradientCheckpointing=True)
    spec["learner"]["zeroStage"] = 3
    spec["metrics"]["diagnosticsEverySteps"] = 1
    learner = make_learner(tmp_path, None, manifest)
    replay = learner.policy.replay
    assert replay is not None and len(replay.routers) == 4
    modes: list[str | None] = []
    forward_slots = replay.forward_slots
    replay.forward_slots = lambda mode, *a: (modes.append(mode), forward_slots(mode, *a))[1]  # type: ignore[method-assign]
    asyncio.run(learner.sync(0))
    stats = asyncio.run(learner.train_step(1))
    assert modes == ["record", "record", "replay", "replay"]  # one micro-batch a mini-batch
    assert 0.0 <= stats["routing_drift"] <= 1.0 and stats["loss"] == stats["loss"]
