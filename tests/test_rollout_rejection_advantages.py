"""Rejection and GRPO advantages: a rejected reward token excludes its sample from the group.

Batches are built by the driver's own `build_train_batch` from real `Sample`s, so the SampleTable
contract between driver and trainer is exercised too. Expected advantages are derived in comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.core.algorithms.advantages import grpo_outcome_advantages
from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import PolicyLossConfig, ppo_clip_loss
from workers.core.algorithms.rejection import apply_rejection, last_token_index
from workers.core.algorithms.rollout_correction import RejectionRule, RolloutCorrectionConfig, compute_rollout_correction
from orchestrator.loop.batching import Group
from stand_ins import groups_batch
from stand_ins import make_group, make_sample, seeded_row
from workers.core.types import TrajectoryRow


def row_advantage(batch: TrainBatch, b: int) -> float:
    return float(batch.advantages[b][batch.loss_mask[b].bool()][0])


def reject_last_token(batch: TrainBatch, rows: list[int]) -> torch.Tensor:
    keep = batch.loss_mask.clone()
    last = last_token_index(batch.loss_mask)
    for b in rows:
        keep[b, last[b]] = 0.0
    return keep


def test_driver_batch_carries_the_sample_table():
    batch = groups_batch((make_group(7, [1.0, 0.0]), make_group(9, [0.0, 1.0, 1.0])), pad_id=0, norm_adv_by_std=True)
    assert batch.samples is not None
    assert batch.samples.group_index.tolist() == [7, 7, 9, 9, 9]
    assert batch.samples.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert batch.samples.row_sample.tolist() == [0, 1, 2, 3, 4]
    assert batch.select(0, 2).samples is None  # a part of a mini-batch no longer holds whole groups


def test_rejected_reward_token_excludes_the_sample_from_its_group():
    """Group 0 rewards [1, 0, 0.5]; sample 1's reward token is rejected. Group 0 is recomputed over
    [1, 0.5]: mean 0.75, unbiased std 0.3536, A = ±0.25/0.3536 = ±0.7071. Sample 1 trains no token.
    Group 1 keeps the driver's advantages exactly."""
    batch = groups_batch((make_group(0, [1.0, 0.0, 0.5]), make_group(1, [1.0, 0.0, 0.0])), pad_id=0,
                              norm_adv_by_std=True)
    out = apply_rejection(batch, reject_last_token(batch, [1]))
    b = out.batch
    assert row_advantage(b, 0) == pytest.approx(0.25 / math.sqrt(0.125), rel=1e-5)
    assert row_advantage(b, 2) == pytest.approx(-0.25 / math.sqrt(0.125), rel=1e-5)
    assert b.loss_mask[1].sum() == 0 and b.advantages[1].abs().sum() == 0
    for r in (3, 4, 5):
        assert torch.equal(b.advantages[r], batch.advantages[r])
        assert torch.equal(b.loss_mask[r], batch.loss_mask[r])
    assert (out.num_samples, out.num_excluded, out.num_groups_recomputed) == (6, 1, 1)
    assert out.metrics()["rollout_corr/rs_excluded_sample_fraction"] == pytest.approx(1 / 6)


def test_rejected_middle_token_leaves_every_advantage_alone():
    batch = groups_batch((make_group(0, [1.0, 0.0, 0.5]),), pad_id=0, norm_adv_by_std=True)
    keep = batch.loss_mask.clone()
    keep[2, 3] = 0.0  # row 2 trains columns 2..6; column 3 is not its last token
    out = apply_rejection(batch, keep)
    assert out.num_excluded == 0
    assert out.batch.loss_mask[2, 3] == 0 and out.batch.loss_mask[2].sum() == batch.loss_mask[2].sum() - 1
    nonzero = out.batch.loss_mask.bool()
    torch.testing.assert_close(out.batch.advantages[nonzero], batch.advantages[nonzero])


def test_sequence_with_every_token_rejected_leaves_group_mean_and_std():
    """seq_mean_k3 rejects sample 0 of group [0, 1, 1, 0] entirely (its ratio is e). The kept
    rewards [1, 1, 0] give mean 2/3, std 0.5774: A = (1/3)/0.5774 = 0.5774 and -1.1547."""
    batch = groups_batch((make_group(0, [0.0, 1.0, 1.0, 0.0]),), pad_id=0, norm_adv_by_std=True)
    old = batch.rollout_logprobs.clone()
    old[0] += batch.loss_mask[0] * 1.0
    rc = compute_rollout_correction(old, batch.rollout_logprobs, batch.loss_mask,
                                    RolloutCorrectionConfig(rs=(RejectionRule("seq_mean_k3", upper=0.1),)))
    assert rc.loss_mask[0].sum() == 0 and rc.loss_mask[1:].sum() == batch.loss_mask[1:].sum()
    out = apply_rejection(batch, rc.loss_mask)
    want = grpo_outcome_advantages(torch.tensor([1.0, 1.0, 0.0]), [0, 0, 0])
    got = torch.tensor([row_advantage(out.batch, r) for r in (1, 2, 3)])
    torch.testing.assert_close(got, want)
    assert got.tolist() == pytest.approx([1 / math.sqrt(3), 1 / math.sqrt(3), -2 / math.sqrt(3)], rel=1e-5)


def test_group_left_with_one_sample_has_no_baseline():
    batch = groups_batch((make_group(0, [1.0, 0.0]),), pad_id=0, norm_adv_by_std=True)
    out = apply_rejection(batch, reject_last_token(batch, [1]))
    assert row_advantage(out.batch, 0) == 0.0  # no group left to compare with: no signal
    assert out.batch.loss_mask[1].sum() == 0


def test_sample_masked_before_batching_stays_in_group_statistics():
    """Sample 0 (reward 1) has no trained token (masked before batching: no row in the batch) but
    stays in group statistics. Rejecting sample 2 (reward 0.5) leaves [1, 0]: A(sample 1) = -0.7071."""
    masked = seeded_row(2, 3)
    masked = TrajectoryRow(masked.token_ids, (0,) * 5, (0.0,) * 5, (-1,) * 5)
    group = Group(0, (make_sample(0, 0, 1.0, rows=(masked,)), make_sample(0, 1, 0.0), make_sample(0, 2, 0.5)))
    batch = groups_batch((group,), pad_id=0, norm_adv_by_std=True)
    assert batch.batch_size == 2 and batch.samples.row_sample.tolist() == [1, 2]
    out = apply_rejection(batch, reject_last_token(batch, [1]))
    assert row_advantage(out.batch, 0) == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
    assert out.num_samples == 2 and out.num_excluded == 1


def test_only_the_last_row_of_a_multi_row_sample_carries_the_reward_token():
    rows = (seeded_row(2, 3, 1), seeded_row(3, 4, 2))
    group = Group(0, (make_sample(0, 0, 1.0, rows=rows), make_sample(0, 1, 0.0), make_sample(0, 2, 0.5)))
    batch = groups_batch((group,), pad_id=0, norm_adv_by_std=True)
    assert batch.samples.row_sample.tolist() == [0, 0, 1, 2]
    first_row_end = apply_rejection(batch, reject_last_token(batch, [0]))
    assert first_row_end.num_excluded == 0
    last_row_end = apply_rejection(batch, reject_last_token(batch, [1]))
    assert last_row_end.num_excluded == 1
    assert last_row_end.batch.loss_mask[:2].sum() == 0  # both rows of the excluded sample leave the loss


def test_rejected_reward_token_without_sample_table_raises():
    batch = groups_batch((make_group(0, [1.0, 0.0]),), pad_id=0, norm_adv_by_std=True)
    bare = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs, batch.advantages)
    with pytest.raises(ValueError, match="SampleTable"):
        apply_rejection(bare, reject_last_token(bare, [0]))
    keep = bare.loss_mask.clone()
    keep[0, 2] = 0.0  # a middle token: no advantage changes, no table needed
    assert apply_rejection(bare, keep).batch.loss_mask[0, 2] == 0


@pytest.mark.parametrize("seed", range(6))
def test_randomized_invariants(seed):
    """Random groups and keep masks: untouched groups keep the driver's advantages, excluded samples
    train nothing, kept samples of touched groups carry GRPO advantages over the kept rewards."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(4):
        n = int(torch.randint(2, 6, (1,), generator=gen))
        rewards = torch.randint(0, 3, (n,), generator=gen).float().tolist()
        groups.append(make_group(g, rewards))
    batch = groups_batch(tuple(groups), pad_id=0, norm_adv_by_std=bool(seed % 2))
    keep = batch.loss_mask * (torch.rand(batch.loss_mask.shape, generator=gen) > 0.3).float()
    out = apply_rejection(batch, keep)
    table, b = batch.samples, out.batch
    last = last_token_index(batch.loss_mask)
    excluded = {int(table.row_sample[r]) for r in range(batch.batch_size) if keep[r, last[r]] == 0}
    assert out.num_excluded == len(excluded)
    assert bool((b.loss_mask <= keep).all())
    for r in range(batch.batch_size):
        s = int(table.row_sample[r])
        gid = int(table.group_index[s])
        members = (table.group_index == gid).nonzero(as_tuple=True)[0].tolist()
        touched = any(m in excluded for m in members)
        if s in excluded:
            assert b.loss_mask[r].sum() == 0
        elif not touched:
            assert torch.equal(b.advantages[r], batch.advantages[r] * keep[r])
        else:
            kept = [m for m in members if m not in excluded]
            if len(kept) >= 2:
                adv = grpo_outcome_advantages(table.rewards[kept], [0] * len(kept), norm_adv_by_std=table.norm_adv_by_std)
                want = float(adv[kept.index(s)])
            else:
                want = 0.0
            torch.testing.assert_close(b.advantages[r], want * keep[r])


def test_rejected_tokens_get_zero_gradient_in_the_loss():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(3, 6)
    mask[:, 1:] = 1.0
    rollout = -torch.rand(3, 6, generator=gen) * mask
    old = rollout + torch.randn(3, 6, generator=gen) * 0.4 * mask
    rc = compute_rollout_correction(old, rollout, mask,
                                    RolloutCorrectionConfig(rs=(RejectionRule("token_k1", lower=0.8, upper=1.25),)))
    rejected = (mask == 1) & (rc.loss_mask == 0)
    assert bool(rejected.any()) and bool((rc.loss_mask == 1).any())
    log_prob = old.clone().requires_grad_(True)
    out = ppo_clip_loss(log_prob, old, torch.ones(3, 6) * mask, rc.loss_mask, PolicyLossConfig(), is_weights=rc.weights)
    out.loss.backward()
    assert bool((log_prob.grad[rejected] == 0).all())
    assert bool((log_prob.grad[rc.loss_mask == 1] != 0).all())
