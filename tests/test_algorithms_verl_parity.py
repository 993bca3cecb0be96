"""Our pure-torch RL algorithms against verl 0.9.1's own functions, plus scenario tests.

Each parity test is named after the verl function it matches and feeds both the same seeded
random inputs (several shapes, right padding, some rows with one token). Tolerance 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from stand_ins import make_row, random_mask
from workers.core.algorithms.advantages import broadcast_to_tokens, grpo_outcome_advantages
from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import PolicyLossConfig, aggregate_loss, ppo_clip_loss
from workers.core.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction,
    truncated_is_weights,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
rollout_corr_helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

SHAPES = [(1, 5), (4, 7), (8, 33), (16, 64)]
SEEDS = [0, 1, 2]
ATOL = 1e-6


def logprobs(gen: torch.Generator, bsz: int, seq: int, scale: float = 1.0) -> torch.Tensor:
    return -torch.rand(bsz, seq, generator=gen) * 3.0 * scale


def verl_actor_config(**overrides) -> object:
    """Smallest config verl's compute_policy_loss_vanilla reads: clip ratios, dual clip, batch info."""
    base = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    base.update(overrides)
    base["global_batch_info"] = {}
    return OmegaConf.create(base)


# --- GRPO advantages -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_groups,group_size", [(1, 2), (3, 4), (8, 5), (5, 16)])
@pytest.mark.parametrize("norm", [True, False])
def test_compute_grpo_outcome_advantage(seed, num_groups, group_size, norm):
    gen = torch.Generator().manual_seed(seed)
    n, seq = num_groups * group_size, 9
    rewards = torch.rand(n, generator=gen) * 4 - 2
    index = np.array([i % num_groups for i in range(n)])  # interleaved groups
    mask = random_mask(gen, n, seq)
    last = mask.cumsum(-1).argmax(-1)  # reward on each row's last valid token, like verl's reward fn
    token_rewards = torch.zeros(n, seq)
    token_rewards[torch.arange(n), last] = rewards

    want, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
    )
    ours = grpo_outcome_advantages(rewards, index.tolist(), epsilon=1e-6, norm_adv_by_std=norm)
    torch.testing.assert_close(broadcast_to_tokens(ours, mask), want, atol=ATOL, rtol=0)


def test_compute_grpo_outcome_advantage_singleton_group():
    """A lone sample keeps verl's convention: mean 0, std 1, so A = r / (1 + eps)."""
    rewards = torch.tensor([0.7, 1.0, 0.0])
    index = np.array([0, 1, 1])
    want, _ = core_algos.compute_grpo_outcome_advantage(rewards.unsqueeze(-1), torch.ones(3, 1), index)
    torch.testing.assert_close(grpo_outcome_advantages(rewards, index.tolist()), want.squeeze(-1), atol=ATOL, rtol=0)


def test_group_with_identical_rewards_gets_exactly_zero_advantage():
    """Regression: float32 mean of 7 copies of 0.1 is off by ~7e-9 and the std is ~8e-9, so the plain
    formula (verl's) yields ~0.007 instead of 0 for a group that carries no signal."""
    rewards = torch.tensor([0.1] * 7 + [0.3] * 8 + [1.0, 0.0])
    index = [0] * 7 + [1] * 8 + [2, 2]
    adv = grpo_outcome_advantages(rewards, index)
    assert torch.equal(adv[:15], torch.zeros(15))
    # the informative group is still normalised: (1 - 0.5) / (std([1, 0]) + eps) = 0.5 / 0.7071
    assert adv[15].item() == pytest.approx(0.5 / (2**-0.5 + 1e-6), abs=1e-6)
    assert adv[16].item() == pytest.approx(-adv[15].item(), abs=1e-7)


def test_grpo_rejects_non_finite_reward_and_mismatched_index():
    with pytest.raises(ValueError, match="finite"):
        grpo_outcome_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="group_index"):
        grpo_outcome_advantages(torch.tensor([1.0, 0.0]), [0])


# --- PPO loss and aggregation ----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_agg_loss(seed, shape, mode):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(*shape, generator=gen)
    mask = random_mask(gen, *shape)
    torch.testing.assert_close(
        aggregate_loss(loss_mat, mask, mode), core_algos.agg_loss(loss_mat, mask, mode), atol=ATOL, rtol=0
    )
    # global counts and dp scaling, as used for micro-batch accumulation on several ranks
    kw = {"dp_size": 2, "batch_num_tokens": 123, "global_batch_size": 7}
    torch.testing.assert_close(
        aggregate_loss(loss_mat, mask, mode, **kw), core_algos.agg_loss(loss_mat, mask, mode, **kw), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_compute_policy_loss_vanilla(seed, shape, clip, mode, with_weights):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, *shape)
    old = logprobs(gen, *shape)
    new = (old + torch.randn(*shape, generator=gen) * 0.4).requires_grad_(True)  # many clipped tokens
    adv = torch.randn(*shape, generator=gen) * mask
    weights = torch.rand(*shape, generator=gen) * 2 * mask if with_weights else None
    low, high = clip

    want_loss, want_metrics = core_algos.compute_policy_loss_vanilla(
        old, new, adv, mask, loss_agg_mode=mode,
        config=verl_actor_config(clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high),
        rollout_is_weights=weights,
    )
    (want_grad,) = torch.autograd.grad(want_loss, new)
    out = ppo_clip_loss(
        new, old, adv, mask, PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode),
        is_weights=weights,
    )
    (grad,) = torch.autograd.grad(out.loss, new)

    torch.testing.assert_close(out.loss, want_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=ATOL, rtol=0)
    ours = out.metrics()
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[name] == pytest.approx(want_metrics[name], abs=ATOL), name
    assert 0.0 < ours["actor/pg_clipfrac"] < 1.0 or shape[0] * shape[1] < 10  # the test exercises clipping


def test_get_policy_loss_fn_vanilla_is_what_we_match():
    assert core_algos.get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss_vanilla


def test_ppo_loss_on_policy_ratio_one_gives_minus_mean_advantage():
    """π_θ == π_old: ratio 1, nothing clipped, token-mean loss = -Σ A·m / Σ m."""
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1]])
    adv = torch.tensor([[0.0, 2, 2, 0], [0, -1, -1, -1]])
    lp = torch.full((2, 4), -1.0)
    out = ppo_clip_loss(lp, lp, adv, mask, PolicyLossConfig())
    assert out.loss.item() == pytest.approx(-(4 - 3) / 5)  # -(2+2-1-1-1)/5
    assert out.pg_clipfrac.item() == 0.0 and out.ppo_kl.item() == 0.0


def test_dual_clip_off_bounds_nothing_for_negative_advantage():
    """ratio e^3 ≈ 20 with A = -1: dual clip (c=3) caps the loss at 3; without it the loss is 20."""
    lp_new, lp_old = torch.tensor([[0.0, 3.0]]), torch.tensor([[0.0, 0.0]])
    mask, adv = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, -1.0]])
    on = ppo_clip_loss(lp_new, lp_old, adv, mask, PolicyLossConfig(clip_ratio_c=3.0))
    off = ppo_clip_loss(lp_new, lp_old, adv, mask, PolicyLossConfig(clip_ratio_c=None))
    assert on.loss.item() == pytest.approx(3.0) and on.pg_clipfrac_lower.item() == 1.0
    assert off.loss.item() == pytest.approx(torch.e**3, rel=1e-5)


def test_micro_batch_losses_sum_to_mini_batch_token_mean():
    """Gradient accumulation: per-micro-batch losses with the global token count add up exactly."""
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 6, 10)
    lp, old, adv = logprobs(gen, 6, 10), logprobs(gen, 6, 10), torch.randn(6, 10, generator=gen) * mask
    cfg = PolicyLossConfig()
    whole = ppo_clip_loss(lp, old, adv, mask, cfg).loss
    n = mask.sum()
    parts = sum(ppo_clip_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, batch_num_tokens=n).loss
                for i in range(0, 6, 2))
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=0)


def test_policy_loss_config_rejects_bad_values():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="token-sum-norm")  # type: ignore[arg-type]


# --- rollout correction (token TIS) ----------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [2.0, 1.5])
def test_compute_rollout_correction_and_rejection_mask(seed, shape, threshold):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, *shape)
    rollout = logprobs(gen, *shape) * mask
    old = (rollout + torch.randn(*shape, generator=gen) * 0.5) * mask  # some weights above C, some below 1/C

    want_proto, want_mask, want_metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=threshold
    )
    ours = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(is_threshold=threshold))

    torch.testing.assert_close(ours.weights, want_proto.batch["rollout_is_weights"], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.loss_mask, want_mask)
    assert set(ours.metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        assert ours.metrics[name] == pytest.approx(value, rel=1e-5, abs=ATOL), name


@pytest.mark.parametrize("seed", SEEDS)
def test_compute_rollout_correction_weights(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 8, 20)
    log_ratio = torch.randn(8, 20, generator=gen) * 25  # beyond the ±20 safety clamp too
    want, _ = rollout_corr_helper.compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    ours, _ = truncated_is_weights(log_ratio, mask, 2.0)
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


def test_metric_names_include_the_documented_core_set():
    mask = torch.tensor([[0.0, 1, 1]])
    rc = compute_rollout_correction(torch.zeros(1, 3), torch.zeros(1, 3), mask, RolloutCorrectionConfig())
    for name in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "kl", "k3_kl", "log_ppl_diff"):
        assert f"rollout_corr/{name}" in rc.metrics
    assert rc.metrics["rollout_corr/rollout_is_mean"] == 1.0 and rc.metrics["rollout_corr/kl"] == 0.0


def test_tis_weights_are_detached_capped_and_zero_off_mask():
    old = torch.tensor([[0.0, 2.0, -2.0, 0.5, 9.0]], requires_grad=True)
    rollout = torch.zeros(1, 5)
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    rc = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(is_threshold=2.0))
    assert rc.weights is not None and not rc.weights.requires_grad
    # e^2 ≈ 7.39 capped to 2; e^-2 kept; e^0.5 ≈ 1.65 kept; masked positions are 0 (even e^9)
    expected = torch.tensor([[0.0, 2.0, torch.e**-2, torch.e**0.5, 0.0]])
    torch.testing.assert_close(rc.weights, expected)
    assert rc.metrics["rollout_corr/rollout_is_max"] == 2.0
    assert rc.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_rollout_correction_disabled_weights_keeps_diagnostics():
    mask = torch.tensor([[0.0, 1, 1]])
    rc = compute_rollout_correction(torch.full((1, 3), -1.0), torch.full((1, 3), -2.0), mask,
                                    RolloutCorrectionConfig(is_level=None))
    assert rc.weights is None
    assert rc.metrics["rollout_corr/kl"] == pytest.approx(-1.0)  # mean(log π_rollout - log π_old)
    assert not any("rollout_is" in k for k in rc.metrics)


def test_rows_without_trained_tokens_do_not_change_sequence_metrics():
    """Deliberate difference from verl: an all-masked row is not a sequence with weight 0."""
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(gen, 4, 12)
    old, rollout = logprobs(gen, 4, 12) * mask, logprobs(gen, 4, 12) * mask
    base = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig()).metrics
    pad = torch.zeros(1, 12)
    padded = compute_rollout_correction(
        torch.cat([old, pad]), torch.cat([rollout, pad]), torch.cat([mask, pad]), RolloutCorrectionConfig()
    ).metrics
    for name, value in base.items():
        assert padded[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_rollout_correction_rejects_empty_mask_and_bad_threshold():
    with pytest.raises(ValueError, match="no trained token"):
        compute_rollout_correction(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), RolloutCorrectionConfig())
    with pytest.raises(ValueError, match="is_threshold"):
        RolloutCorrectionConfig(is_threshold=1.0)
    with pytest.raises(ValueError, match="is_level"):
        RolloutCorrectionConfig(is_level="geometric")  # type: ignore[arg-type]


# --- TrainBatch ------------------------------------------------------------------------------


def test_train_batch_from_rows_right_pads_and_aligns_tokens():
    rows = [make_row([5, 6], [7, 8, 9], logprobs=(-0.1, -0.2, -0.3)), make_row([5], [4])]
    b = TrainBatch.from_rows(rows, advantages=[1.5, -0.5], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert b.advantages.tolist() == [[0, 0, 1.5, 1.5, 1.5], [0, -0.5, 0, 0, 0]]
    torch.testing.assert_close(b.rollout_logprobs[0], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert b.num_loss_tokens == 4


def test_train_batch_split_keeps_every_row_once():
    rows = [make_row([1, 2], [3] * (i + 1)) for i in range(7)]
    b = TrainBatch.from_rows(rows, advantages=list(range(7)), pad_id=0)
    parts = b.split(3)
    assert [p.batch_size for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), b.input_ids)
    assert parts[0].trimmed().seq_len == 5 and parts[2].trimmed().seq_len == 9
    with pytest.raises(ValueError, match="split size"):
        b.split(0)


def test_train_batch_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="position 0"):
        TrainBatch.from_rows([make_row([], [3, 4])], advantages=[1.0], pad_id=0)
    with pytest.raises(ValueError, match="advantages for"):
        TrainBatch.from_rows([make_row([1], [2])], advantages=[], pad_id=0)
    ok = TrainBatch.from_rows([make_row([1], [2])], advantages=[1.0], pad_id=0)
    with pytest.raises(ValueError, match="padding"):
        TrainBatch(ok.input_ids, torch.tensor([[1, 0]]), ok.loss_mask, ok.rollout_logprobs, ok.advantages)
