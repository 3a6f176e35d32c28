"""Agreement with TRL's GRPO trainer loss, an independent implementation (dev-only oracle).

What is compared: TRL 1.16's own `GRPOTrainer._compute_loss` arithmetic with
`loss_type="grpo"` (mean over each completion's tokens, then mean over completions) at
`importance_sampling_level="sequence"` (TRL's GSPO) and `"token"` (GRPO), against
`policy_loss` at level "sequence" and "token" on the same random log-probs, advantages, masks
and clip ranges: the loss value, its gradient w.r.t. the log-probs, the clip fractions, and
the loss with a k3 KL term (beta > 0). The harness replaces only TRL's model forward
(`_get_per_token_logps_and_entropies`) with one that returns the given log-probs; the
trainer object is built without `__init__` and given the few attributes the loss reads.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import import_module
from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import torch

from gspo_trainer.loss import policy_loss

# TRL is imported by the first test that runs, not at collection: it brings vLLM, pandas and
# datasets (4 s), which every pytest-xdist worker would import only to collect this file.
pytestmark = [
    pytest.mark.oracle,
    pytest.mark.skipif(find_spec("trl") is None, reason="TRL is not installed"),
]


def trl_loss(logp, old, adv, mask, *, level, clip_low, clip_high, ref=None, beta=0.0):
    """TRL's loss on given log-probs; returns (loss, its metrics)."""
    try:
        trl_grpo = import_module("trl.trainer.grpo_trainer")
    except ModuleNotFoundError as e:  # what importorskip skipped on: TRL lacks a dependency
        pytest.skip(f"TRL's GRPO trainer cannot be imported: {e}")
    trainer = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    B, T = logp.shape
    trainer.__dict__.update(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros(B, T), None),
        importance_sampling_level=level,
        loss_type="grpo",
        epsilon_low=clip_low,
        epsilon_high=clip_high,
        beta=beta,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = trainer._compute_loss(None, inputs)
    return loss, trainer._metrics["train"]


def random_batch(seed: int, B: int = 16, T: int = 24, spread: float = 0.02):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g)
    logp = old + spread * torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g)
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    return logp, old, adv, mask, ref


CASES = [
    # (our level, TRL's importance_sampling_level, clip_low, clip_high, log-prob spread)
    ("sequence", "sequence", 3e-4, 4e-4, 1e-3),  # the paper's GSPO setting, clip binding often
    ("sequence", "sequence", 3e-4, 4e-4, 1e-2),
    ("token", "token", 0.2, 0.27, 0.2),  # GRPO with its tuned clip, binding on some tokens
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("ours", "theirs", "clip_low", "clip_high", "spread"), CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_trl(seed, ours, theirs, clip_low, clip_high, spread, beta) -> None:
    logp, old, adv, mask, ref = random_batch(seed, spread=spread)
    x_ours = logp.clone().requires_grad_(True)
    x_trl = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(
        x_ours,
        old,
        adv,
        mask,
        level=ours,
        clip_low=clip_low,
        clip_high=clip_high,
        ref_logprobs=ref if beta else None,
        kl_coef=beta,
    )
    expected, metrics = trl_loss(
        x_trl,
        old,
        adv,
        mask,
        level=theirs,
        clip_low=clip_low,
        clip_high=clip_high,
        ref=ref if beta else None,
        beta=beta,
    )
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    (g_ours,) = torch.autograd.grad(loss, x_ours)
    (g_trl,) = torch.autograd.grad(expected, x_trl)
    # TRL leaves masked positions' gradient to the mask product; compare where it counts.
    torch.testing.assert_close(g_ours, torch.where(mask, g_trl, 0), rtol=1e-5, atol=1e-8)
    # Clip fractions: TRL counts sequences at its sequence level and tokens at its token level.
    assert float(stats["clip_fraction_low"]) == pytest.approx(metrics["clip_ratio/low_mean"][0])
    assert float(stats["clip_fraction_high"]) == pytest.approx(metrics["clip_ratio/high_mean"][0])
    assert g_ours.abs().sum() > 0


def test_the_gspo_case_exercises_the_clip() -> None:
    # Guard against a vacuous oracle: the paper's band binds for some but not all sequences.
    logp, old, adv, mask, _ = random_batch(0, spread=1e-2)
    _, stats = policy_loss(logp, old, adv, mask, level="sequence", clip_low=3e-4, clip_high=4e-4)
    clipped = float(stats["clip_fraction_low"] + stats["clip_fraction_high"])
    assert 0 < clipped < 1
