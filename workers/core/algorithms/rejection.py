"""Apply a rejection mask to a mini-batch, including its effect on GRPO outcome advantages.

Pure torch. The trainer calls `apply_rejection` once per mini-batch, after
`compute_rollout_correction` returned the narrowed loss mask (it needs π_old, so only the trainer
knows it; the driver computed the advantages before).

Interpretation (outcome rewards, one scalar per sample, placed on the sample's last generated
token, the "reward token" = last loss-mask token of the sample's last row):
- A rejected token contributes nothing to the loss (its loss-mask entry is 0).
- A rejected token that is not a reward token changes no advantage: with an outcome reward, every
  token's advantage comes from the sample's reward and its group's statistics, not from the action
  taken at another token.
- A rejected reward token means the sample's outcome is not admitted: the sample is excluded. It
  produces no advantage (every one of its tokens leaves the loss) and its reward leaves its group's
  mean and std. The group's kept samples get their GRPO advantages recomputed over the kept rewards
  (same formula and `norm_adv_by_std` as the driver). A group left with one kept sample (out of
  several) has no baseline: that sample gets advantage 0. Sequence-level rules reject whole rows,
  so a sample whose last row is rejected, in particular one whose tokens are all rejected, is
  excluded.
- Samples of the table without a row in the batch (masked before batching, e.g. stale samples
  trained masked) were never evaluated by the rules: they stay in their group's statistics.

Invariant: groups without an excluded sample keep exactly the driver's advantages; the returned
loss mask is the rejection mask with every row of an excluded sample zeroed.
Raises ValueError when a reward token is rejected and the batch carries no SampleTable (the
groups, hence the correct advantages, are unknown on the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.core.algorithms.advantages import grpo_outcome_advantages
from workers.core.algorithms.batch import TrainBatch


@dataclass(frozen=True)
class RejectionOutcome:
    """The batch to train on, plus how many samples and groups the rejection touched.

    batch: narrowed loss mask, rollout log-probs and advantages 0 off it, advantages recomputed.
    num_samples: samples with at least one row in the batch (rows, without a SampleTable).
    num_excluded: of those, samples whose reward token was rejected.
    num_groups_recomputed: groups whose advantages were recomputed.
    """

    batch: TrainBatch
    num_samples: int
    num_excluded: int
    num_groups_recomputed: int

    def metrics(self) -> dict[str, float]:
        """`rollout_corr/rs_excluded_sample_fraction` and `rollout_corr/rs_recomputed_groups`."""
        frac = self.num_excluded / self.num_samples if self.num_samples else 0.0
        return {
            "rollout_corr/rs_excluded_sample_fraction": float(frac),
            "rollout_corr/rs_recomputed_groups": float(self.num_groups_recomputed),
        }


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """[batch] column of each row's last loss-mask token, -1 for a row without one."""
    cols = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    return torch.where(loss_mask.bool(), cols, torch.full_like(cols, -1)).max(dim=-1).values


def apply_rejection(batch: TrainBatch, keep_mask: torch.Tensor) -> RejectionOutcome:
    """Train-ready batch after rejection (see the module docstring for the rules).

    Args:
        batch: the mini-batch as the driver built it (advantages from all rewards).
        keep_mask: [batch, seq] the loss mask after rejection (batch.loss_mask × keep).

    Raises:
        ValueError: shapes differ, keep_mask widens the mask, or a reward token is rejected in a
            batch without a SampleTable.
    """
    if keep_mask.shape != batch.loss_mask.shape:
        raise ValueError(f"keep_mask has shape {tuple(keep_mask.shape)}, batch has {tuple(batch.loss_mask.shape)}")
    last = last_token_index(batch.loss_mask)
    has_tokens = last >= 0
    rows = torch.arange(batch.batch_size)
    reward_kept = keep_mask[rows, last.clamp(min=0)].bool() | ~has_tokens  # [B]; a row without tokens rejects nothing
    table = batch.samples
    if table is None:
        if not bool(reward_kept.all()):
            raise ValueError(
                "a rejection rule rejected a sample's last (reward) token, but the batch has no SampleTable: "
                "the trainer cannot recompute group advantages; build the batch with samples=SampleTable(...)"
            )
        return RejectionOutcome(batch.with_loss_mask(keep_mask), int(has_tokens.sum()), 0, 0)

    num_s = table.num_samples
    # the reward row of a sample is its last row with a trained token (rows of a sample are consecutive)
    row_ids = torch.where(has_tokens, rows, torch.full_like(rows, -1))
    reward_row = torch.full((num_s,), -1, dtype=torch.long).scatter_reduce(
        0, table.row_sample, row_ids, reduce="amax", include_self=True
    )
    in_batch = reward_row >= 0
    excluded = in_batch & ~reward_kept[reward_row.clamp(min=0)]
    if not bool(excluded.any()):
        return RejectionOutcome(batch.with_loss_mask(keep_mask), int(in_batch.sum()), 0, 0)

    sample_adv = _sample_advantages(batch, table.row_sample, num_s, has_tokens)
    touched = torch.unique(table.group_index[excluded])
    for gid in touched.tolist():
        members = (table.group_index == gid).nonzero(as_tuple=True)[0]
        kept = members[~excluded[members]]
        sample_adv[members] = 0.0
        if kept.numel() >= 2 or (kept.numel() == 1 and members.numel() == 1):
            sample_adv[kept] = grpo_outcome_advantages(
                table.rewards[kept], torch.zeros_like(kept), norm_adv_by_std=table.norm_adv_by_std
            ).to(sample_adv.dtype)
    row_excluded = excluded[table.row_sample]
    final_mask = keep_mask * (~row_excluded).to(keep_mask.dtype).unsqueeze(-1)
    advantages = sample_adv[table.row_sample].unsqueeze(-1) * batch.loss_mask
    return RejectionOutcome(
        batch=batch.with_loss_mask(final_mask, advantages=advantages),
        num_samples=int(in_batch.sum()),
        num_excluded=int(excluded.sum()),
        num_groups_recomputed=len(touched),
    )


def _sample_advantages(
    batch: TrainBatch, row_sample: torch.Tensor, num_samples: int, has_tokens: torch.Tensor
) -> torch.Tensor:
    """[num_samples] the driver's scalar advantage of each sample (0 for a sample without a row).

    Read from each row's first trained token; rows of one sample carry the same advantage.
    """
    first = torch.where(batch.loss_mask.bool(), torch.arange(batch.seq_len).expand_as(batch.loss_mask),
                        torch.full_like(batch.input_ids, batch.seq_len)).min(dim=-1).values.clamp(max=batch.seq_len - 1)
    row_adv = batch.advantages[torch.arange(batch.batch_size), first] * has_tokens.to(batch.advantages.dtype)
    out = torch.zeros(num_samples, dtype=batch.advantages.dtype)
    return out.index_copy(0, row_sample[has_tokens], row_adv[has_tokens])
