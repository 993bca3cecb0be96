"""`TrainBatch`: the padded tensors of one mini-batch, as the trainer consumes them.

Pure torch, no Ray. Built by the loop from recorded `TrajectoryRow`s plus one advantage per row,
then split into mini-batches (and, inside the trainer, into micro-batches).

Alignment (every per-token tensor uses it, including the trainer's log-probs):
    column t holds token t itself, not the next token. logprob[b, t] = log p(token t | tokens < t);
    position 0 has no context, so its log-prob is 0 and its loss mask must be 0. Padding is on the
    right (attention_mask 1 then 0). This is the alignment `TrajectoryRow` already records, so no
    shifting happens between the gateway and the loss.

Invariant (checked in `__post_init__`): all five tensors are [batch, seq]; attention_mask is
right-padded; loss_mask is 0 at column 0 and wherever attention_mask is 0; advantages and
rollout_logprobs are 0 where loss_mask is 0. When a `SampleTable` is attached, every row belongs to
one of its samples and rows of one sample are consecutive, in the sample's recorded order.

The optional `SampleTable` carries what the trainer needs to recompute GRPO advantages after
rejection masks exclude a sample (`workers/core/algorithms/rejection.py`): the group and outcome
reward of every sample of the mini-batch's groups, including samples that have no row here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.core.types import TrajectoryRow


@dataclass(frozen=True)
class SampleTable:
    """Outcome-reward bookkeeping of one mini-batch (S samples, B rows).

    group_index:    [S] long, group id of each sample.
    rewards:        [S] float32, outcome reward of each sample (finite).
    row_sample:     [B] long, the sample (index into S) each batch row belongs to.
    norm_adv_by_std: how the driver normalised the advantages (GRPO: True, Dr. GRPO: False).
    A sample's reward token is the last loss-mask token of its last row; a sample with no row (all
    its tokens masked before batching) still counts in its group's statistics.
    """

    group_index: torch.Tensor
    rewards: torch.Tensor
    row_sample: torch.Tensor
    norm_adv_by_std: bool = True

    def __post_init__(self) -> None:
        if self.group_index.dim() != 1 or self.rewards.shape != self.group_index.shape:
            raise ValueError(
                f"group_index and rewards must both be [num_samples], got {tuple(self.group_index.shape)} "
                f"and {tuple(self.rewards.shape)}"
            )
        if self.row_sample.dim() != 1:
            raise ValueError(f"row_sample must be [batch], got shape {tuple(self.row_sample.shape)}")
        if not bool(torch.isfinite(self.rewards).all()):
            raise ValueError("SampleTable rewards must be finite")
        n = int(self.group_index.shape[0])
        if self.row_sample.numel() and (int(self.row_sample.min()) < 0 or int(self.row_sample.max()) >= n):
            raise ValueError(f"row_sample must index the {n} samples, got values outside [0, {n})")
        if self.row_sample.numel() > 1 and bool((self.row_sample[1:] < self.row_sample[:-1]).any()):
            raise ValueError("rows of one sample must be consecutive and samples in table order (row_sample sorted)")

    @property
    def num_samples(self) -> int:
        return int(self.group_index.shape[0])


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded tensors of B sequences of length T.

    input_ids:        [B, T] long, pad id after each sequence's end.
    attention_mask:   [B, T] long, 1 on real tokens, 0 on padding.
    loss_mask:        [B, T] float32, 1 on tokens whose log-prob is trained (generated tokens).
    rollout_logprobs: [B, T] float32, log π_rollout(token t) from the inference engine (0 off-mask).
    advantages:       [B, T] float32, the row's advantage on loss-mask tokens (0 off-mask).
    samples:          optional SampleTable of the mini-batch (dropped by `select`/`split`: a part of
                      a mini-batch no longer holds whole groups).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    samples: SampleTable | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for name in ("attention_mask", "loss_mask", "rollout_logprobs", "advantages"):
            t = getattr(self, name)
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids has {tuple(shape)}")
        if self.input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be torch.long, got {self.input_ids.dtype}")
        if shape[1] > 1 and bool((self.attention_mask[:, 1:] > self.attention_mask[:, :-1]).any()):
            raise ValueError("attention_mask must be right-padded (1s then 0s in every row)")
        if shape[1] > 0 and bool((self.loss_mask[:, 0] != 0).any()):
            raise ValueError("loss_mask must be 0 at position 0 (no context to predict the first token from)")
        if bool(((self.loss_mask != 0) & (self.attention_mask == 0)).any()):
            raise ValueError("loss_mask is 1 on a padding position (attention_mask 0)")
        off = self.loss_mask == 0
        if bool((self.advantages[off] != 0).any()) or bool((self.rollout_logprobs[off] != 0).any()):
            raise ValueError("advantages and rollout_logprobs must be 0 where loss_mask is 0")
        if self.samples is not None and self.samples.row_sample.shape[0] != shape[0]:
            raise ValueError(
                f"samples.row_sample has {self.samples.row_sample.shape[0]} rows, the batch has {shape[0]}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        """Number of trained tokens (sum of loss_mask)."""
        return int(self.loss_mask.sum().item())

    def num_trained_rollouts(self) -> int:
        """Rollouts with at least one trained token: the rows of one sample (a rollout whose agent
        compacted its history or ran a sub-agent is several rows) count once, by the SampleTable;
        without one, every row with a trained token counts. The seq-mean loss modes divide by this
        (workers/core/algorithms/losses.py `aggregate_loss`), so a rollout weighs the same however
        many rows it split into."""
        has_tokens = self.loss_mask.sum(dim=-1) > 0
        if self.samples is None:
            return int(has_tokens.sum().item())
        return int(torch.unique(self.samples.row_sample[has_tokens]).numel())

    def rollout_num_tokens(self) -> torch.Tensor:
        """[B] float32: the trained tokens of each row's rollout, all its rows together (by the
        SampleTable; without one, the row's own): seq-mean-token-mean's per-sequence denominator, so
        a rollout split into rows still takes one token mean (losses.py `aggregate_loss`)."""
        per_row = self.loss_mask.sum(dim=-1).to(torch.float32)
        if self.samples is None:
            return per_row
        table = self.samples
        per_sample = torch.zeros(table.num_samples, dtype=torch.float32).index_add_(0, table.row_sample, per_row)
        return per_sample[table.row_sample]

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[TrajectoryRow],
        advantages: Sequence[float],
        pad_id: int,
        *,
        samples: SampleTable | None = None,
    ) -> TrainBatch:
        """Right-pad `rows` into one batch; row i's scalar advantage is put on its loss-mask tokens.

        `samples` (optional) is attached as is; its row_sample must have one entry per row.
        Raises ValueError when rows is empty, when len(advantages) != len(rows), when an advantage is
        not finite, or when a row has loss mask 1 at position 0 (a generated token needs a prompt).
        """
        if not rows:
            raise ValueError("from_rows needs at least one TrajectoryRow")
        if len(advantages) != len(rows):
            raise ValueError(f"got {len(advantages)} advantages for {len(rows)} rows")
        adv = torch.tensor([float(a) for a in advantages], dtype=torch.float32)
        if not bool(torch.isfinite(adv).all()):
            raise ValueError(f"advantages must be finite, got {list(advantages)}")
        bsz, seq = len(rows), max(len(r.token_ids) for r in rows)
        input_ids = torch.full((bsz, seq), int(pad_id), dtype=torch.long)
        attention_mask = torch.zeros((bsz, seq), dtype=torch.long)
        loss_mask = torch.zeros((bsz, seq), dtype=torch.float32)
        rollout_logprobs = torch.zeros((bsz, seq), dtype=torch.float32)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            if n and row.loss_mask[0] == 1:
                raise ValueError(f"row {i} has loss mask 1 at position 0; a generated token needs a prompt before it")
            input_ids[i, :n] = torch.tensor(row.token_ids, dtype=torch.long)
            attention_mask[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(row.loss_mask, dtype=torch.float32)
            rollout_logprobs[i, :n] = torch.tensor(row.rollout_logprobs, dtype=torch.float32)
        rollout_logprobs = rollout_logprobs * loss_mask
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
            advantages=adv.unsqueeze(-1) * loss_mask,
            samples=samples,
        )

    def with_loss_mask(self, loss_mask: torch.Tensor, advantages: torch.Tensor | None = None) -> TrainBatch:
        """The same rows trained on a narrower mask (rejection): rollout log-probs and advantages are
        zeroed off the new mask; `advantages` ([B, T], optional) replaces the old ones first.

        Raises ValueError when the new mask is 1 where the old one is 0, or shapes differ.
        """
        if loss_mask.shape != self.loss_mask.shape:
            raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, batch has {tuple(self.loss_mask.shape)}")
        if bool(((loss_mask != 0) & (self.loss_mask == 0)).any()):
            raise ValueError("with_loss_mask may only narrow the mask (new 1 where the old mask is 0)")
        loss_mask = loss_mask.to(self.loss_mask.dtype)
        adv = self.advantages if advantages is None else advantages
        return TrainBatch(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            loss_mask=loss_mask,
            rollout_logprobs=self.rollout_logprobs * loss_mask,
            advantages=adv * loss_mask,
            samples=self.samples,
        )

    def select(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) as a new batch (views, no copy)."""
        return TrainBatch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            loss_mask=self.loss_mask[start:stop],
            rollout_logprobs=self.rollout_logprobs[start:stop],
            advantages=self.advantages[start:stop],
        )

    def split(self, size: int) -> list[TrainBatch]:
        """Consecutive batches of `size` rows each (the last may be smaller), like `torch.split`.

        Raises ValueError when size < 1.
        """
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.select(i, min(i + size, self.batch_size)) for i in range(0, self.batch_size, size)]

    def trimmed(self) -> TrainBatch:
        """The same rows without trailing columns that are padding in every row (saves compute)."""
        lengths = self.attention_mask.sum(dim=-1)
        width = int(lengths.max().item()) if self.batch_size else 0
        if width == self.seq_len:
            return self
        return TrainBatch(
            input_ids=self.input_ids[:, :width],
            attention_mask=self.attention_mask[:, :width],
            loss_mask=self.loss_mask[:, :width],
            rollout_logprobs=self.rollout_logprobs[:, :width],
            advantages=self.advantages[:, :width],
            samples=self.samples,
        )
